// y = x W^T for a few rows of x against weight-only int8 (a scale per output row) or int4 (group-wise) weights.
//
// At decode a step reads every weight once, so the cost is the weight bytes: this kernel streams the
// int8 rows once per block of output features and widens them to fp32 in registers, where torch's
// `_weight_int8pack_mm` reached about half the memory bandwidth of a bf16 GEMV on the machines we
// measured (and is 5-10x slower still with fp32 activations). Work is split over output features;
// within a block of BN rows (a few KiB, L1-resident) every group of up to 4 activation rows reuses the
// weights from L1 (M = 4 costs about 2x M = 1; beyond a few rows the caller dequantizes and runs a GEMM).
// Accumulation is fp32 whatever x's dtype; the row scale is applied once per output.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

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

#ifdef PAGEDSERVE_AVX512
// U independent accumulators per activation row (chunk j adds into column j % U): with one, the FMA latency
// chain bound M = 1 to a third of the memory bandwidth. sb takes the row's bias terms.
template <int MR>
struct RowAccumulators {
  static constexpr int U = MR == 1 ? 4 : MR == 2 ? 2 : 1;
  __m512 s[MR][U], sb[MR];
  RowAccumulators() {
    for (int m = 0; m < MR; ++m) {
      for (int u = 0; u < U; ++u) s[m][u] = _mm512_setzero_ps();
      sb[m] = _mm512_setzero_ps();
    }
  }
  template <typename Chunk>
  inline void run(int64_t chunks, Chunk&& chunk) {  // chunk(j, u)
    int64_t j = 0;
    for (; j + U <= chunks; j += U)
      for (int u = 0; u < U; ++u) chunk(j + u, u);
    for (; j < chunks; ++j) chunk(j, 0);
  }
  inline void finish(float* acc) const {  // acc[m] = the sum of row m's lanes
    for (int m = 0; m < MR; ++m) {
      __m512 t = sb[m];
      for (int u = 0; u < U; ++u) t = _mm512_add_ps(t, s[m][u]);
      acc[m] = _mm512_reduce_add_ps(t);
    }
  }
};
#endif

// dot products of one int8 weight row with MR fp32 activation rows (each K long). One weight row at a
// time: tiles of several rows (reusing each activation load) measured ~2x slower at M = 1 on Zen 4, whose
// prefetcher streams one row well.
template <int MR>
inline void dot_row(const int8_t* w, const float* x, int64_t K, float* acc) {
  int64_t k = 0;
#ifdef PAGEDSERVE_AVX512
  RowAccumulators<MR> r;
  r.run(K / 16, [&](int64_t j, int u) __attribute__((always_inline)) {
    const __m512 wf =
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16 * j))));
    for (int m = 0; m < MR; ++m) r.s[m][u] = _mm512_fmadd_ps(wf, _mm512_loadu_ps(x + m * K + 16 * j), r.s[m][u]);
  });
  r.finish(acc);
  k = K / 16 * 16;
#elif defined(__AVX2__) && defined(__FMA__)
  // 8 codes a vector, U accumulators as above (scalar code here ran at ~2 GB/s, 4x slower than fp32 F.linear)
  constexpr int U = MR == 1 ? 4 : MR == 2 ? 2 : 1;
  __m256 s[MR][U];
  for (int m = 0; m < MR; ++m)
    for (int u = 0; u < U; ++u) s[m][u] = _mm256_setzero_ps();
  auto widen8 = [](const int8_t* p) __attribute__((always_inline)) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  };
  for (; k + 8 * U <= K; k += 8 * U)
    for (int u = 0; u < U; ++u) {
      const __m256 wf = widen8(w + k + 8 * u);
      for (int m = 0; m < MR; ++m) s[m][u] = _mm256_fmadd_ps(wf, _mm256_loadu_ps(x + m * K + k + 8 * u), s[m][u]);
    }
  for (; k + 8 <= K; k += 8) {
    const __m256 wf = widen8(w + k);
    for (int m = 0; m < MR; ++m) s[m][0] = _mm256_fmadd_ps(wf, _mm256_loadu_ps(x + m * K + k), s[m][0]);
  }
  for (int m = 0; m < MR; ++m) {
    __m256 t = s[m][0];
    for (int u = 1; u < U; ++u) t = _mm256_add_ps(t, s[m][u]);
    acc[m] = pagedserve::hsum(t);
  }
#else
  for (int m = 0; m < MR; ++m) acc[m] = 0.f;
