// 16 lanes of T as fp32 on AVX-512: loads, rounding stores and SiLU * up, for the kernels that work a vector at a
// time (int8_gemm.cpp's epilogue, layer_ops.cpp's SiLU * up, the panels' dequantization in panels.h).
#pragma once

#include <ATen/ATen.h>

#include <type_traits>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PAGEDSERVE_AVX512 1
#endif

namespace pagedserve {

#ifdef PAGEDSERVE_AVX512
// 16 activations widened to fp32
template <typename T>
inline __m512 load16f(const T* x) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(x);
  } else if constexpr (std::is_same_v<T, at::Half>) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
  } else {
    static_assert(std::is_same_v<T, at::BFloat16>);
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
}

// 16 values rounded to T and back (nearest even; finite values)
template <typename T>
inline __m512 round_to(__m512 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, at::Half>) {
    return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  } else {
    const __m512i b = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
    return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
}

// widen.h's silu_times on 16 lanes, step for step (the same values to the bit): a and u are values of T
template <typename T>
inline __m512 silu_times16(__m512 a, __m512 u) {
  const __m512 x = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(a));
  const __m512 magic = _mm512_set1_ps(12582912.f);
  const __m512 t = _mm512_max_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f)), _mm512_set1_ps(-126.f));
  const __m512 i = _mm512_sub_ps(_mm512_add_ps(t, magic), magic), f = _mm512_sub_ps(t, i);
  __m512 p = _mm512_set1_ps(1.5403530e-4f);
  for (const float c : {1.3333558e-3f, 9.6181291e-3f, 5.5504109e-2f, 2.4022651e-1f, 6.9314718e-1f, 1.0f})
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
  const __m512i bits = _mm512_add_epi32(_mm512_castps_si512(p), _mm512_slli_epi32(_mm512_cvtps_epi32(i), 23));
  const __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_NLT_UQ),
                                       _mm512_castsi512_ps(bits));
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 num = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_GE_OQ), e, one);
  const __m512 sig = _mm512_div_ps(num, _mm512_add_ps(one, e));
  return _mm512_mul_ps(round_to<T>(_mm512_mul_ps(a, sig)), u);
}

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

// 32 fp32 values (lo, then hi) -> T: one instruction for bf16 where the CPU converts natively
template <typename T>
inline void store32(T* dst, __m512 lo, __m512 hi) {
#ifdef __AVX512BF16__
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    _mm512_storeu_si512(dst, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
    return;
  }
#endif
  store16(dst, lo);
  store16(dst + 16, hi);
}

#endif

}  // namespace pagedserve
