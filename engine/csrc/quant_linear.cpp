// y = x W^T against int8 or int4 codes with a scale (and a bias) per group of K: a GEMV for a few rows of x, a
// tiled GEMM for many. The groups cover our own formats (a scale per row or per group) and llama.cpp's blocks as
// the GGUF file holds them (Q8_0, Q4_0/1, Q5_0/1, and the K-quants' sub-block scales under a super-block factor).
//
// At decode a step reads every weight once, so the cost is the weight bytes: the GEMVs stream the weights once,
// multiplying their integer codes by int8 codes of the activations, where torch's `_weight_int8pack_mm` stays
// well below a bf16 GEMV's bandwidth (and slower still with fp32 activations; figures in docs/performance.md).
// Both formats share one layout (panels.h) and one kernel (below); beyond the dispatch table's quant_gemv_max_rows
// the caller dequantizes tiles and runs a GEMM (below), or multiplies int8 codes on AMX or VNNI (int8_gemm.cpp).
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
#include "panels.h"
#include "widen.h"

namespace {

// dequantized tile for the many-row GEMM: one GEMM call per tile, and each GEMM call has a fixed cost, so a tile
// holds most projections whole (figures in docs/performance.md)
constexpr int64_t TILE_KIB = 16384;

using pagedserve::narrow;
using pagedserve::widen;
using namespace pagedserve::panels;

// The activations are int8 codes with a scale per 32 values (llama.cpp's Q8_0: relative error <= 1/254 of the
// block's absmax, ~0.5 % of a product), so one u8 x s8 vpdpbusd does 64 multiply-adds. int4 codes are u8 as
// they are; int8 codes go in as c + 128, and 128 times the block's sum of activation codes comes off the block's
// int32 sum, exactly. int32 lanes are exact: a 32-value block adds at most 32 * 255 * 127.
struct Int8Blocks {
  std::vector<int8_t> q;  // [M, K] (+ 4 bytes of slack for the last 4-byte broadcast)
  std::vector<float> scale;  // [M, K / XB]
  std::vector<float> xsum;  // [M, G]: per weight group the sum of the dequantized activation codes
  std::vector<int32_t> isum;  // [M, K / 16]: per 16 values the sum of the codes (the weight codes' offset term)
};

template <typename T>
Int8Blocks quantize_blocks(const T* x, int64_t M, int64_t K, int64_t G) {
  Int8Blocks r;
  r.q.assign(M * K + 4, 0);
  r.scale.assign(M * K / XB, 0.f);
  r.xsum.assign(M * G, 0.f);
  r.isum.assign(M * K / 16, 0);
  const int64_t group = K / G;  // 16 or a multiple of 32: each 16 codes lie in one group
  float xf[XB];
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < K / XB; ++b) {
      const T* src = x + m * K + b * XB;
      int8_t* q = r.q.data() + m * K + b * XB;
      float amax = 0.f;
      for (int64_t i = 0; i < XB; ++i) {
        xf[i] = widen(src[i]);
        amax = std::max(amax, std::abs(xf[i]));
      }
      const float inv = amax > 0.f ? 127.f / amax : 0.f, scale = amax / 127.f;
      int32_t sum[2] = {0, 0};  // per half block
      int64_t i = 0;
#ifdef PAGEDSERVE_AVX512
      const __m512 vinv = _mm512_set1_ps(inv);
      for (; i < XB; i += 16) {  // round to nearest even, as the scalar form
        const __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xf + i), vinv));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtsepi32_epi8(c));
        sum[i / 16] += _mm512_reduce_add_epi32(c);
      }
#endif
      for (; i < XB; ++i) {
        q[i] = static_cast<int8_t>(std::nearbyint(xf[i] * inv));  // |code| <= 127
        sum[i / 16] += q[i];
      }
      r.scale[m * K / XB + b] = scale;
      for (int h = 0; h < 2; ++h) {
        r.xsum[m * G + (b * XB + 16 * h) / group] += static_cast<float>(sum[h]) * scale;
        r.isum[m * K / 16 + 2 * b + h] = sum[h];
      }
    }
  }
  return r;
}

