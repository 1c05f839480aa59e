// y = x W^T for a few rows of x against weight-only int8 (a scale per output row) or int4 (group-wise) weights.
//
// At decode a step reads every weight once, so the cost is the weight bytes: this kernel streams the
// weight rows once per block of output features, multiplying their integer codes by int16 codes of the
// activations (below), where torch's `_weight_int8pack_mm` reached about half the memory bandwidth of a
// bf16 GEMV on the machines we measured (and is 5-10x slower still with fp32 activations). Work is split over
// output features; within a block of BN rows (a few KiB, L1-resident) every group of up to 4 activation rows
// reuses the weights from L1 (beyond a few rows the caller dequantizes and runs a GEMM).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "widen.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PAGEDSERVE_AVX512 1
#endif

namespace {

constexpr int64_t BN = 16;  // output rows per work block
constexpr int64_t TILE_KIB = 2048;  // dequantized tile for the many-row GEMM: L2/L3-resident
constexpr int64_t MAX_GROUPS = 1024;  // int4 32-code chunks per row: K up to 32768

using pagedserve::narrow;
using pagedserve::widen;

// ---- activations as int16 codes ---------------------------------------------------------------------
// The GEMVs multiply integer codes by integer codes: each activation row is quantized to int16 with its own
// scale (|code| <= XQ_MAX, relative error <= 2^-16 of the row's absmax; llama.cpp uses 8 bits per 32
// values), so one vpdpwssd (or vpmaddwd + add) does 32 multiply-adds of widened weight codes where the fp32
// path needed a widen, a convert and an FMA per 16: the int8 GEMV went from ~15 GB/s to the memory's speed.
// int32 lanes stay exact: each instruction adds at most 2 * 128 * 32767 < 2^23 to a lane, and every
// accumulator is flushed to fp32 after KB codes (at most 256 additions per lane, on AVX2 too).
constexpr float XQ_MAX = 32767.f;
constexpr int64_t KB = 4096;

struct Int16Rows {
  std::vector<int16_t> q;  // [M, Kp], zero beyond K
  std::vector<float> scale;  // [M]: x[m, k] ~= q[m, k] * scale[m]
  std::vector<float> xsum;  // [M, G]: the per-group sums of the codes times scale (int4's bias term), if asked
  int64_t Kp = 0;
  const int16_t* row(int64_t m) const { return q.data() + m * Kp; }
};

// x [M, K] -> int16 codes; pad: Kp a multiple of it; groups > 0: also the sums of x per K / groups values
template <typename T>
Int16Rows quantize_rows(const T* x, int64_t M, int64_t K, int64_t pad, int64_t groups) {
  Int16Rows r;
  r.Kp = (K + pad - 1) / pad * pad;
  r.q.assign(M * r.Kp, 0);
  r.scale.resize(M);
  r.xsum.assign(groups > 0 ? M * groups : 0, 0.f);
  std::vector<float> xf(K);
  for (int64_t m = 0; m < M; ++m) {
    float amax = 0.f;
    for (int64_t k = 0; k < K; ++k) {  // vectorised by the compiler (widen is a shift for bf16)
      xf[k] = widen(x[m * K + k]);
      amax = std::max(amax, std::abs(xf[k]));
    }
    const float inv = amax > 0.f ? XQ_MAX / amax : 0.f;
    r.scale[m] = amax / XQ_MAX;
    int16_t* q = r.q.data() + m * r.Kp;
    int64_t k = 0;
#ifdef PAGEDSERVE_AVX512
    const __m512 vinv = _mm512_set1_ps(inv);
    for (; k + 16 <= K; k += 16)  // round to nearest even, as the scalar tail
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k),
                          _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(&xf[k]), vinv))));
#elif defined(__AVX2__)
    const __m256 vinv = _mm256_set1_ps(inv);
    for (; k + 16 <= K; k += 16) {
      const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(&xf[k]), vinv));
      const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(&xf[k + 8]), vinv));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k), _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8));
    }
