// Shared by the CPU kernels: widening a stored element to fp32 (bf16 by a shift, fp16 by F16C where the
// CPU has it: c10's portable conversion is ~20 instructions), narrowing it back in arithmetic that
// vectorises, and an exp that vectorises.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace pagedserve {

inline float widen(float x) { return x; }
inline float widen(double x) { return static_cast<float>(x); }
inline float widen(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
#ifdef __F16C__
inline float widen(at::Half x) { return _cvtsh_ss(x.x); }
#else
inline float widen(at::Half x) { return static_cast<float>(x); }
#endif

// fp32 -> T, rounding to nearest even like c10's conversions. c10::BFloat16(float) branches on NaN, which kept
// every loop that stored bf16 scalar (RoPE over a long chunk among them); this is a select instead.
template <typename T>
inline T narrow(float v) {
  return static_cast<T>(v);
}
template <>
inline at::BFloat16 narrow<at::BFloat16>(float v) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof b);
  const uint32_t rounded = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
  const uint32_t nan = (b >> 16) | 0x40u;  // quiet, sign kept
  const uint32_t is_nan = 0u - static_cast<uint32_t>((b & 0x7fffffffu) > 0x7f800000u);  // all ones or zero
  at::BFloat16 out;
  out.x = static_cast<uint16_t>((nan & is_nan) | (rounded & ~is_nan));
  return out;
}
#ifdef __F16C__
template <>
inline at::Half narrow<at::Half>(float v) {
  at::Half out;
  out.x = _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT);
  return out;
}
#endif

#ifdef __AVX2__
// the sum of an AVX2 vector's 8 lanes (the 256-bit kernels' reduction)
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

// exp(x) for x <= 0 in plain arithmetic, so loops over it vectorise (std::exp does not): 2^x = 2^i * 2^f,
// 2^f by a degree-6 polynomial on [-0.5, 0.5] (relative error ~2e-7); below -126 * ln 2 it flushes to 0.
inline float fast_exp(float x) {
  float t = x * 1.4426950408889634f;
  t = t < -126.f ? -126.f : t;
  const float i = (t + 12582912.f) - 12582912.f;  // round to nearest: 1.5 * 2^23 trick
  const float f = t - i;
  float p = 1.5403530e-4f;
  p = p * f + 1.3333558e-3f;
  p = p * f + 9.6181291e-3f;
  p = p * f + 5.5504109e-2f;
  p = p * f + 2.4022651e-1f;
  p = p * f + 6.9314718e-1f;
  p = p * f + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &p, sizeof bits);
  bits += static_cast<int32_t>(i) << 23;
  float r;
  std::memcpy(&r, &bits, sizeof r);
  return x < -87.f ? 0.f : r;
}

// round to the storage type and back: where the PyTorch path materialises an intermediate in T
template <typename T>
inline float rnd(float x) {
  return widen(narrow<T>(x));
}

// SiLU(g) * u as T for a gate g and an up value u that are values of T (a GEMM's outputs as stored): the sigmoid
// from exp(-|g|) <= 1 (no overflow, and loops over it vectorise), the SiLU rounded to T as PyTorch's F.silu leaves it
template <typename T>
inline T silu_times(float g, float u) {
  const float e = fast_exp(-std::fabs(g));
  const float sig = (g >= 0.f ? 1.f : e) / (1.f + e);
  return narrow<T>(rnd<T>(g * sig) * u);
}

}  // namespace pagedserve