#endif
  for (; k < K; ++k) {  // the tail, or everything without AVX-512 / AVX2 (the compiler vectorises what it can)
    const float wk = static_cast<float>(w[k]);
    for (int m = 0; m < MR; ++m) acc[m] += wk * x[m * K + k];
  }
}

template <int MR, typename T>
void rows_block(const int8_t* w, const float* scale, const float* x, int64_t K, int64_t n0, int64_t n1, T* out,
                int64_t N) {
  float acc[MR];
  for (int64_t n = n0; n < n1; ++n) {
    dot_row<MR>(w + n * K, x, K, acc);
    for (int m = 0; m < MR; ++m) out[m * N + n] = static_cast<T>(acc[m] * scale[n]);
  }
}

template <typename T>
void int8_linear_impl(const T* x, int64_t M, int64_t K, const int8_t* w, const float* scale, int64_t N, T* out) {
  std::vector<float> xf(M * K);  // activations widened once: a few KiB
  for (int64_t i = 0; i < M * K; ++i) xf[i] = widen(x[i]);
  at::parallel_for(0, (N + BN - 1) / BN, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * BN, n1 = std::min(N, n0 + BN);
      for (int64_t m = 0; m < M; m += 4) {
        const float* xm = xf.data() + m * K;
        T* om = out + m * N;
        switch (std::min<int64_t>(4, M - m)) {
          case 4: rows_block<4>(w, scale, xm, K, n0, n1, om, N); break;
          case 3: rows_block<3>(w, scale, xm, K, n0, n1, om, N); break;
          case 2: rows_block<2>(w, scale, xm, K, n0, n1, om, N); break;
          default: rows_block<1>(w, scale, xm, K, n0, n1, om, N); break;
        }
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
//   y = sum_g scale_g * sum_{k in g} c_k x_k  +  sum_g bias_g * sum_{k in g} x_k,
// so the inner loop multiplies raw codes and the bias term is one dot product with the per-group sums of x.
// The activations are reordered once per call to match the nibble order of a vector load of codes.
//
// Two inner loops. fp32 (any activation dtype): 16 bytes of codes -> two fp32 vectors by mask and shift, x
// split into even/odd halves per 32. bf16 activations on a CPU with AVX512-BF16: 32 bytes of codes -> two
// vectors of 32 bf16 values by OR-ing each nibble into the bf16 pattern of 128 + c (exact: 128..143 need 4
// mantissa bits), then vdpbf16ps does 32 multiply-adds per instruction; the 128 is taken back through the
// bias term, sum_g (bias_g - 128 scale_g) * sum x. Either way several accumulators per activation row keep
// the FMA latency chain off the critical path: with one, M = 1 ran at a third of the memory bandwidth.
#ifdef PAGEDSERVE_AVX512
inline __m512 load16(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
inline __m512 load16(const at::Half* p, __mmask16 mask) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p));
}

// The per-row part, vectorised: the row's scales widened into sc (and spread per 32 codes into cs where a
// group is longer), and s[m] = lane-wise terms of sum_g (bias_g - offset * scale_g) * xsum[m, g].
template <int MR, typename S>
inline const float* row_prologue(const S* scale, const S* bias, float offset, const float* xsum, int64_t G,
                                 int64_t per, float* sc, float* cs, __m512* s) {
  const __m512 off = _mm512_set1_ps(offset);
  for (int64_t g = 0; g < G; g += 16) {
    const __mmask16 mask = g + 16 <= G ? 0xFFFF : static_cast<__mmask16>((1u << (G - g)) - 1);
    const __m512 scv = load16(scale + g, mask);
    _mm512_mask_storeu_ps(sc + g, mask, scv);
    const __m512 b = _mm512_fnmadd_ps(off, scv, load16(bias + g, mask));
    for (int m = 0; m < MR; ++m) s[m] = _mm512_fmadd_ps(b, _mm512_maskz_loadu_ps(mask, xsum + m * G + g), s[m]);
  }
  if (per == 1) return sc;
  for (int64_t j = 0; j < G * per; ++j) cs[j] = sc[j / per];
  return cs;
}

// fp32: chunks of 32 codes (16 bytes); acc[m] = the row's dot product with activation row m
template <int MR, typename S>
inline void dot_row_int4(const uint8_t* c, const S* scale, const S* bias, const float* xe, const float* xsum,
                         int64_t K, int64_t G, float* buf, float* acc) {
  RowAccumulators<MR> r;
  const float* cs = row_prologue<MR>(scale, bias, 0.f, xsum, G, K / 32 / G, buf, buf + MAX_GROUPS, r.sb);
  const __m512i low = _mm512_set1_epi32(15);
  const int64_t chunks = K / 32;
  auto chunk = [&](int64_t j, int u) __attribute__((always_inline)) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16 * j)));
    const __m512 even = _mm512_cvtepi32_ps(_mm512_and_si512(b, low));
    const __m512 odd = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
    const __m512 sc = _mm512_set1_ps(cs[j]);
    for (int m = 0; m < MR; ++m) {
      const float* x = xe + m * K + 32 * j;
      const __m512 t = _mm512_fmadd_ps(odd, _mm512_loadu_ps(x + 16), _mm512_mul_ps(even, _mm512_loadu_ps(x)));
      r.s[m][u] = _mm512_fmadd_ps(t, sc, r.s[m][u]);
    }
  };
  r.run(chunks, chunk);
  r.finish(acc);
}
#elif defined(__AVX2__) && defined(__FMA__)
// AVX2: the same chunks of 32 codes, as four 8-lane vectors (low nibbles of bytes 0-7 and 8-15, then the high ones:
// xe's order per 32 is the 16 even k, then the 16 odd k); the short per-row bias term stays scalar
template <int MR, typename S>
inline void dot_row_int4(const uint8_t* c, const S* scale, const S* bias, const float* xe, const float* xsum,
                         int64_t K, int64_t G, float*, float* acc) {
  const int64_t per = K / 32 / G;
  constexpr int U = MR == 1 ? 2 : 1;
  __m256 s[MR][U];
  for (int m = 0; m < MR; ++m)
    for (int u = 0; u < U; ++u) s[m][u] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi32(15);
  auto chunk = [&](int64_t j, int u) __attribute__((always_inline)) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16 * j));
    const __m256i b0 = _mm256_cvtepu8_epi32(b), b1 = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8));
    const __m256 e0 = _mm256_cvtepi32_ps(_mm256_and_si256(b0, low));
    const __m256 e1 = _mm256_cvtepi32_ps(_mm256_and_si256(b1, low));
    const __m256 o0 = _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4));
    const __m256 o1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4));
    const __m256 sc = _mm256_set1_ps(widen(scale[j / per]));
    for (int m = 0; m < MR; ++m) {
      const float* x = xe + m * K + 32 * j;
      __m256 t = _mm256_mul_ps(e0, _mm256_loadu_ps(x));
      t = _mm256_fmadd_ps(e1, _mm256_loadu_ps(x + 8), t);
      t = _mm256_fmadd_ps(o0, _mm256_loadu_ps(x + 16), t);
      t = _mm256_fmadd_ps(o1, _mm256_loadu_ps(x + 24), t);
      s[m][u] = _mm256_fmadd_ps(t, sc, s[m][u]);
    }
  };
  const int64_t chunks = K / 32;
  int64_t j = 0;
  for (; j + U <= chunks; j += U)
    for (int u = 0; u < U; ++u) chunk(j + u, u);
  for (; j < chunks; ++j) chunk(j, 0);
  for (int m = 0; m < MR; ++m) {
    __m256 t = s[m][0];
    for (int u = 1; u < U; ++u) t = _mm256_add_ps(t, s[m][u]);
    acc[m] = pagedserve::hsum(t);
    for (int64_t g = 0; g < G; ++g) acc[m] += widen(bias[g]) * xsum[m * G + g];
  }
}
#else
template <int MR, typename S>
inline void dot_row_int4(const uint8_t* c, const S* scale, const S* bias, const float* xe, const float* xsum,
                         int64_t K, int64_t G, float*, float* acc) {
  const int64_t per = K / 32 / G;
  for (int m = 0; m < MR; ++m) {
    acc[m] = 0.f;
    for (int64_t g = 0; g < G; ++g) acc[m] += widen(bias[g]) * xsum[m * G + g];
  }
  for (int64_t j = 0; j < K / 32; ++j)
    for (int m = 0; m < MR; ++m) {
      const float* x = xe + m * K + 32 * j;
      float t = 0.f;
      for (int64_t i = 0; i < 16; ++i) t += (c[16 * j + i] & 15) * x[i] + (c[16 * j + i] >> 4) * x[16 + i];
      acc[m] += widen(scale[j / per]) * t;
    }
}
#endif