// A GEMV's time is the time to stream its weights in, and on its own one core keeps too few cache-line reads in
// flight to reach the memory's speed: each step asks for the line PREFETCH_AHEAD bytes further on in the panels
// (contiguous, so the distance runs on into the next panel). Too short a distance and the line is not there in
// time; too long and it may be evicted before it is read. The value sits in the middle of the range that measured
// alike (benchmarks/kernels/bench_gguf_gemv.py; figures in docs/performance.md).
constexpr int64_t PREFETCH_AHEAD = 4096;
template <int BITS>
inline void prefetch_step(const uint8_t* c, int64_t q) {
  const char* at = reinterpret_cast<const char*>(c) + q * (BITS == 6 ? 96 : 64) + PREFETCH_AHEAD;
  __builtin_prefetch(at, 0, 3);
  if constexpr (BITS == 6) __builtin_prefetch(at + 64, 0, 3);  // 1.5 lines a step: two cover them all
}

// code j (0 .. 8, or 4 for int8) of row r in step q
template <int BITS>
inline int32_t panel_code(const uint8_t* c, int64_t q, int64_t r, int j) {
  if constexpr (BITS == 8) {
    return static_cast<int8_t>(c[q * 64 + 4 * r + j]);
  } else {
    const uint8_t byte = c[step_offset<BITS>(q) + 4 * r + (j & 3)];
    int32_t code = j < 4 ? byte & 15 : byte >> 4;
    if constexpr (BITS == 6) {
      const uint8_t piece = c[pieces_offset(q) + 4 * r + (j & 3)];
      code |= ((piece >> (4 * (q % 2) + 2 * (j >= 4))) & 3) << 4;
    }
    return code;
  }
}

inline int32_t load4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// ---- the GEMV: out[m, 16 rows] for one panel and MR activation rows (from m0), as fp32 into y[m][16] -------
// BITS 4 or 8; bias: int4's (null for int8). STEPS: 64-byte steps per 32-value activation block.
#ifdef PAGEDSERVE_AVX512
#ifdef __AVX512VNNI__
#define PAGEDSERVE_DPBUSD(acc, u8, s8) _mm512_dpbusd_epi32(acc, u8, s8)
constexpr bool INT8_OFFSET = true;  // int8 codes + 128 as u8 for vpdpbusd
#else  // nibbles x int8 pairs sum to at most 2 * 15 * 127: vpmaddubsw cannot saturate
#define PAGEDSERVE_DPBUSD(acc, u8, s8) \
  _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u8, s8), _mm512_set1_epi16(1)))
// int8: |c| x (x with c's sign), whose pairs sum to at most 2 * 128 * 127, where c + 128 would saturate
constexpr bool INT8_OFFSET = false;
#endif

