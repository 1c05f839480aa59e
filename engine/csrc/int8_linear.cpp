// y = x W^T for a few rows of x against int8 weights with one scale per output row (weight-only int8).
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
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define PAGEDSERVE_AVX512 1
#endif

namespace {

constexpr int64_t BN = 16;  // output rows per work block

inline float widen(float x) { return x; }
inline float widen(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float widen(at::Half x) { return static_cast<float>(x); }
inline float widen(double x) { return static_cast<float>(x); }

// dot products of one int8 weight row with MR fp32 activation rows (each K long). One weight row at a
// time: tiles of several rows (reusing each activation load) measured ~2x slower at M = 1 on Zen 4, whose
// prefetcher streams one row well.
template <int MR>
inline void dot_row(const int8_t* w, const float* x, int64_t K, float* acc) {
  int64_t k = 0;
#ifdef PAGEDSERVE_AVX512
  __m512 s[MR];
  for (int m = 0; m < MR; ++m) s[m] = _mm512_setzero_ps();
  for (; k + 16 <= K; k += 16) {
    const __m512 wf =
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k))));
    for (int m = 0; m < MR; ++m) s[m] = _mm512_fmadd_ps(wf, _mm512_loadu_ps(x + m * K + k), s[m]);
  }
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_reduce_add_ps(s[m]);
#else
  for (int m = 0; m < MR; ++m) acc[m] = 0.f;
#endif
  for (; k < K; ++k) {  // the tail, or everything where AVX-512 is missing (the compiler vectorises it)
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve, m) { m.def("int8_linear(Tensor x, Tensor w, Tensor scale) -> Tensor"); }

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) { m.impl("int8_linear", &int8_linear); }