#if defined(PAGEDSERVE_AVX512) && defined(__AVX512BF16__)
#define PAGEDSERVE_INT4_BF16 1

// x [M, K] bf16 -> xb (per 64: the 32 values at even k, then the 32 at odd k) and xsum [M, K / group] in fp32
inline void prepare_bf16_activations(const uint16_t* x, int64_t M, int64_t K, int64_t group, uint16_t* xb,
                                     float* xsum) {
  alignas(64) static const uint16_t even_odd[64] = {
      0,  2,  4,  6,  8,  10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30, 32, 34, 36, 38, 40, 42,
      44, 46, 48, 50, 52, 54, 56, 58, 60, 62, 1,  3,  5,  7,  9,  11, 13, 15, 17, 19, 21, 23,
      25, 27, 29, 31, 33, 35, 37, 39, 41, 43, 45, 47, 49, 51, 53, 55, 57, 59, 61, 63};
  const __m512i ie = _mm512_load_si512(even_odd), io = _mm512_load_si512(even_odd + 32);
  auto widen32 = [](__m512i v) __attribute__((always_inline)) {  // 32 bf16 -> the sum of two fp32 halves
    const __m512 a = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(v)), 16));
    const __m512 b =
        _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, 1)), 16));
    return _mm512_add_ps(a, b);
  };
  for (int64_t m = 0; m < M; ++m) {
    const uint16_t* xm = x + m * K;
    uint16_t* dst = xb + m * K;
    for (int64_t k = 0; k < K; k += 64) {
      const __m512i a = _mm512_loadu_si512(xm + k), b = _mm512_loadu_si512(xm + k + 32);
      _mm512_storeu_si512(dst + k, _mm512_permutex2var_epi16(a, ie, b));
      _mm512_storeu_si512(dst + k + 32, _mm512_permutex2var_epi16(a, io, b));
    }
    for (int64_t g = 0; g < K / group; ++g) {
      __m512 sum = _mm512_setzero_ps();
      for (int64_t k = g * group; k < (g + 1) * group; k += 32)
        sum = _mm512_add_ps(sum, widen32(_mm512_loadu_si512(xm + k)));
      xsum[m * (K / group) + g] = _mm512_reduce_add_ps(sum);
    }
  }
}

