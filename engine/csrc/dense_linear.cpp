// y = x W^T (+ b) for a few rows of x against a plain row-major weight of x's dtype: the decode GEMV.
//
// At batch 1 a step reads every weight once, so a linear costs its weight bytes. The library GEMVs (fp32
// `F.linear`, oneDNN's prepacked bf16 GEMV) stream decode-sized weights well below the memory bandwidth; one
// weight row at a time with independent accumulators (vdpbf16ps for bf16) comes closer to it
// (benchmarks/kernels/bench_dense_linear.py; figures in docs/performance.md). Work is split over output rows;
// each block of BN rows serves up to 8 activation rows per pass from L1/L2. Accumulation is fp32 in every
// dtype, rounded once per output.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "widen.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

using pagedserve::narrow;
using pagedserve::widen;

constexpr int64_t BN = 16;  // output rows per work block

// One fp32 vector type for the widened path: 16 lanes with AVX-512, 8 with AVX2 + FMA, else the compiler's.
#if defined(__AVX512F__)
using vec = __m512;
constexpr int64_t V = 16;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
inline float vsum(vec a) { return _mm512_reduce_add_ps(a); }
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline vec vload(const at::BFloat16* p) {  // bf16 -> fp32 is a shift: exact
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline vec vload(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#define PAGEDSERVE_DENSE_SIMD 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
using vec = __m256;
constexpr int64_t V = 8;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
inline float vsum(vec a) { return pagedserve::hsum(a); }
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline vec vload(const at::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline vec vload(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
#define PAGEDSERVE_DENSE_SIMD 1
#endif

// acc[m] = w . x[m] for one weight row and MR fp32 activation rows (each K long). With one accumulator the
// FMA latency chain bounds M = 1 below the memory's speed: U independent ones, fewer as MR supplies its own.
// One weight row at a time, not a tile of several: the hardware prefetcher follows one sequential stream well,
// and several interleaved row streams defeat it (docs/performance.md, "dense_linear.cpp").
template <int MR, typename T>
inline void dot_rows(const T* w, const float* x, int64_t K, float* acc) {
  int64_t k = 0;
#ifdef PAGEDSERVE_DENSE_SIMD
  constexpr int U = MR == 1 ? 4 : MR <= 4 ? 2 : 1;
  vec s[MR][U];
  for (int m = 0; m < MR; ++m)
    for (int u = 0; u < U; ++u) s[m][u] = vzero();
  for (; k + U * V <= K; k += U * V)
    for (int u = 0; u < U; ++u) {
      const vec wv = vload(w + k + u * V);
      for (int m = 0; m < MR; ++m) s[m][u] = vfma(wv, vload(x + m * K + k + u * V), s[m][u]);
    }
  for (; k + V <= K; k += V) {
    const vec wv = vload(w + k);
    for (int m = 0; m < MR; ++m) s[m][0] = vfma(wv, vload(x + m * K + k), s[m][0]);
  }
  for (int m = 0; m < MR; ++m) {
    vec t = s[m][0];
    for (int u = 1; u < U; ++u) t = vadd(t, s[m][u]);
    acc[m] = vsum(t);
  }
#else
  for (int m = 0; m < MR; ++m) acc[m] = 0.f;
#endif
  for (; k < K; ++k) {  // the tail, or everything without SIMD (the compiler vectorises what it can)
    const float wk = widen(w[k]);
    for (int m = 0; m < MR; ++m) acc[m] += wk * x[m * K + k];
  }
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define PAGEDSERVE_DENSE_BF16 1
// bf16 weights and activations as they are: vdpbf16ps multiplies 32 pairs exactly and adds them in fp32.
template <int MR>
inline void dot_rows_bf16(const at::BFloat16* w, const at::BFloat16* x, int64_t K, float* acc) {
  constexpr int U = MR == 1 ? 4 : MR <= 4 ? 2 : 1;
  constexpr int64_t W = 32;
  __m512 s[MR][U];
  for (int m = 0; m < MR; ++m)
    for (int u = 0; u < U; ++u) s[m][u] = _mm512_setzero_ps();
  auto ld = [](const at::BFloat16* p) __attribute__((always_inline)) { return (__m512bh)_mm512_loadu_si512(p); };
  int64_t k = 0;
  for (; k + U * W <= K; k += U * W)
    for (int u = 0; u < U; ++u) {
      const __m512bh wv = ld(w + k + u * W);
      for (int m = 0; m < MR; ++m) s[m][u] = _mm512_dpbf16_ps(s[m][u], wv, ld(x + m * K + k + u * W));
    }
  for (; k + W <= K; k += W) {
    const __m512bh wv = ld(w + k);
    for (int m = 0; m < MR; ++m) s[m][0] = _mm512_dpbf16_ps(s[m][0], wv, ld(x + m * K + k));
  }
  for (int m = 0; m < MR; ++m) {
    __m512 t = s[m][0];
    for (int u = 1; u < U; ++u) t = _mm512_add_ps(t, s[m][u]);
    acc[m] = _mm512_reduce_add_ps(t);
  }
  for (; k < K; ++k) {
    const float wk = widen(w[k]);
    for (int m = 0; m < MR; ++m) acc[m] += wk * widen(x[m * K + k]);
  }
}
#endif

// Rows n0..n1 of the output for MR activation rows: xs is x itself (native bf16 path) or its fp32 copy.
template <int MR, typename T, typename X>
void rows_block(const T* w, const X* xs, const T* bias, int64_t K, int64_t n0, int64_t n1, T* out, int64_t N) {
  float acc[MR];
  for (int64_t n = n0; n < n1; ++n) {
#ifdef PAGEDSERVE_DENSE_BF16
    if constexpr (std::is_same_v<X, at::BFloat16>) {
      dot_rows_bf16<MR>(w + n * K, xs, K, acc);
    } else
#endif
    if constexpr (std::is_same_v<X, float>) {
      dot_rows<MR>(w + n * K, xs, K, acc);
    }
    const float b = bias ? widen(bias[n]) : 0.f;
    for (int m = 0; m < MR; ++m) out[m * N + n] = narrow<T>(acc[m] + b);
  }
}

template <typename T, typename X>
void gemv(const X* xs, int64_t M, int64_t K, const T* w, const T* bias, int64_t N, T* out) {
  at::parallel_for(0, (N + BN - 1) / BN, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * BN, n1 = std::min(N, n0 + BN);
      for (int64_t m = 0; m < M; m += 8) {
        const X* xm = xs + m * K;
        T* om = out + m * N;
        switch (std::min<int64_t>(8, M - m)) {
          case 8: rows_block<8>(w, xm, bias, K, n0, n1, om, N); break;
          case 7: rows_block<7>(w, xm, bias, K, n0, n1, om, N); break;
          case 6: rows_block<6>(w, xm, bias, K, n0, n1, om, N); break;
          case 5: rows_block<5>(w, xm, bias, K, n0, n1, om, N); break;
          case 4: rows_block<4>(w, xm, bias, K, n0, n1, om, N); break;
          case 3: rows_block<3>(w, xm, bias, K, n0, n1, om, N); break;
          case 2: rows_block<2>(w, xm, bias, K, n0, n1, om, N); break;
          default: rows_block<1>(w, xm, bias, K, n0, n1, om, N); break;
        }
      }
    }
  });
}

at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "dense_linear: x [M, K], w [N, K]");
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), "dense_linear: w must have x's dtype");
  TORCH_CHECK(!bias || (bias->numel() == w.size(0) && bias->scalar_type() == x.scalar_type()),
              "dense_linear: bias [N] in x's dtype");
  const auto xc = x.contiguous();
  const auto wc = w.contiguous();
  const auto bc = bias ? bias->contiguous() : at::Tensor();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto out = at::empty({M, N}, x.options());
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* bp = bc.defined() ? bc.data_ptr<T>() : nullptr;
    if constexpr (std::is_same_v<T, float>) {
      gemv<T, float>(xc.data_ptr<float>(), M, K, wc.data_ptr<T>(), bp, N, out.data_ptr<T>());
      return;
    }
#ifdef PAGEDSERVE_DENSE_BF16
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      gemv<T, T>(xc.data_ptr<T>(), M, K, wc.data_ptr<T>(), bp, N, out.data_ptr<T>());
      return;
    }
#endif
    if constexpr (!std::is_same_v<T, float>) {
      std::vector<float> xf(M * K);  // activations widened once: a few KiB
      const T* xp = xc.data_ptr<T>();
      for (int64_t i = 0; i < M * K; ++i) xf[i] = widen(xp[i]);
      gemv<T, float>(xf.data(), M, K, wc.data_ptr<T>(), bp, N, out.data_ptr<T>());
    }
  };
  switch (x.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16: run(at::BFloat16{}); break;
    case at::kHalf: run(at::Half{}); break;
    default: TORCH_CHECK(false, "dense_linear: fp32, bf16 or fp16 only, not ", x.scalar_type());
  }
  return out;
}

}  // namespace

namespace pagedserve {
at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  return ::dense_linear(x, w, bias);
}
}  // namespace pagedserve

TORCH_LIBRARY_FRAGMENT(pagedserve, m) { m.def("dense_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor"); }

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) { m.impl("dense_linear", &dense_linear); }
