// y = x W^T for a few rows of x against weight-only int8 (a scale per output row) or int4 (group-wise) weights.
//
// At decode a step reads every weight once, so the cost is the weight bytes: these kernels stream the weights
// once, multiplying their integer codes by integer codes of the activations (int16 for int8 weights, int8 per 32
// values for int4: below), where torch's `_weight_int8pack_mm` reached about half the memory bandwidth of a bf16
// GEMV on the machines we measured (and is 5-10x slower still with fp32 activations). Work is split over output
// features; within a block of rows (a few KiB, L1-resident) every group of up to 4 activation rows reuses the
// weights from L1 (beyond 8 rows the caller dequantizes tiles and runs a GEMM).
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
  int64_t Kp = 0;
  const int16_t* row(int64_t m) const { return q.data() + m * Kp; }
};

// x [M, K] -> int16 codes; pad: Kp a multiple of it
template <typename T>
Int16Rows quantize_rows(const T* x, int64_t M, int64_t K, int64_t pad) {
  Int16Rows r;
  r.Kp = (K + pad - 1) / pad * pad;
  r.q.assign(M * r.Kp, 0);
  r.scale.resize(M);
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
  const Int16Rows xq = quantize_rows(x, M, K, 32);
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
// w[n, k] = c * scale[n, g] + bias[n, g] (fp16 or fp32) for the 4-bit code c of k in group g = k / group, so
//   y = sum_g scale_g * sum_{k in g} c_k x_k  +  sum_g bias_g * sum_{k in g} x_k.
// Layout (engine/quant/formats.py to_panels): rows in panels of 16. A panel holds, per 8 codes of K, 64 bytes: row r's
// 4 bytes at 4r, byte i with code 8q + i in its low nibble and 8q + 4 + i in its high one; scale and bias are
// [N / 16, G, 16]. So one 64-byte load feeds 16 rows at once, each int32 lane one row: no horizontal sums, no
// per-row setup, and a group's 16 scales are one load. Row by row (the earlier layout) the GEMV was compute-bound
// at ~10 GB/s per core on Zen 4; in panels it is ~1.5-2x faster, at the memory's speed.
// The activations are int8 codes with a scale per 32 values (llama.cpp's Q8_0: relative error <= 1/254 of the
// block's absmax, ~0.5 % of a product, well under the 4-bit weights' own ~10 %), so one u8 x s8 vpdpbusd does 64
// multiply-adds of raw nibbles; the bias term uses the same rounded activations, so the codes' offset of 8
// (bias = zero - 8 * scale) cancels exactly. int32 lanes are exact: a 32-value block adds at most 32 * 15 * 127.
constexpr int64_t PANEL = 16;  // rows per panel
constexpr int64_t XB = 32;  // activation values per scale

struct Int8Blocks {
  std::vector<int8_t> q;  // [M, K] (+ 4 bytes of slack for the last 4-byte broadcast)
  std::vector<float> scale;  // [M, K / XB]
  std::vector<float> xsum;  // [M, G]: per weight group the sum of the dequantized activation codes
};

template <typename T>
Int8Blocks quantize_blocks(const T* x, int64_t M, int64_t K, int64_t G) {
  Int8Blocks r;
  r.q.assign(M * K + 4, 0);
  r.scale.assign(M * K / XB, 0.f);
  r.xsum.assign(M * G, 0.f);
  const int64_t blocks_per_group = K / G / XB;
  float xf[XB];
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < K / XB; ++b) {  // K is a multiple of the group, itself a multiple of 32
      const T* src = x + m * K + b * XB;
      int8_t* q = r.q.data() + m * K + b * XB;
      float amax = 0.f;
      for (int64_t i = 0; i < XB; ++i) {
        xf[i] = widen(src[i]);
        amax = std::max(amax, std::abs(xf[i]));
      }
      const float inv = amax > 0.f ? 127.f / amax : 0.f, scale = amax / 127.f;
      int32_t sum = 0;
      int64_t i = 0;
#ifdef PAGEDSERVE_AVX512
      const __m512 vinv = _mm512_set1_ps(inv);
      for (; i < XB; i += 16) {  // round to nearest even, as the scalar form
        const __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xf + i), vinv));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtsepi32_epi8(c));
        sum += _mm512_reduce_add_epi32(c);
      }
#endif
      for (; i < XB; ++i) {
        q[i] = static_cast<int8_t>(std::nearbyint(xf[i] * inv));  // |code| <= 127
        sum += q[i];
      }
      r.scale[m * K / XB + b] = scale;
      r.xsum[m * G + b / blocks_per_group] += static_cast<float>(sum) * scale;
    }
  }
  return r;
}