#endif
    for (; k < K; ++k) q[k] = static_cast<int16_t>(std::nearbyint(xf[k] * inv));
    if (groups > 0) {  // from the codes, not x: the bias term then cancels the codes' offset exactly
      const int64_t group = K / groups;
      for (int64_t g = 0; g < groups; ++g) {
        int32_t s = 0;
        for (int64_t i = g * group; i < (g + 1) * group; ++i) s += q[i];
        r.xsum[m * groups + g] = static_cast<float>(s) * r.scale[m];
      }
    }
  }
  return r;
}

#ifdef __AVX512VNNI__
#define PAGEDSERVE_DPWSSD(acc, a, b) _mm512_dpwssd_epi32(acc, a, b)
#else
#define PAGEDSERVE_DPWSSD(acc, a, b) _mm512_add_epi32(acc, _mm512_madd_epi16(a, b))
#endif

// ---- int8 ------------------------------------------------------------------------------------------
// acc[m] = sum_k w[k] * xq[m][k] for one int8 weight row and MR activation rows (in codes: the caller applies
// both scales). One weight row at a time: tiles of several rows (reusing each activation load) measured ~2x
// slower at M = 1 on Zen 4, whose prefetcher streams one row well. U independent accumulators per activation
// row keep the multiply-add latency off the critical path at M = 1.
template <int MR>
inline void dot_row(const int8_t* w, const Int16Rows& x, int64_t m0, int64_t K, float* acc) {
  const int16_t* xq[MR];
  for (int m = 0; m < MR; ++m) xq[m] = x.row(m0 + m);
#ifdef PAGEDSERVE_AVX512
  constexpr int U = MR == 1 ? 2 : 1;
  __m512 f[MR];
  for (int m = 0; m < MR; ++m) f[m] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < K; k0 += KB) {
    const int64_t k1 = std::min(K, k0 + KB);
    __m512i s[MR][U];
    for (int m = 0; m < MR; ++m)
      for (int u = 0; u < U; ++u) s[m][u] = _mm512_setzero_si512();
    int64_t k = k0;
    for (; k + 32 * U <= k1; k += 32 * U)
      for (int u = 0; u < U; ++u) {
        const __m512i w16 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k + 32 * u)));
        for (int m = 0; m < MR; ++m) s[m][u] = PAGEDSERVE_DPWSSD(s[m][u], w16, _mm512_loadu_si512(xq[m] + k + 32 * u));
      }
    for (; k < k1; k += 32) {  // the tail, masked to the row's end (the codes beyond K are zero)
      const __mmask32 mask = k + 32 <= k1 ? 0xFFFFFFFFu : (1u << (k1 - k)) - 1;
      const __m512i w16 = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(mask, w + k));
      for (int m = 0; m < MR; ++m) s[m][0] = PAGEDSERVE_DPWSSD(s[m][0], w16, _mm512_loadu_si512(xq[m] + k));
    }
    for (int m = 0; m < MR; ++m)
      for (int u = 0; u < U; ++u) f[m] = _mm512_add_ps(f[m], _mm512_cvtepi32_ps(s[m][u]));
  }
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_reduce_add_ps(f[m]);
#elif defined(__AVX2__)
  constexpr int U = MR == 1 ? 2 : 1;
  __m256 f[MR];
  for (int m = 0; m < MR; ++m) f[m] = _mm256_setzero_ps();
  int32_t tail[MR] = {};
  for (int64_t k0 = 0; k0 < K; k0 += KB) {
    const int64_t k1 = std::min(K, k0 + KB);
    __m256i s[MR][U];
    for (int m = 0; m < MR; ++m)
      for (int u = 0; u < U; ++u) s[m][u] = _mm256_setzero_si256();
    int64_t k = k0;
    auto chunk = [&](int64_t kk, int u) __attribute__((always_inline)) {
      const __m256i w16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + kk)));
      for (int m = 0; m < MR; ++m)
        s[m][u] = _mm256_add_epi32(
            s[m][u], _mm256_madd_epi16(w16, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[m] + kk))));
    };
    for (; k + 16 * U <= k1; k += 16 * U)
      for (int u = 0; u < U; ++u) chunk(k + 16 * u, u);
    for (; k + 16 <= k1; k += 16) chunk(k, 0);
    for (; k < k1; ++k)
      for (int m = 0; m < MR; ++m) tail[m] += w[k] * xq[m][k];
    for (int m = 0; m < MR; ++m)
      for (int u = 0; u < U; ++u) f[m] = _mm256_add_ps(f[m], _mm256_cvtepi32_ps(s[m][u]));
  }
  for (int m = 0; m < MR; ++m) acc[m] = pagedserve::hsum(f[m]) + static_cast<float>(tail[m]);
