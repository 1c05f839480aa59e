// The decoder layer's small ops, fused: RMSNorm (with the residual add before it), RoPE in place, SiLU * up.
//
// At batch 1 each of these is several PyTorch ops (casts, reductions, chunk/cat/neg for RoPE), dozens per
// layer, each paying a call's fixed cost for little arithmetic: together a sizeable share of a step once the
// weights are quantized (figures in docs/performance.md).
// Each op here is one pass over its rows. Arithmetic is fp32; for bf16/fp16 tensors the results are rounded
// where the PyTorch path rounds (after the normalisation, after each product), so the two paths agree to
// the last bit in most elements and to one rounding step elsewhere.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "ops.h"
#include "vec16.h"
#include "widen.h"

namespace {

using pagedserve::narrow;
using pagedserve::rnd;
using pagedserve::widen;

constexpr int64_t GRAIN = 16;  // rows per task: tiny batches stay on one thread (no fork/join cost)

// fp32 sums in order, as it always did (a vectorised order moved fp32 logits by more than the tests'
// tolerance); bf16/fp16 as a vector reduction (in order, the compiler kept the whole bf16 norm scalar).
// Figures: docs/performance.md.
template <typename T>
inline float sum_squares(const T* v, int64_t H) {
  float ss = 0.f;
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t i = 0; i < H; ++i) ss += v[i] * v[i];
  } else {
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < H; ++i) ss += widen(v[i]) * widen(v[i]);
  }
  return ss;
}

// y = weight * normalise(x) (RMS over the last dim). With `residual`: residual += x first, in place, and the
// sum is normalised (the layer's `h = h + sublayer(...)` then the next norm).
template <typename T>
void rms_norm_impl(const T* x, T* residual, const T* weight, T* y, int64_t rows, int64_t H, float eps) {
  at::parallel_for(0, rows, GRAIN, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * H;
      T* hr = residual != nullptr ? residual + r * H : nullptr;
      if (hr != nullptr) {  // the residual first, stored (rounded) in T; then the sum of its squares
#pragma omp simd
        for (int64_t i = 0; i < H; ++i) hr[i] = narrow<T>(widen(hr[i]) + widen(xr[i]));
      }
      const float ss = sum_squares(hr != nullptr ? hr : xr, H);
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
      const T* src = hr != nullptr ? hr : xr;
      T* yr = y + r * H;
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) yr[i] = narrow<T>(rnd<T>(widen(src[i]) * inv) * widen(weight[i]));
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && x.size(1) == weight.size(0) && x.scalar_type() == weight.scalar_type(),
              "rms_norm: x [T, H] and weight [H] of one dtype");
  const auto xc = x.contiguous();
  const auto wc = weight.contiguous();
  auto y = at::empty_like(xc);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_impl<scalar_t>(xc.data_ptr<scalar_t>(), nullptr, wc.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(),
                            x.size(0), x.size(1), static_cast<float>(eps));
  });
  return y;
}

// residual += x (in place); returns rms_norm(residual)
at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  TORCH_CHECK(residual.is_contiguous() && residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "add_rms_norm: a contiguous residual shaped and typed like x");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && x.size(1) == weight.size(0) && x.scalar_type() == weight.scalar_type(),
              "add_rms_norm: x [T, H] and weight [H] of one dtype");
  const auto xc = x.contiguous();
  const auto wc = weight.contiguous();
  auto y = at::empty_like(xc);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    rms_norm_impl<scalar_t>(xc.data_ptr<scalar_t>(), residual.data_ptr<scalar_t>(), wc.data_ptr<scalar_t>(),
                            y.data_ptr<scalar_t>(), x.size(0), x.size(1), static_cast<float>(eps));
  });
  return y;
}

// Neox-style (rotate-half) RoPE in place on x [T, heads, D] (any strides with a unit last stride), cos/sin
// [T, D] in x's dtype: x' = x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1).
template <typename T>
void rope_impl(T* x, int64_t T_, int64_t heads, int64_t D, int64_t st, int64_t sh, const T* cos, const T* sin) {
  const int64_t half = D / 2;
  at::parallel_for(0, T_, GRAIN, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const T* c = cos + t * D;
      const T* s = sin + t * D;
      for (int64_t h = 0; h < heads; ++h) {
        T* v = x + t * st + h * sh;
#pragma omp simd  // v[i] and v[i + half] never overlap another iteration's: GCC could not prove it
        for (int64_t i = 0; i < half; ++i) {
          const float a = widen(v[i]), b = widen(v[i + half]);
          v[i] = narrow<T>(rnd<T>(a * widen(c[i])) + rnd<T>(-b * widen(s[i])));
          v[i + half] = narrow<T>(rnd<T>(b * widen(c[i + half])) + rnd<T>(a * widen(s[i + half])));
        }
      }
    }
  });
}

void rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0, "rope_: x [T, heads, D], unit last stride");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == x.size(0) * x.size(2) &&
                  sin.numel() == cos.numel() && cos.scalar_type() == x.scalar_type() &&
                  sin.scalar_type() == x.scalar_type(),
              "rope_: contiguous cos and sin [T, D] in x's dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rope_", [&] {
    rope_impl<scalar_t>(x.data_ptr<scalar_t>(), x.size(0), x.size(1), x.size(2), x.stride(0), x.stride(1),
                        cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>());
  });
}

// [T, 2I] (gate | up) -> silu(gate) * up, [T, I]
template <typename T>
void silu_mul_impl(const T* x, T* y, int64_t rows, int64_t I) {
  at::parallel_for(0, rows, GRAIN, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = x + r * 2 * I;
      const T* u = g + I;
      T* o = y + r * I;
      int64_t vec = 0;  // elements done 16 at a time
#ifdef PAGEDSERVE_AVX512
      if constexpr (!std::is_same_v<T, double>)  // the compiler leaves the scalar loop scalar for bf16
        for (; vec + 16 <= I; vec += 16)
          pagedserve::store16(o + vec, pagedserve::silu_times16<T>(pagedserve::load16f(g + vec),
                                                                   pagedserve::load16f(u + vec)));
#endif
#pragma omp simd
      for (int64_t i = vec; i < I; ++i) o[i] = pagedserve::silu_times<T>(widen(g[i]), widen(u[i]));
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "silu_and_mul: x [T, 2I]");
  const auto xc = x.contiguous();
  auto y = at::empty({x.size(0), x.size(1) / 2}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    silu_mul_impl<scalar_t>(xc.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), x.size(0), x.size(1) / 2);
  });
  return y;
}

}  // namespace

namespace pagedserve {
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) { return ::rms_norm(x, weight, eps); }
at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  return ::add_rms_norm(x, residual, weight, eps);
}
void rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) { ::rope_(x, cos, sin); }
at::Tensor silu_and_mul(const at::Tensor& x) { return ::silu_and_mul(x); }
}  // namespace pagedserve

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope_", &rope_);
  m.impl("silu_and_mul", &silu_and_mul);
}