inline int32_t load4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// out[m, 16 rows] for one panel and MR activation rows (from m0), as fp32 into y[m][16]
#ifdef PAGEDSERVE_AVX512
#ifdef __AVX512VNNI__
#define PAGEDSERVE_DPBUSD(acc, u8, s8) _mm512_dpbusd_epi32(acc, u8, s8)
#else  // nibbles x int8 pairs sum to at most 2 * 15 * 127: vpmaddubsw cannot saturate
#define PAGEDSERVE_DPBUSD(acc, u8, s8) \
  _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u8, s8), _mm512_set1_epi16(1)))
#endif

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

template <int MR, typename S>
inline void panel_int4(const uint8_t* c, const S* scale, const S* bias, const Int8Blocks& x, int64_t m0, int64_t K,
                       int64_t G, float (*y)[PANEL]) {
  const int64_t bpg = K / G / XB;  // activation blocks per group
  const __m512i nib = _mm512_set1_epi8(15);
  const int8_t* xq[MR];
  const float* xs[MR];
  __m512 f[MR];
  for (int m = 0; m < MR; ++m) {
    xq[m] = x.q.data() + (m0 + m) * K;
    xs[m] = x.scale.data() + (m0 + m) * K / XB;
    f[m] = _mm512_setzero_ps();
  }
  int64_t blk = 0;
  for (int64_t g = 0; g < G; ++g) {
    __m512 fg[MR];
    for (int m = 0; m < MR; ++m) fg[m] = _mm512_setzero_ps();
    for (int64_t e = blk + bpg; blk < e; ++blk) {
      __m512i t[MR][2];  // two chains per row: the 8 multiply-adds of a block are not one dependent sequence
      for (int m = 0; m < MR; ++m) t[m][0] = t[m][1] = _mm512_setzero_si512();
      for (int q = 0; q < 4; ++q) {
        const __m512i b = _mm512_loadu_si512(c + (blk * 4 + q) * 64);
        const __m512i lo = _mm512_and_si512(b, nib), hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), nib);
        for (int m = 0; m < MR; ++m) {
          const int8_t* a = xq[m] + blk * XB + 8 * q;
          t[m][q & 1] = PAGEDSERVE_DPBUSD(t[m][q & 1], lo, _mm512_set1_epi32(load4(a)));
          t[m][q & 1] = PAGEDSERVE_DPBUSD(t[m][q & 1], hi, _mm512_set1_epi32(load4(a + 4)));
        }
      }
      for (int m = 0; m < MR; ++m)
        fg[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(t[m][0], t[m][1])), _mm512_set1_ps(xs[m][blk]),
                                fg[m]);
    }
    const __m512 sw = load16(scale + g * PANEL), bw = load16(bias + g * PANEL);
    for (int m = 0; m < MR; ++m)
      f[m] = _mm512_fmadd_ps(fg[m], sw, _mm512_fmadd_ps(bw, _mm512_set1_ps(x.xsum[(m0 + m) * G + g]), f[m]));
  }
  for (int m = 0; m < MR; ++m) _mm512_storeu_ps(y[m], f[m]);
}
#elif defined(__AVX2__)
// AVX2: the panel's two halves (rows 0-7 in bytes 0-31 of each 64, rows 8-15 in 32-63) in 256-bit vectors
template <int MR, typename S>
inline void panel_int4(const uint8_t* c, const S* scale, const S* bias, const Int8Blocks& x, int64_t m0, int64_t K,
                       int64_t G, float (*y)[PANEL]) {
  const int64_t bpg = K / G / XB;
  const __m256i nib = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  for (int h = 0; h < 2; ++h) {
    __m256 f[MR];
    for (int m = 0; m < MR; ++m) f[m] = _mm256_setzero_ps();
    int64_t blk = 0;
    for (int64_t g = 0; g < G; ++g) {
      __m256 fg[MR];
      for (int m = 0; m < MR; ++m) fg[m] = _mm256_setzero_ps();
      for (int64_t e = blk + bpg; blk < e; ++blk) {
        __m256i t[MR];
        for (int m = 0; m < MR; ++m) t[m] = _mm256_setzero_si256();
        for (int q = 0; q < 4; ++q) {
          const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + (blk * 4 + q) * 64 + 32 * h));
          const __m256i lo = _mm256_and_si256(b, nib), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), nib);
          for (int m = 0; m < MR; ++m) {
            const int8_t* a = x.q.data() + (m0 + m) * K + blk * XB + 8 * q;
            const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(load4(a))),
                                               _mm256_maddubs_epi16(hi, _mm256_set1_epi32(load4(a + 4))));
            t[m] = _mm256_add_epi32(t[m], _mm256_madd_epi16(p, ones));  // 4 * 15 * 127 per int16: no saturation
          }
        }
        for (int m = 0; m < MR; ++m)
          fg[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t[m]), _mm256_set1_ps(x.scale[(m0 + m) * K / XB + blk]), fg[m]);
      }
      float sw[8], bw[8];
      for (int r = 0; r < 8; ++r) {
        sw[r] = widen(scale[g * PANEL + 8 * h + r]);
        bw[r] = widen(bias[g * PANEL + 8 * h + r]);
      }
      for (int m = 0; m < MR; ++m)
        f[m] = _mm256_fmadd_ps(fg[m], _mm256_loadu_ps(sw),
                               _mm256_fmadd_ps(_mm256_loadu_ps(bw), _mm256_set1_ps(x.xsum[(m0 + m) * G + g]), f[m]));
    }
    for (int m = 0; m < MR; ++m) _mm256_storeu_ps(y[m] + 8 * h, f[m]);
  }
}
#else
template <int MR, typename S>
inline void panel_int4(const uint8_t* c, const S* scale, const S* bias, const Int8Blocks& x, int64_t m0, int64_t K,
                       int64_t G, float (*y)[PANEL]) {
  const int64_t bpg = K / G / XB;
  for (int m = 0; m < MR; ++m) {
    const int8_t* xq = x.q.data() + (m0 + m) * K;
    for (int64_t r = 0; r < PANEL; ++r) {
      float s = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        float sg = 0.f;
        for (int64_t blk = g * bpg; blk < (g + 1) * bpg; ++blk) {
          int32_t t = 0;
          for (int64_t q = blk * 4; q < blk * 4 + 4; ++q)
            for (int64_t i = 0; i < 4; ++i) {
              const uint8_t byte = c[q * 64 + 4 * r + i];
              t += (byte & 15) * xq[8 * q + i] + (byte >> 4) * xq[8 * q + 4 + i];
            }
          sg += static_cast<float>(t) * x.scale[(m0 + m) * K / XB + blk];
        }
        s += sg * widen(scale[g * PANEL + r]) + widen(bias[g * PANEL + r]) * x.xsum[(m0 + m) * G + g];
      }
      y[m][r] = s;
    }
  }
}
#endif