#else
  for (int m = 0; m < MR; ++m) {
    acc[m] = 0.f;
    for (int64_t k0 = 0; k0 < K; k0 += KB) {
      int32_t s = 0;
      for (int64_t k = k0; k < std::min(K, k0 + KB); ++k) s += w[k] * xq[m][k];
      acc[m] += static_cast<float>(s);
    }
  }
#endif
}

template <typename T>
void int8_linear_impl(const T* x, int64_t M, int64_t K, const int8_t* w, const float* scale, int64_t N, T* out) {
  const Int16Rows xq = quantize_rows(x, M, K, 32, 0);
  at::parallel_for(0, (N + BN - 1) / BN, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t n = b0 * BN; n < std::min(N, b1 * BN); ++n) {
      for (int64_t m = 0; m < M; m += 4) {  // the row's codes reused from L1 by up to 4 activation rows
        float acc[4];
        const int64_t mr = std::min<int64_t>(4, M - m);
        switch (mr) {
          case 4: dot_row<4>(w + n * K, xq, m, K, acc); break;
          case 3: dot_row<3>(w + n * K, xq, m, K, acc); break;
          case 2: dot_row<2>(w + n * K, xq, m, K, acc); break;
          default: dot_row<1>(w + n * K, xq, m, K, acc); break;
        }
        for (int64_t i = 0; i < mr; ++i) out[(m + i) * N + n] = narrow<T>(acc[i] * xq.scale[m + i] * scale[n]);
      }
    }
  });
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "int8_linear: x [M, K], w [N, K]");
  TORCH_CHECK(w.scalar_type() == at::kChar && scale.scalar_type() == at::kFloat && scale.numel() == w.size(0),
              "int8_linear: int8 weight with one fp32 scale per row");
  const auto xc = x.contiguous();
  const auto wc = w.contiguous();
  const auto sc = scale.contiguous();
  auto out = at::empty({x.size(0), w.size(0)}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "int8_linear", [&] {
    int8_linear_impl<scalar_t>(xc.data_ptr<scalar_t>(), x.size(0), x.size(1), wc.data_ptr<int8_t>(),
                               sc.data_ptr<float>(), w.size(0), out.data_ptr<scalar_t>());
  });
  return out;
}

// ---- int4 ------------------------------------------------------------------------------------------
// w[n, k] = c * scale[n, g] + bias[n, g] (fp16 or fp32) for the 4-bit code c of k in group g = k / group; codes
// two per byte, k even in the low nibble (engine/quant/formats.py pack_nibbles). Per row,
//   y = sx * (sum_g scale_g * sum_{k in g} c_k xq_k  +  sum_g bias_g * sum_{k in g} xq_k),
// so the inner loop multiplies raw codes by activation codes in int32 (one group at a time, converted and
// scaled per chunk) and the bias term is one short dot product with the per-group sums of the activation codes.
// Both terms see the same rounded activations, so the codes' offset of 8 (bias = zero - 8 * scale) cancels
// exactly; with the exact sums of x it amplified the activations' rounding error ~6x (per-tensor scales).
// The activation codes are reordered once per call to match the nibble order of a vector load of codes:
// per CHUNK codes, the CHUNK / 2 at even k, then the CHUNK / 2 at odd k.
#ifdef PAGEDSERVE_AVX512
constexpr int64_t CHUNK = 64;  // codes per vector step (32 bytes widened to 32 int16 lanes, low and high nibbles)
#else
constexpr int64_t CHUNK = 32;
#endif