template <int BITS, int MR>
inline void panel_dot(const uint8_t* c, const GroupValues& scale, const GroupValues& bias, int64_t p,
                      const Int8Blocks& x, int64_t m0, int64_t K, int64_t G, float (*y)[PANEL]) {
  constexpr int PER = BITS == 8 ? 4 : 8, STEPS = XB / PER;  // codes per 64-byte step, steps per activation block
  const int64_t spg = K / G / PER;  // steps per group: STEPS / 2 (groups of 16) or a multiple of STEPS
  const __m512i nib = _mm512_set1_epi8(15), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i top = _mm512_set1_epi8(0x30);
  const int8_t* xq[MR];
  const float* xs[MR];
  __m512 f[MR];
  for (int m = 0; m < MR; ++m) {
    xq[m] = x.q.data() + (m0 + m) * K;
    xs[m] = x.scale.data() + (m0 + m) * K / XB;
    f[m] = _mm512_setzero_ps();
  }
  // the codes' offset (int8's 128 as u8, int6's 32), taken off each block's integer sum
  constexpr int32_t OFFSET = BITS == 6 ? 32 : BITS == 8 && INT8_OFFSET ? 128 : 0;
  __m512 fg[MR];
  // NS steps from q (within one activation block and one group) into fg
  auto run = [&](auto ns, int64_t q0) {
    constexpr int NS = decltype(ns)::value;
    // two chains per row for up to 4 rows (a block's multiply-adds are not then one dependent sequence), one for
    // 8 rows, whose 8 chains are independent enough and whose registers would not hold 16
    constexpr int CH = MR <= 4 ? 2 : 1;
    __m512i t[MR][CH];
    for (int m = 0; m < MR; ++m)
      for (int h = 0; h < CH; ++h) t[m][h] = _mm512_setzero_si512();
    for (int s = 0; s < NS; ++s) {
      const int64_t q = q0 + s;
      prefetch_step<BITS>(c, q);
      const __m512i b = _mm512_loadu_si512(c + step_offset<BITS>(q));
      if constexpr (BITS != 8) {
        __m512i lo = _mm512_and_si512(b, nib), hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), nib);
        if constexpr (BITS == 6) {  // q0 is even: step q's pieces are bits 0-3 (s even) or 4-7 of each byte
          const __m512i pc = _mm512_loadu_si512(c + pieces_offset(q));
          if (s % 2 == 0) {
            lo = _mm512_or_si512(lo, _mm512_and_si512(_mm512_slli_epi16(pc, 4), top));
            hi = _mm512_or_si512(hi, _mm512_and_si512(_mm512_slli_epi16(pc, 2), top));
          } else {
            lo = _mm512_or_si512(lo, _mm512_and_si512(pc, top));
            hi = _mm512_or_si512(hi, _mm512_and_si512(_mm512_srli_epi16(pc, 2), top));
          }
        }
        for (int m = 0; m < MR; ++m) {
          const int8_t* a = xq[m] + 8 * q;
          t[m][s % CH] = PAGEDSERVE_DPBUSD(t[m][s % CH], lo, _mm512_set1_epi32(load4(a)));
          t[m][s % CH] = PAGEDSERVE_DPBUSD(t[m][s % CH], hi, _mm512_set1_epi32(load4(a + 4)));
        }
      } else if constexpr (INT8_OFFSET) {
        const __m512i u = _mm512_xor_si512(b, flip);
        for (int m = 0; m < MR; ++m)
          t[m][s % CH] = PAGEDSERVE_DPBUSD(t[m][s % CH], u, _mm512_set1_epi32(load4(xq[m] + 4 * q)));
      } else {
        const __m512i u = _mm512_abs_epi8(b);
        const __mmask64 neg = _mm512_movepi8_mask(b);
        for (int m = 0; m < MR; ++m) {
          const __m512i a = _mm512_set1_epi32(load4(xq[m] + 4 * q));
          t[m][s % CH] = PAGEDSERVE_DPBUSD(t[m][s % CH], u, _mm512_mask_sub_epi8(a, neg, _mm512_setzero_si512(), a));
        }
      }
    }
    const int64_t blk = q0 * PER / XB, half = q0 * PER / 16;
    for (int m = 0; m < MR; ++m) {
      __m512i acc = CH == 2 ? _mm512_add_epi32(t[m][0], t[m][CH - 1]) : t[m][0];
      if constexpr (OFFSET != 0) {  // the codes' offset times the activation codes' sum, exact in int32
        const int32_t* is = x.isum.data() + (m0 + m) * K / 16 + half;
        acc = _mm512_sub_epi32(acc, _mm512_set1_epi32(OFFSET * (NS * PER == 16 ? is[0] : is[0] + is[1])));
      }
      fg[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_set1_ps(xs[m][blk]), fg[m]);
    }
  };
  // K-quants' sub-block values are small integers under one factor per super-block: a super-block's groups are
  // summed under their codes and the factor multiplies once (fs, fb), which halves the per-group work that made
  // them slower per weight than the formats with fp16 values.
  const bool coded = scale.d != nullptr, coded_bias = coded && bias.d != nullptr && bias.per_d == scale.per_d;
  const int64_t per = coded ? scale.per_d : 1;
  const float* xsum[MR];
  for (int m = 0; m < MR; ++m) xsum[m] = x.xsum.data() + (m0 + m) * G;
  for (int64_t g0 = 0; g0 < G; g0 += per) {
    __m512 fs[MR], fb[MR];
    if (coded)
      for (int m = 0; m < MR; ++m) fs[m] = fb[m] = _mm512_setzero_ps();
    for (int64_t g = g0; g < g0 + per; ++g) {
      for (int m = 0; m < MR; ++m) fg[m] = _mm512_setzero_ps();
      if (spg < STEPS)
        run(std::integral_constant<int, STEPS / 2>{}, g * spg);
      else
        for (int64_t q = g * spg; q < (g + 1) * spg; q += STEPS) run(std::integral_constant<int, STEPS>{}, q);
      if (coded) {
        const __m512 sw = scale.codes(p, g);
        for (int m = 0; m < MR; ++m) fs[m] = _mm512_fmadd_ps(fg[m], sw, fs[m]);
      } else {
        const __m512 sw = scale.load(p, g);
        for (int m = 0; m < MR; ++m) f[m] = _mm512_fmadd_ps(fg[m], sw, f[m]);
      }
      if (coded_bias) {
        const __m512 bw = bias.codes(p, g);
        for (int m = 0; m < MR; ++m) fb[m] = _mm512_fmadd_ps(bw, _mm512_set1_ps(xsum[m][g]), fb[m]);
      } else if (bias.v) {
        const __m512 bw = bias.load(p, g);
        for (int m = 0; m < MR; ++m) f[m] = _mm512_fmadd_ps(bw, _mm512_set1_ps(xsum[m][g]), f[m]);
      }
    }
    if (coded) {
      const __m512 ds = scale.factors(p, g0);
      for (int m = 0; m < MR; ++m) f[m] = _mm512_fmadd_ps(fs[m], ds, f[m]);
    }
    if (coded_bias) {
      const __m512 db = bias.factors(p, g0);
      for (int m = 0; m < MR; ++m) f[m] = _mm512_fmadd_ps(fb[m], db, f[m]);
    }
  }
  for (int m = 0; m < MR; ++m) _mm512_storeu_ps(y[m], f[m]);
}
#elif defined(__AVX2__)
// AVX2: the panel's two halves (rows 0-7 in bytes 0-31 of each 64, rows 8-15 in 32-63) in 256-bit vectors; int8
// as |c| x (x with c's sign), as the non-VNNI AVX-512 form
template <int BITS, int MR>
inline void panel_dot(const uint8_t* c, const GroupValues& scale, const GroupValues& bias, int64_t p,
                      const Int8Blocks& x, int64_t m0, int64_t K, int64_t G, float (*y)[PANEL]) {
  constexpr int PER = BITS == 8 ? 4 : 8, STEPS = XB / PER;
  const int64_t spg = K / G / PER, run = std::min<int64_t>(spg, STEPS);  // steps per group; per accumulation
  const __m256i nib = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1), top = _mm256_set1_epi8(0x30);
  for (int h = 0; h < 2; ++h) {
    __m256 f[MR];
    for (int m = 0; m < MR; ++m) f[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      __m256 fg[MR];
      for (int m = 0; m < MR; ++m) fg[m] = _mm256_setzero_ps();
      for (int64_t q0 = g * spg; q0 < (g + 1) * spg; q0 += run) {
        __m256i t[MR];
        for (int m = 0; m < MR; ++m) t[m] = _mm256_setzero_si256();
        for (int64_t q = q0; q < q0 + run; ++q) {
          if (h == 0) prefetch_step<BITS>(c, q);  // the second half's pass finds the panel in cache
          const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + step_offset<BITS>(q) + 32 * h));
          if constexpr (BITS != 8) {
            __m256i lo = _mm256_and_si256(b, nib), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), nib);
            if constexpr (BITS == 6) {
              const __m256i pc = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + pieces_offset(q) + 32 * h));
              if (q % 2 == 0) {
                lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(pc, 4), top));
                hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(pc, 2), top));
              } else {
                lo = _mm256_or_si256(lo, _mm256_and_si256(pc, top));
                hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_srli_epi16(pc, 2), top));
              }
            }
            for (int m = 0; m < MR; ++m) {
              const int8_t* a = x.q.data() + (m0 + m) * K + 8 * q;
              const __m256i pr = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(load4(a))),
                                                  _mm256_maddubs_epi16(hi, _mm256_set1_epi32(load4(a + 4))));
              t[m] = _mm256_add_epi32(t[m], _mm256_madd_epi16(pr, ones));  // 4 * 15 * 127 per int16: no saturation
            }
          } else {
            const __m256i u = _mm256_sign_epi8(b, b);
            for (int m = 0; m < MR; ++m) {
              const __m256i a = _mm256_set1_epi32(load4(x.q.data() + (m0 + m) * K + 4 * q));
              t[m] = _mm256_add_epi32(t[m], _mm256_madd_epi16(_mm256_maddubs_epi16(u, _mm256_sign_epi8(a, b)), ones));
            }
          }
        }
        const int64_t blk = q0 * PER / XB;
        for (int m = 0; m < MR; ++m)
          fg[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t[m]), _mm256_set1_ps(x.scale[(m0 + m) * K / XB + blk]), fg[m]);
      }
      float sw[8], bw[8];
      for (int r = 0; r < 8; ++r) {
        sw[r] = scale.value(p, g, 8 * h + r);
        bw[r] = (bias.v ? bias.value(p, g, 8 * h + r) : 0.f) - (BITS == 6 ? 32.f * sw[r] : 0.f);
      }
      for (int m = 0; m < MR; ++m)
        f[m] = _mm256_fmadd_ps(fg[m], _mm256_loadu_ps(sw),
                               _mm256_fmadd_ps(_mm256_loadu_ps(bw), _mm256_set1_ps(x.xsum[(m0 + m) * G + g]), f[m]));
    }
    for (int m = 0; m < MR; ++m) _mm256_storeu_ps(y[m] + 8 * h, f[m]);
  }
}
#else
template <int BITS, int MR>
inline void panel_dot(const uint8_t* c, const GroupValues& scale, const GroupValues& bias, int64_t p,
                      const Int8Blocks& x, int64_t m0, int64_t K, int64_t G, float (*y)[PANEL]) {
  constexpr int PER = BITS == 8 ? 4 : 8, STEPS = XB / PER;
  const int64_t spg = K / G / PER, run = std::min<int64_t>(spg, STEPS);
  for (int m = 0; m < MR; ++m) {
    const int8_t* xq = x.q.data() + (m0 + m) * K;
    for (int64_t r = 0; r < PANEL; ++r) {
      float s = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        float sg = 0.f;
        for (int64_t q0 = g * spg; q0 < (g + 1) * spg; q0 += run) {
          int32_t t = 0;
          for (int64_t q = q0; q < q0 + run; ++q)
            for (int j = 0; j < PER; ++j) t += panel_code<BITS>(c, q, r, j) * xq[PER * q + j];
          sg += static_cast<float>(t) * x.scale[(m0 + m) * K / XB + q0 * PER / XB];
        }
        const float sw = scale.value(p, g, r);
        const float b = (bias.v ? bias.value(p, g, r) : 0.f) - (BITS == 6 ? 32.f * sw : 0.f);
        s += sg * sw + b * x.xsum[(m0 + m) * G + g];
      }
      y[m][r] = s;
    }
  }
}
#endif