// bf16: chunks of 64 codes (32 bytes); xb holds, per chunk, the 32 x at even k then the 32 at odd k. Lane l of
// vdpbf16ps sums pair (2l, 2l + 1), i.e. k = 64j + 4l (+2): lanes 0-7 lie in the chunk's first 32 codes,
// lanes 8-15 in its second, hence the scale vector blends the two 32-code scales.
template <int MR, typename S>
inline void dot_row_int4_bf16(const uint8_t* c, const S* scale, const S* bias, const uint16_t* xb,
                              const float* xsum, int64_t K, int64_t G, float* buf, float* acc) {
  RowAccumulators<MR> r;
  const float* cs = row_prologue<MR>(scale, bias, 128.f, xsum, G, K / 32 / G, buf, buf + MAX_GROUPS, r.sb);
  const __m512i nib = _mm512_set1_epi16(15), pattern = _mm512_set1_epi16(0x4300);  // bf16(128) = 0x4300
  const int64_t chunks = K / 64;
  auto chunk = [&](int64_t j, int u) __attribute__((always_inline)) {
    const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32 * j)));
    const __m512bh lo = (__m512bh)_mm512_ternarylogic_epi32(w, nib, pattern, 0xEA);  // (w & nib) | pattern
    const __m512bh hi = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(w, 4), pattern);
    const __m512 sc = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(cs[2 * j]), _mm512_set1_ps(cs[2 * j + 1]));
    for (int m = 0; m < MR; ++m) {
      const uint16_t* x = xb + m * K + 64 * j;
      __m512 t = _mm512_dpbf16_ps(_mm512_setzero_ps(), lo, (__m512bh)_mm512_loadu_si512(x));
      t = _mm512_dpbf16_ps(t, hi, (__m512bh)_mm512_loadu_si512(x + 32));
      r.s[m][u] = _mm512_fmadd_ps(t, sc, r.s[m][u]);
    }
  };
  r.run(chunks, chunk);
  r.finish(acc);
}
#endif