inline void reorder_even_odd(Int16Rows& x, int64_t M) {
  std::vector<int16_t> tmp(CHUNK);
  for (int64_t m = 0; m < M; ++m) {
    int16_t* q = x.q.data() + m * x.Kp;
    for (int64_t k = 0; k < x.Kp; k += CHUNK) {
      for (int64_t i = 0; i < CHUNK / 2; ++i) tmp[i] = q[k + 2 * i], tmp[CHUNK / 2 + i] = q[k + 2 * i + 1];
      std::memcpy(q + k, tmp.data(), CHUNK * sizeof(int16_t));
    }
  }
}

#ifdef PAGEDSERVE_AVX512
inline __m512 load16(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
inline __m512 load16(const at::Half* p, __mmask16 mask) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p));
}

// The per-row part, vectorised: the row's scales widened into sc (and spread per 32 codes into cs where a
// group is longer), and sb[m] = lane-wise terms of sum_g bias_g * xsum[m, g].
template <int MR, typename S>
inline const float* row_prologue(const S* scale, const S* bias, const float* xsum, int64_t G, int64_t per,
                                 float* sc, float* cs, __m512* sb) {
  for (int64_t g = 0; g < G; g += 16) {
    const __mmask16 mask = g + 16 <= G ? 0xFFFF : static_cast<__mmask16>((1u << (G - g)) - 1);
    // a full store (sc has room): a masked one cannot forward to the scalar loads that follow, which then
    // waited for it to retire, row after row
    _mm512_storeu_ps(sc + g, load16(scale + g, mask));
    const __m512 b = load16(bias + g, mask);
    for (int m = 0; m < MR; ++m) sb[m] = _mm512_fmadd_ps(b, _mm512_maskz_loadu_ps(mask, xsum + m * G + g), sb[m]);
  }
  if (per == 1) return sc;
  for (int64_t g = 0; g < G; ++g)  // no division: a variable int64 divide per element cost more than the codes
    for (int64_t p = 0; p < per; ++p) cs[g * per + p] = sc[g];
  return cs;
}

