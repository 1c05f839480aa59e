// Shared by the CPU kernels: widening a stored element to fp32 (bf16 by a shift, fp16 by F16C where the
// CPU has it: c10's portable conversion is ~20 instructions).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>

#ifdef __F16C__
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

}  // namespace pagedserve