#ifdef PAGEDSERVE_AVX512
// x [M, K] fp32 -> xe (per 32: the 16 values at even k, then the 16 at odd k) and xsum [M, K / group]
inline void prepare_fp32_activations(const float* x, int64_t M, int64_t K, int64_t group, float* xe, float* xsum) {
  const __m512i ie = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i io = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * K;
    float* dst = xe + m * K;
    for (int64_t k = 0; k < K; k += 32) {
      const __m512 a = _mm512_loadu_ps(xm + k), b = _mm512_loadu_ps(xm + k + 16);
      _mm512_storeu_ps(dst + k, _mm512_permutex2var_ps(a, ie, b));
      _mm512_storeu_ps(dst + k + 16, _mm512_permutex2var_ps(a, io, b));
    }
    for (int64_t g = 0; g < K / group; ++g) {
      __m512 sum = _mm512_setzero_ps();
      for (int64_t k = g * group; k < (g + 1) * group; k += 16) sum = _mm512_add_ps(sum, _mm512_loadu_ps(xm + k));
      xsum[m * (K / group) + g] = _mm512_reduce_add_ps(sum);
    }
  }
}
#endif

template <typename T, typename S>
void int4_linear_impl(const T* x, int64_t M, int64_t K, const uint8_t* codes, const S* scale, const S* bias,
                      int64_t N, int64_t G, T* out) {
  const int64_t group = K / G;
  bool use_bf16 = false;
#ifdef PAGEDSERVE_INT4_BF16
  use_bf16 = std::is_same_v<T, at::BFloat16> && K % 64 == 0;
#endif
  // x reordered to the codes' nibble order (fp32 per 32, or bf16 bits per 64), and its per-group sums
  std::vector<float> xe(use_bf16 ? 0 : M * K), xsum(M * G, 0.f);
  std::vector<uint16_t> xb(use_bf16 ? M * K : 0);
#ifdef PAGEDSERVE_INT4_BF16
  if (use_bf16) {  // vectorised: one even/odd word permute per 64, the group sums from the widened halves
    prepare_bf16_activations(reinterpret_cast<const uint16_t*>(x), M, K, group, xb.data(), xsum.data());
  } else
#endif
#ifdef PAGEDSERVE_AVX512
  if constexpr (std::is_same_v<T, float>) {  // vectorised: one even/odd permute per 32 (the scalar loop cost
    prepare_fp32_activations(x, M, K, group, xe.data(), xsum.data());  // as much as a small matrix's codes)
  } else
#endif
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      float sum = 0.f;
      for (int64_t k = g * group; k < (g + 1) * group; ++k) {  // fp32 layout: the bf16 one is vectorised above
        const float v = widen(x[m * K + k]);
        xe[m * K + (k & ~int64_t(31)) + (k & 1) * 16 + (k & 31) / 2] = v;
        sum += v;
      }
      xsum[m * G + g] = sum;
    }
  at::parallel_for(0, (N + BN - 1) / BN, 1, [&](int64_t b0, int64_t b1) {
    float buf[2 * MAX_GROUPS];  // the row's scales widened, and spread per 32 codes
    for (int64_t n = b0 * BN; n < std::min(N, b1 * BN); ++n) {
      const uint8_t* c = codes + n * (K / 2);
      const S* sc = scale + n * G;
      const S* bi = bias + n * G;
      for (int64_t m = 0; m < M; m += 4) {
        float acc[4];
        const int64_t mr = std::min<int64_t>(4, M - m);
        const float* xs = xsum.data() + m * G;
#ifdef PAGEDSERVE_INT4_BF16
        if (use_bf16) {
          const uint16_t* xm = xb.data() + m * K;
          switch (mr) {
            case 4: dot_row_int4_bf16<4>(c, sc, bi, xm, xs, K, G, buf, acc); break;
            case 3: dot_row_int4_bf16<3>(c, sc, bi, xm, xs, K, G, buf, acc); break;
            case 2: dot_row_int4_bf16<2>(c, sc, bi, xm, xs, K, G, buf, acc); break;
            default: dot_row_int4_bf16<1>(c, sc, bi, xm, xs, K, G, buf, acc); break;
          }
        } else
#endif
        {
          const float* xm = xe.data() + m * K;
          switch (mr) {
            case 4: dot_row_int4<4>(c, sc, bi, xm, xs, K, G, buf, acc); break;
            case 3: dot_row_int4<3>(c, sc, bi, xm, xs, K, G, buf, acc); break;
            case 2: dot_row_int4<2>(c, sc, bi, xm, xs, K, G, buf, acc); break;
            default: dot_row_int4<1>(c, sc, bi, xm, xs, K, G, buf, acc); break;
          }
        }
        for (int64_t i = 0; i < mr; ++i) out[(m + i) * N + n] = static_cast<T>(acc[i]);
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