// acc[m] = the row's dot product with activation row m (both scales applied). Lane l of vpdpwssd sums int16
// pair (2l, 2l + 1), i.e. codes k = 64j + 4l (+2) from the low nibbles and (+1, +3) from the high ones: lanes
// 0-7 lie in the chunk's first 32 codes, lanes 8-15 in its second, hence the scale vector blends two 32-code
// scales. A K that ends half-way through a chunk loads 16 bytes (the codes beyond K count as zero).
// PER: 32-code pieces per group when the compiler should know it (1: group 32, 2: group 64), else 0: a row of
// K's per-32 scales is spread out first. At group 64 a chunk is one group: one broadcast, no per-row spread.
template <int MR, int PER, typename S>
inline void dot_row_int4(const uint8_t* c, const S* scale, const S* bias, const Int16Rows& x, int64_t m0, int64_t K,
                         int64_t G, float* buf, float* acc) {
  constexpr int U = MR == 1 ? 2 : 1;
  __m512 sb[MR], f[MR][U];
  for (int m = 0; m < MR; ++m) {
    sb[m] = _mm512_setzero_ps();
    for (int u = 0; u < U; ++u) f[m][u] = _mm512_setzero_ps();
  }
  const float* cs = row_prologue<MR>(scale, bias, x.xsum.data() + m0 * G, G, PER ? 1 : K / 32 / G, buf,
                                     buf + MAX_GROUPS, sb);
  const int16_t* xq[MR];
  for (int m = 0; m < MR; ++m) xq[m] = x.row(m0 + m);
  const __m512i nib = _mm512_set1_epi16(15);
  auto chunk = [&](int64_t j, int u, __m512i b, __m512 sc) __attribute__((always_inline)) {
    const __m512i lo = _mm512_and_si512(b, nib), hi = _mm512_srli_epi16(b, 4);
    for (int m = 0; m < MR; ++m) {
      __m512i t = _mm512_madd_epi16(lo, _mm512_loadu_si512(xq[m] + 64 * j));
      t = PAGEDSERVE_DPWSSD(t, hi, _mm512_loadu_si512(xq[m] + 64 * j + 32));
      f[m][u] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), sc, f[m][u]);
    }
  };
  auto codes = [&](int64_t j) __attribute__((always_inline)) {
    return _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32 * j)));
  };
  auto scales = [&](int64_t j) __attribute__((always_inline)) {
    if constexpr (PER == 2) return _mm512_set1_ps(cs[j]);
    return _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(cs[2 * j]), _mm512_set1_ps(cs[2 * j + 1]));
  };
  const int64_t chunks = K / 64;
  int64_t j = 0;
  for (; j + U <= chunks; j += U)
    for (int u = 0; u < U; ++u) chunk(j + u, u, codes(j + u), scales(j + u));
  for (; j < chunks; ++j) chunk(j, 0, codes(j), scales(j));
  if (K % 64)  // 32 codes left: one scale
    chunk(j, 0, _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(0xFFFF, c + 32 * j)), _mm512_set1_ps(cs[2 * j]));
  for (int m = 0; m < MR; ++m) {
    __m512 t = f[m][0];
    for (int u = 1; u < U; ++u) t = _mm512_add_ps(t, f[m][u]);
    acc[m] = _mm512_reduce_add_ps(_mm512_fmadd_ps(t, _mm512_set1_ps(x.scale[m0 + m]), sb[m]));
  }
}
#elif defined(__AVX2__)
// AVX2: chunks of 32 codes (16 bytes widened to 16 int16 lanes); the short per-row bias term stays scalar
template <int MR, int, typename S>
inline void dot_row_int4(const uint8_t* c, const S* scale, const S* bias, const Int16Rows& x, int64_t m0, int64_t K,
                         int64_t G, float* buf, float* acc) {
  const int64_t per = K / 32 / G;
  float* cs = buf;  // the scale of every 32 codes, widened
  for (int64_t g = 0; g < G; ++g)
    for (int64_t p = 0; p < per; ++p) cs[g * per + p] = widen(scale[g]);
  constexpr int U = MR == 1 ? 2 : 1;
  __m256 f[MR][U];
  for (int m = 0; m < MR; ++m)
    for (int u = 0; u < U; ++u) f[m][u] = _mm256_setzero_ps();
  const int16_t* xq[MR];
  for (int m = 0; m < MR; ++m) xq[m] = x.row(m0 + m);
  const __m256i nib = _mm256_set1_epi16(15);
  auto chunk = [&](int64_t j, int u) __attribute__((always_inline)) {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16 * j)));
    const __m256i lo = _mm256_and_si256(b, nib), hi = _mm256_srli_epi16(b, 4);
    const __m256 sc = _mm256_set1_ps(cs[j]);
    for (int m = 0; m < MR; ++m) {
      const __m256i t = _mm256_add_epi32(
          _mm256_madd_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[m] + 32 * j))),
          _mm256_madd_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[m] + 32 * j + 16))));
      f[m][u] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), sc, f[m][u]);
    }
  };
  const int64_t chunks = K / 32;
  int64_t j = 0;
  for (; j + U <= chunks; j += U)
    for (int u = 0; u < U; ++u) chunk(j + u, u);
  for (; j < chunks; ++j) chunk(j, 0);
  for (int m = 0; m < MR; ++m) {
    __m256 t = f[m][0];
    for (int u = 1; u < U; ++u) t = _mm256_add_ps(t, f[m][u]);
    float b = 0.f;
    for (int64_t g = 0; g < G; ++g) b += widen(bias[g]) * x.xsum[(m0 + m) * G + g];
    acc[m] = pagedserve::hsum(t) * x.scale[m0 + m] + b;
  }
}
#else
template <int MR, int, typename S>
inline void dot_row_int4(const uint8_t* c, const S* scale, const S* bias, const Int16Rows& x, int64_t m0, int64_t K,
                         int64_t G, float*, float* acc) {
  const int64_t per = K / 32 / G;
  for (int m = 0; m < MR; ++m) {
    const int16_t* xq = x.row(m0 + m);
    float s = 0.f, b = 0.f;
    for (int64_t j = 0; j < K / 32; ++j) {
      int32_t t = 0;
      for (int64_t i = 0; i < 16; ++i) t += (c[16 * j + i] & 15) * xq[32 * j + i] + (c[16 * j + i] >> 4) * xq[32 * j + 16 + i];
      s += widen(scale[j / per]) * static_cast<float>(t);
    }
    for (int64_t g = 0; g < G; ++g) b += widen(bias[g]) * x.xsum[(m0 + m) * G + g];
    acc[m] = s * x.scale[m0 + m] + b;
  }
}
#endif