template <typename T, typename S>
void int4_linear_impl(const T* x, int64_t M, int64_t K, const uint8_t* codes, const S* scale, const S* bias,
                      int64_t N, int64_t G, T* out) {
  const Int8Blocks xq = quantize_blocks(x, M, K, G);
  at::parallel_for(0, N / PANEL, 1, [&](int64_t p0, int64_t p1) {
    float y[4][PANEL];
    for (int64_t p = p0; p < p1; ++p) {
      const uint8_t* c = codes + p * PANEL * (K / 2);
      const S* sc = scale + p * G * PANEL;
      const S* bi = bias + p * G * PANEL;
      for (int64_t m = 0; m < M; m += 4) {  // the panel's codes reused from L1 by up to 4 activation rows
        const int64_t mr = std::min<int64_t>(4, M - m);
        switch (mr) {
          case 4: panel_int4<4>(c, sc, bi, xq, m, K, G, y); break;
          case 3: panel_int4<3>(c, sc, bi, xq, m, K, G, y); break;
          case 2: panel_int4<2>(c, sc, bi, xq, m, K, G, y); break;
          default: panel_int4<1>(c, sc, bi, xq, m, K, G, y); break;
        }
        for (int64_t i = 0; i < mr; ++i)
          for (int64_t r = 0; r < PANEL; ++r) out[(m + i) * N + p * PANEL + r] = narrow<T>(y[i][r]);
      }
    }
  });
}

// codes uint8 [N / 16, 8 K], scale and bias [N / 16, G, 16] (fp16 or fp32): the panels above
void check_int4(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& bias,
                const char* op) {
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.size(1) == 8 * x.size(1),
              op, ": x [M, K], codes uint8 [N / 16, 8 K] (16-row panels)");
  const int64_t K = x.size(1);
  TORCH_CHECK((scale.scalar_type() == at::kHalf || scale.scalar_type() == at::kFloat) &&
                  bias.scalar_type() == scale.scalar_type() && scale.dim() == 3 && bias.sizes() == scale.sizes() &&
                  scale.size(0) == codes.size(0) && scale.size(2) == PANEL && K % scale.size(1) == 0 &&
                  (K / scale.size(1)) % XB == 0,
              op, ": fp16 or fp32 scale and bias [N / 16, G, 16] with groups a multiple of 32");
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& bias) {
  check_int4(x, codes, scale, bias, "int4_linear");
  const int64_t K = x.size(1), N = codes.size(0) * PANEL, G = scale.size(1);
  const auto xc = x.contiguous();
  const auto cc = codes.contiguous();
  const auto sc = scale.contiguous();
  const auto bc = bias.contiguous();
  auto out = at::empty({x.size(0), N}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "int4_linear", [&] {
    if (scale.scalar_type() == at::kHalf) {
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

#ifdef PAGEDSERVE_AVX512
// 16 fp32 values -> T, rounding to nearest even (finite values: dequantized weights)
template <typename T>
inline void store16(T* dst, __m512 f) {
  if constexpr (std::is_same_v<T, float>) {
    _mm512_storeu_ps(dst, f);
  } else if constexpr (std::is_same_v<T, at::Half>) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT));
  } else {
    static_assert(std::is_same_v<T, at::BFloat16>);
    const __m512i b = _mm512_castps_si512(f);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(r));
  }
}