#ifdef PAGEDSERVE_AVX512
constexpr int64_t MR_MAX = 8;  // activation rows per pass over a panel
#else
constexpr int64_t MR_MAX = 4;  // 16 AVX2 registers
#endif

template <int BITS, typename T>
void panel_linear_impl(const T* x, int64_t M, int64_t K, const uint8_t* codes, const GroupValues& scale,
                       const GroupValues& bias, int64_t N, int64_t G, T* out) {
  const Int8Blocks xq = quantize_blocks(x, M, K, G);
  at::parallel_for(0, N / PANEL, 1, [&](int64_t p0, int64_t p1) {
    float y[MR_MAX][PANEL];
    for (int64_t p = p0; p < p1; ++p) {
      const uint8_t* c = codes + p * PANEL * K * BITS / 8;
      for (int64_t m = 0, mr; m < M; m += mr) {  // the panel's codes reused from L1 by up to MR_MAX activation rows
        mr = std::min<int64_t>(M - m, M - m >= MR_MAX ? MR_MAX : 4);
        switch (mr) {
          case 8: panel_dot<BITS, 8>(c, scale, bias, p, xq, m, K, G, y); break;
          case 4: panel_dot<BITS, 4>(c, scale, bias, p, xq, m, K, G, y); break;
          case 3: panel_dot<BITS, 3>(c, scale, bias, p, xq, m, K, G, y); break;
          case 2: panel_dot<BITS, 2>(c, scale, bias, p, xq, m, K, G, y); break;
          default: panel_dot<BITS, 1>(c, scale, bias, p, xq, m, K, G, y); break;
        }
        for (int64_t i = 0; i < mr; ++i)
          for (int64_t r = 0; r < PANEL; ++r) out[(m + i) * N + p * PANEL + r] = narrow<T>(y[i][r]);
      }
    }
  });
}