template <typename T, typename S>
void int4_linear_impl(const T* x, int64_t M, int64_t K, const uint8_t* codes, const S* scale, const S* bias,
                      int64_t N, int64_t G, T* out) {
  Int16Rows xq = quantize_rows(x, M, K, CHUNK, G);
  reorder_even_odd(xq, M);
  const int64_t per = K / 32 / G;
  at::parallel_for(0, (N + BN - 1) / BN, 1, [&](int64_t b0, int64_t b1) {
    float buf[2 * MAX_GROUPS + 16];  // the row's scales widened, and spread per 32 codes
    for (int64_t n = b0 * BN; n < std::min(N, b1 * BN); ++n) {
      const uint8_t* c = codes + n * (K / 2);
      const S* sc = scale + n * G;
      const S* bi = bias + n * G;
      for (int64_t m = 0; m < M; m += 4) {
        float acc[4];
        const int64_t mr = std::min<int64_t>(4, M - m);
        switch (mr * 4 + (per <= 2 ? per : 0)) {
#define PAGEDSERVE_INT4_CASE(R, P) \
  case R * 4 + P: dot_row_int4<R, P>(c, sc, bi, xq, m, K, G, buf, acc); break;
          PAGEDSERVE_INT4_CASE(4, 0) PAGEDSERVE_INT4_CASE(4, 1) PAGEDSERVE_INT4_CASE(4, 2)
          PAGEDSERVE_INT4_CASE(3, 0) PAGEDSERVE_INT4_CASE(3, 1) PAGEDSERVE_INT4_CASE(3, 2)
          PAGEDSERVE_INT4_CASE(2, 0) PAGEDSERVE_INT4_CASE(2, 1) PAGEDSERVE_INT4_CASE(2, 2)
          PAGEDSERVE_INT4_CASE(1, 0) PAGEDSERVE_INT4_CASE(1, 1) PAGEDSERVE_INT4_CASE(1, 2)
#undef PAGEDSERVE_INT4_CASE
        }
        for (int64_t i = 0; i < mr; ++i) out[(m + i) * N + n] = narrow<T>(acc[i]);
      }
    }
  });
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& bias) {
  const int64_t K = x.size(1), N = codes.size(0), G = scale.size(1);
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 2 && codes.size(1) * 2 == K && codes.scalar_type() == at::kByte,
              "int4_linear: x [M, K], codes uint8 [N, K / 2]");
  const bool half = scale.scalar_type() == at::kHalf;
  TORCH_CHECK((half || scale.scalar_type() == at::kFloat) && bias.scalar_type() == scale.scalar_type() &&
                  scale.size(0) == N &&
                  bias.sizes() == scale.sizes() && K % G == 0 && (K / G) % 32 == 0 && K / 32 <= MAX_GROUPS,
              "int4_linear: fp16 or fp32 scale and bias [N, G] with groups a multiple of 32");
  const auto xc = x.contiguous();
  const auto cc = codes.contiguous();
  const auto sc = scale.contiguous();
  const auto bc = bias.contiguous();
  auto out = at::empty({x.size(0), N}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "int4_linear", [&] {
    if (half) {
      int4_linear_impl<scalar_t, at::Half>(xc.data_ptr<scalar_t>(), x.size(0), K, cc.data_ptr<uint8_t>(),
                                           sc.data_ptr<at::Half>(), bc.data_ptr<at::Half>(), N, G,
                                           out.data_ptr<scalar_t>());
    } else {
      int4_linear_impl<scalar_t, float>(xc.data_ptr<scalar_t>(), x.size(0), K, cc.data_ptr<uint8_t>(),
                                        sc.data_ptr<float>(), bc.data_ptr<float>(), N, G, out.data_ptr<scalar_t>());
    }
  });
  return out;
}