// one row r of a panel back to K values: 16 of its 4-byte pieces (128 codes) per gather, their nibbles put in
// k order, widened 16 at a time and scaled by their group's scale and bias
template <typename T>
inline void dequant_panel_row(const uint8_t* c, int64_t r, const float* sc, const float* bi, int64_t K, int64_t group,
                              T* o) {
  const int64_t steps = K / 8;
  const __m512i offs = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32(64));
  const __m512i nib = _mm512_set1_epi8(15);
  // unpacklo/hi_epi32(lo, hi) leave q-steps (0 1 4 5 8 9 12 13) and (2 3 6 7 10 11 14 15) in their 64-bit lanes
  const __m512i first = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0);
  const __m512i second = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
  int64_t g = 0, left = group;  // the current group and the codes left in it
  for (int64_t q0 = 0; q0 < steps; q0 += 16) {
    const __mmask16 mask = q0 + 16 <= steps ? 0xFFFF : static_cast<__mmask16>((1u << (steps - q0)) - 1);
    const __m512i d = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mask, offs, c + q0 * 64 + 4 * r, 1);
    const __m512i lo = _mm512_and_si512(d, nib), hi = _mm512_and_si512(_mm512_srli_epi32(d, 4), nib);
    const __m512i a = _mm512_unpacklo_epi32(lo, hi), b = _mm512_unpackhi_epi32(lo, hi);
    alignas(64) uint8_t bytes[128];
    _mm512_store_si512(bytes, _mm512_permutex2var_epi64(a, first, b));
    _mm512_store_si512(bytes + 64, _mm512_permutex2var_epi64(a, second, b));
    for (int64_t j = 0; j < 8 && 8 * q0 + 16 * j < K; ++j) {  // 16 codes: within one group (a multiple of 32)
      const __m128i v = _mm_load_si128(reinterpret_cast<const __m128i*>(bytes + 16 * j));
      const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v));
      store16(o + 8 * q0 + 16 * j, _mm512_fmadd_ps(f, _mm512_set1_ps(sc[g]), _mm512_set1_ps(bi[g])));
      if ((left -= 16) == 0) ++g, left = group;
    }
  }
}
#endif

// rows n0..n1 (multiples of 16) of the panels, dequantized into buf [n1 - n0, K]
template <typename T, typename S>
void dequant_rows_int4(const uint8_t* codes, const S* scale, const S* bias, int64_t K, int64_t G, int64_t n0,
                       int64_t n1, T* buf) {
  const int64_t group = K / G;
  at::parallel_for(n0 / PANEL, n1 / PANEL, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> sc(G), bi(G);
    for (int64_t p = p0; p < p1; ++p) {
      const uint8_t* c = codes + p * PANEL * (K / 2);
      for (int64_t r = 0; r < PANEL; ++r) {
        T* o = buf + (p * PANEL + r - n0) * K;
        for (int64_t g = 0; g < G; ++g)
          sc[g] = widen(scale[(p * G + g) * PANEL + r]), bi[g] = widen(bias[(p * G + g) * PANEL + r]);
#ifdef PAGEDSERVE_AVX512
        if constexpr (!std::is_same_v<T, double>) {
          dequant_panel_row(c, r, sc.data(), bi.data(), K, group, o);
          continue;
        }
#endif
        for (int64_t q = 0; q < K / 8; ++q)
          for (int64_t i = 0; i < 4; ++i) {
            const uint8_t byte = c[q * 64 + 4 * r + i];
            const int64_t g = 8 * q / group;
            o[8 * q + i] = narrow<T>(static_cast<float>(byte & 15) * sc[g] + bi[g]);
            o[8 * q + 4 + i] = narrow<T>(static_cast<float>(byte >> 4) * sc[g] + bi[g]);
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
  check_int4(x, codes, scale, bias, "int4_gemm");
  const int64_t K = x.size(1), G = scale.size(1);
  const auto xc = x.contiguous();
  const auto cc = codes.contiguous();
  const auto sc = scale.contiguous();
  const auto bc = bias.contiguous();
  const bool half = scale.scalar_type() == at::kHalf;
  return tiled_gemm(xc, codes.size(0) * PANEL, [&](int64_t n0, int64_t n1, at::Tensor& t) {
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