template <int BITS>
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                        const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& scale_d,
                        const std::optional<at::Tensor>& bias_d) {
  const Panels a(x, codes, scale, bias, scale_d, bias_d, BITS,
                 BITS == 4 ? "int4_linear" : BITS == 6 ? "int6_linear" : "int8_linear");
  auto out = at::empty({x.size(0), a.N}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "panel_linear", [&] {
    panel_linear_impl<BITS, scalar_t>(a.x.data_ptr<scalar_t>(), x.size(0), a.K, a.c(), a.scales(), a.biases(), a.N,
                                      a.G, out.data_ptr<scalar_t>());
  });
  return out;
}

// ---- many rows: dequantize a tile of output features into a buffer, GEMM, next tile ---------------------
// A tile (TILE_KIB) bounds the buffer for large matrices (an LM head); most projections fit in one.

// rows n0..n1 (multiples of 16) of the panels, dequantized into buf [n1 - n0, K]
template <int BITS, typename T>
void dequant_rows(const uint8_t* codes, const GroupValues& scale, const GroupValues& bias, int64_t K, int64_t G,
                  int64_t n0, int64_t n1, T* buf) {
  at::parallel_for(n0 / PANEL, n1 / PANEL, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> sc(G), bi(G);
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t r = 0; r < PANEL; ++r) {
        row_values(scale, bias, G, p, r, sc.data(), bi.data());
        dequant_row<BITS>(codes, p, r, sc.data(), bi.data(), K, K / G, buf + (p * PANEL + r - n0) * K);
      }
  });
}