// ---- many rows: dequantize a tile of output features into a cache-sized buffer, GEMM, next tile -----------
// Converting the whole matrix first writes and re-reads twice its int8 bytes (four times in fp32); a tile
// of ~256 KiB stays in cache between the conversion and the GEMM, so DRAM sees only the int8/int4 bytes.

template <typename T, typename S>
void dequant_rows_int4(const uint8_t* codes, const S* scale, const S* bias, int64_t K, int64_t G, int64_t n0,
                       int64_t n1, T* buf) {
  const int64_t group = K / G;
  at::parallel_for(n0, n1, 16, [&](int64_t a, int64_t b) {
    for (int64_t n = a; n < b; ++n) {
      T* o = buf + (n - n0) * K;
      const uint8_t* c = codes + n * (K / 2);
      for (int64_t g = 0; g < G; ++g) {
        const float sc = widen(scale[n * G + g]), bi = widen(bias[n * G + g]);
#pragma omp simd
        for (int64_t i = 0; i < group / 2; ++i) {
          const uint8_t byte = c[g * group / 2 + i];
          o[g * group + 2 * i] = narrow<T>(static_cast<float>(byte & 15) * sc + bi);
          o[g * group + 2 * i + 1] = narrow<T>(static_cast<float>(byte >> 4) * sc + bi);
        }
      }
    }
  });
}

// out[m, n] = out_t[n, m] * scale[n] (scale may be null): the transpose back and the row scales in one pass,
// in 16 x 16 blocks so both sides stay in cache
template <typename T>
at::Tensor transpose_scaled(const at::Tensor& out_t, const float* scale) {
  const int64_t N = out_t.size(0), M = out_t.size(1);
  auto out = at::empty({M, N}, out_t.options());
  const T* src = out_t.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  at::parallel_for(0, (N + 15) / 16, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t m0 = 0; m0 < M; m0 += 16)
      for (int64_t n = b0 * 16; n < std::min(N, b1 * 16); ++n) {
        const float sc = scale ? scale[n] : 1.f;
        for (int64_t m = m0; m < std::min(M, m0 + 16); ++m) dst[m * N + n] = narrow<T>(widen(src[n * M + m]) * sc);
      }
  });
  return out;
}

// out = x @ W^T, one tile of W's rows at a time (filled by fill(n0, n1, tile)), computed transposed:
// out^T[n0:n1] = tile @ x^T. The tile is then oneDNN's left operand, which it reads as it is, where as the right
// operand of linear(x, tile) every fresh tile was reordered first (1.7-9x slower at M = 64); and out^T's rows
// n0:n1 are contiguous, so each product lands in place. row_scale (or null): multiplies out's columns.
template <typename Fill>
at::Tensor tiled_gemm(const at::Tensor& x, int64_t N, Fill fill, const float* row_scale) {
  const int64_t K = x.size(1);
  const int64_t TN = std::max<int64_t>(64, ((TILE_KIB << 10) / (K * x.element_size())) / 16 * 16);
  auto out_t = at::empty({N, x.size(0)}, x.options());
  auto tile = at::empty({std::min(TN, N), K}, x.options());
  const auto xt = x.t();
  for (int64_t n0 = 0; n0 < N; n0 += TN) {
    const int64_t n1 = std::min(N, n0 + TN);
    auto t = tile.narrow(0, 0, n1 - n0);
    fill(n0, n1, t);
    auto dst = out_t.narrow(0, n0, n1 - n0);
    at::mm_out(dst, t, xt);
  }
  at::Tensor out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "tiled_gemm", [&] {
    out = transpose_scaled<scalar_t>(out_t, row_scale);  // fp32 product, rounded once
  });
  return out;
}

