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
#include <vector>

#include "widen.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define PAGEDSERVE_AVX512 1
#endif

namespace {

constexpr int64_t BN = 16;  // output rows per work block
constexpr int64_t TILE_KIB = 2048;  // dequantized tile for the many-row GEMM: L2/L3-resident
constexpr int64_t MAX_GROUPS = 1024;  // int4 groups per row (K / group): K up to 32768 at group 32

using pagedserve::widen;

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

// ---- int4 ------------------------------------------------------------------------------------------
// w[n, k] = c * scale[n, g] + bias[n, g] (fp16 or fp32) for the 4-bit code c of k in group g = k / group; codes
// two per byte, k even in the low nibble (engine/quant/formats.py pack_nibbles). Per row,
//   y = sum_g scale_g * sum_{k in g} c_k x_k  +  sum_g bias_g * sum_{k in g} x_k,
// so the inner loop multiplies raw codes, and the activations are split once into even and odd halves per
// 32 so a 16-byte load of codes becomes two vectors by masking and shifting.
template <int MR>
inline void dot_row_int4(const uint8_t* c, const float* scale, const float* bias, const float* xe,
                         const float* xsum, int64_t K, int64_t G, int64_t group, float* acc) {
  for (int m = 0; m < MR; ++m) {
    float b = 0.f;
    for (int64_t g = 0; g < G; ++g) b += bias[g] * xsum[m * G + g];
    acc[m] = b;
  }
#ifdef PAGEDSERVE_AVX512
  __m512 s[MR];
  for (int m = 0; m < MR; ++m) s[m] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi32(15);
  for (int64_t g = 0; g < G; ++g) {  // by group: no division per 32 codes
    const __m512 sc = _mm512_set1_ps(scale[g]);
    __m512 t[MR];
    for (int m = 0; m < MR; ++m) t[m] = _mm512_setzero_ps();
    for (int64_t k = g * group; k < (g + 1) * group; k += 32) {
      const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + k / 2)));
      const __m512 even = _mm512_cvtepi32_ps(_mm512_and_si512(b, low));
      const __m512 odd = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
      for (int m = 0; m < MR; ++m) {
        const float* x = xe + m * K + k;
        t[m] = _mm512_fmadd_ps(odd, _mm512_loadu_ps(x + 16), _mm512_fmadd_ps(even, _mm512_loadu_ps(x), t[m]));
      }
    }
    for (int m = 0; m < MR; ++m) s[m] = _mm512_fmadd_ps(t[m], sc, s[m]);
  }
  for (int m = 0; m < MR; ++m) acc[m] += _mm512_reduce_add_ps(s[m]);
#else
  for (int64_t k = 0, g = 0; k < K; k += 32, g = k / group) {
    for (int m = 0; m < MR; ++m) {
      const float* x = xe + m * K + k;
      float t = 0.f;
      for (int64_t i = 0; i < 16; ++i) t += (c[k / 2 + i] & 15) * x[i] + (c[k / 2 + i] >> 4) * x[16 + i];
      acc[m] += scale[g] * t;
    }
  }
#endif
}

template <typename T, typename S>
void int4_linear_impl(const T* x, int64_t M, int64_t K, const uint8_t* codes, const S* scale, const S* bias,
                      int64_t N, int64_t G, T* out) {
  const int64_t group = K / G;
  std::vector<float> xe(M * K), xsum(M * G, 0.f);  // x split even/odd per 32, and its per-group sums
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) {
      const float v = widen(x[m * K + k]);
      xe[m * K + (k & ~int64_t(31)) + (k & 1) * 16 + (k & 31) / 2] = v;
      xsum[m * G + k / group] += v;
    }
  at::parallel_for(0, (N + BN - 1) / BN, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t n = b * BN; n < std::min(N, (b + 1) * BN); ++n) {
        const uint8_t* c = codes + n * (K / 2);
        float sc[MAX_GROUPS], bi[MAX_GROUPS];  // the row's fp16 scales widened once, not once per use
        for (int64_t g = 0; g < G; ++g) {
          sc[g] = widen(scale[n * G + g]);
          bi[g] = widen(bias[n * G + g]);
        }
        for (int64_t m = 0; m < M; m += 4) {
          float acc[4];
          const int64_t mr = std::min<int64_t>(4, M - m);
          const float* xm = xe.data() + m * K;
          const float* sm = xsum.data() + m * G;
          switch (mr) {
            case 4: dot_row_int4<4>(c, sc, bi, xm, sm, K, G, group, acc); break;
            case 3: dot_row_int4<3>(c, sc, bi, xm, sm, K, G, group, acc); break;
            case 2: dot_row_int4<2>(c, sc, bi, xm, sm, K, G, group, acc); break;
            default: dot_row_int4<1>(c, sc, bi, xm, sm, K, G, group, acc); break;
          }
          for (int64_t i = 0; i < mr; ++i) out[(m + i) * N + n] = static_cast<T>(acc[i]);
        }
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
                  bias.sizes() == scale.sizes() && K % G == 0 && (K / G) % 32 == 0 && G <= MAX_GROUPS,
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
inline void store(float v, float* o) { *o = v; }
inline void store(float v, double* o) { *o = v; }
inline void store(float v, at::BFloat16* o) {  // round to nearest even, in integer ops the compiler vectorises
  uint32_t b;
  std::memcpy(&b, &v, sizeof b);
  o->x = static_cast<uint16_t>((b + 0x7fff + ((b >> 16) & 1)) >> 16);
}
inline void store(float v, at::Half* o) { *o = static_cast<at::Half>(v); }

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
          store(static_cast<float>(byte & 15) * sc + bi, o + g * group + 2 * i);
          store(static_cast<float>(byte >> 4) * sc + bi, o + g * group + 2 * i + 1);
        }
      }
    }
  });
}

// out[:, n0:n1] = x @ tile^T for tiles filled by fill(n0, n1, tile pointer)
template <typename Fill>
at::Tensor tiled_gemm(const at::Tensor& x, int64_t N, Fill fill) {
  const int64_t K = x.size(1);
  const int64_t TN = std::max<int64_t>(64, ((TILE_KIB << 10) / (K * x.element_size())) / 16 * 16);
  auto out = at::empty({x.size(0), N}, x.options());
  auto tile = at::empty({std::min(TN, N), K}, x.options());
  for (int64_t n0 = 0; n0 < N; n0 += TN) {
    const int64_t n1 = std::min(N, n0 + TN);
    auto t = tile.narrow(0, 0, n1 - n0);
    fill(n0, n1, t);
    out.narrow(1, n0, n1 - n0).copy_(at::linear(x, t));  // at::mm(x, t.t()) took a slow path for bf16
  }
  return out;
}

at::Tensor int8_gemm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) && w.scalar_type() == at::kChar &&
                  scale.scalar_type() == at::kFloat && scale.numel() == w.size(0),
              "int8_gemm: x [M, K], int8 w [N, K], one fp32 scale per row");
  const auto xc = x.contiguous();
  const auto wc = w.contiguous();
  const auto sc = scale.contiguous();
  // The tile holds the codes themselves (exact in any float dtype; torch's vectorised int8 -> float copy) and
  // the row scales multiply the output columns afterwards: cheaper than scaling every weight.
  auto out = tiled_gemm(xc, w.size(0),
                        [&](int64_t n0, int64_t n1, at::Tensor& t) { t.copy_(wc.narrow(0, n0, n1 - n0)); });
  return out.mul_(sc);  // computed in fp32, rounded once
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
  });
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