// out = x @ W^T, one tile of W's rows at a time: each dequantized tile's product goes straight into its columns of
// out (a strided destination oneDNN writes in place). The earlier transposed form (out^T = tile @ x^T, then a
// transpose back) was as fast at M = 64, but its transpose made prefill-sized M far slower than a bf16 GEMM
// (figures: docs/performance.md).
template <int BITS>
at::Tensor panel_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                      const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& scale_d,
                      const std::optional<at::Tensor>& bias_d) {
  const Panels a(x, codes, scale, bias, scale_d, bias_d, BITS,
                 BITS == 4 ? "int4_gemm" : BITS == 6 ? "int6_gemm" : "int8_gemm");
  const int64_t K = a.K, N = a.N;
  const int64_t TN = std::max<int64_t>(64, ((TILE_KIB << 10) / (K * x.element_size())) / PANEL * PANEL);
  auto out = at::empty({x.size(0), N}, x.options());
  auto tile = at::empty({std::min(TN, N), K}, x.options());
  for (int64_t n0 = 0; n0 < N; n0 += TN) {
    const int64_t n1 = std::min(N, n0 + TN);
    auto t = tile.narrow(0, 0, n1 - n0);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "panel_gemm", [&] {
      dequant_rows<BITS, scalar_t>(a.c(), a.scales(), a.biases(), K, a.G, n0, n1, t.data_ptr<scalar_t>());
    });
    auto dst = out.narrow(1, n0, n1 - n0);
    at::mm_out(dst, a.x, t.t());
  }
  return out;
}


}  // namespace

namespace pagedserve {
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                       const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& scale_d,
                       const std::optional<at::Tensor>& bias_d) {
  return panel_linear<8>(x, codes, scale, bias, scale_d, bias_d);
}
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                       const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& scale_d,
                       const std::optional<at::Tensor>& bias_d) {
  return panel_linear<4>(x, codes, scale, bias, scale_d, bias_d);
}
at::Tensor int6_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                       const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& scale_d,
                       const std::optional<at::Tensor>& bias_d) {
  return panel_linear<6>(x, codes, scale, bias, scale_d, bias_d);
}
}  // namespace pagedserve

namespace {
at::Tensor int8_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                     const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& scale_d,
                     const std::optional<at::Tensor>& bias_d) {
  return panel_gemm<8>(x, codes, scale, bias, scale_d, bias_d);
}
at::Tensor int4_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                     const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& scale_d,
                     const std::optional<at::Tensor>& bias_d) {
  return panel_gemm<4>(x, codes, scale, bias, scale_d, bias_d);
}
at::Tensor int6_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                     const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& scale_d,
                     const std::optional<at::Tensor>& bias_d) {
  return panel_gemm<6>(x, codes, scale, bias, scale_d, bias_d);
}
}  // namespace

// Absent optional operands may also be empty tensors (the fused decode layer's operand lists hold no None).
#define PAGEDSERVE_PANEL_SCHEMA \
  "(Tensor x, Tensor codes, Tensor scale, Tensor? bias=None, Tensor? scale_d=None, Tensor? bias_d=None) -> Tensor"
TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("int8_linear" PAGEDSERVE_PANEL_SCHEMA);
  m.def("int4_linear" PAGEDSERVE_PANEL_SCHEMA);
  m.def("int8_gemm" PAGEDSERVE_PANEL_SCHEMA);
  m.def("int4_gemm" PAGEDSERVE_PANEL_SCHEMA);
  m.def("int6_linear" PAGEDSERVE_PANEL_SCHEMA);
  m.def("int6_gemm" PAGEDSERVE_PANEL_SCHEMA);
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("int8_linear", &pagedserve::int8_linear);
  m.impl("int4_linear", &pagedserve::int4_linear);
  m.impl("int8_gemm", &int8_gemm);
  m.impl("int4_gemm", &int4_gemm);
  m.impl("int6_linear", &pagedserve::int6_linear);
  m.impl("int6_gemm", &int6_gemm);
}