// int8 codes -> the activation dtype, exactly (|code| <= 128 needs 8 significant bits), in parallel. For bf16 the
// top half of the fp32 is already exact: no rounding step. torch's copy_ took ~2x as long.
template <typename T>
void widen_int8_rows(const int8_t* src, int64_t n, T* dst) {
  at::parallel_for(0, n, 1 << 16, [&](int64_t a, int64_t b) {
    int64_t i = a;
#ifdef PAGEDSERVE_AVX512
    if constexpr (std::is_same_v<T, at::BFloat16> || std::is_same_v<T, float>) {
      for (; i + 16 <= b; i += 16) {
        const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
        const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes));
        if constexpr (std::is_same_v<T, float>) {
          _mm512_storeu_ps(dst + i, f);
        } else {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                              _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(f), 16)));
        }
      }
    }
#endif
    for (; i < b; ++i) dst[i] = static_cast<T>(static_cast<float>(src[i]));
  });
}

at::Tensor int8_gemm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) && w.scalar_type() == at::kChar &&
                  scale.scalar_type() == at::kFloat && scale.numel() == w.size(0),
              "int8_gemm: x [M, K], int8 w [N, K], one fp32 scale per row");
  const auto xc = x.contiguous();
  const auto wc = w.contiguous();
  const auto sc = scale.contiguous();
  // The tile holds the codes themselves (exact in any float dtype) and the row scales multiply the output
  // columns afterwards: cheaper than scaling every weight.
  return tiled_gemm(
      xc, w.size(0),
      [&](int64_t n0, int64_t n1, at::Tensor& t) {
        AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "int8_gemm", [&] {
          widen_int8_rows<scalar_t>(wc.data_ptr<int8_t>() + n0 * wc.size(1), (n1 - n0) * wc.size(1),
                                    t.data_ptr<scalar_t>());
        });
      },
      sc.data_ptr<float>());
}

at::Tensor int4_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& bias) {
  const int64_t K = x.size(1), G = scale.size(1);
  TORCH_CHECK(x.dim() == 2 && codes.size(1) * 2 == K && codes.scalar_type() == at::kByte && K % G == 0 &&
                  (K / G) % 2 == 0 && bias.sizes() == scale.sizes() && bias.scalar_type() == scale.scalar_type(),
              "int4_gemm: x [M, K], codes uint8 [N, K / 2], scale and bias [N, G]");
  const auto xc = x.contiguous();
  const auto cc = codes.contiguous();
  const auto sc = scale.contiguous();
  const auto bc = bias.contiguous();
  const bool half = scale.scalar_type() == at::kHalf;
  return tiled_gemm(xc, codes.size(0), [&](int64_t n0, int64_t n1, at::Tensor& t) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "int4_gemm", [&] {
      if (half) {
        dequant_rows_int4<scalar_t, at::Half>(cc.data_ptr<uint8_t>(), sc.data_ptr<at::Half>(), bc.data_ptr<at::Half>(),
                                              K, G, n0, n1, t.data_ptr<scalar_t>());
      } else {
        dequant_rows_int4<scalar_t, float>(cc.data_ptr<uint8_t>(), sc.data_ptr<float>(), bc.data_ptr<float>(), K, G,
                                           n0, n1, t.data_ptr<scalar_t>());
      }
    });
  }, nullptr);
}

}  // namespace

namespace pagedserve {
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
  return ::int8_linear(x, w, scale);
}
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& bias) {
  return ::int4_linear(x, codes, scale, bias);
}
}  // namespace pagedserve

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("int8_linear(Tensor x, Tensor w, Tensor scale) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor codes, Tensor scale, Tensor bias) -> Tensor");
  m.def("int8_gemm(Tensor x, Tensor w, Tensor scale) -> Tensor");
  m.def("int4_gemm(Tensor x, Tensor codes, Tensor scale, Tensor bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("int8_linear", &int8_linear);
  m.impl("int4_linear", &int4_linear);
  m.impl("int8_gemm", &int8_gemm);
  m.impl("int4_gemm", &int4_gemm);
}
