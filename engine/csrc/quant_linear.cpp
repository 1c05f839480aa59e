// y = x W^T against int8 or int4 codes with a scale (and a bias) per group of K: a GEMV for a few rows of x, a
// tiled GEMM for many. The groups cover our own formats (a scale per row or per group) and llama.cpp's blocks as
// the GGUF file holds them (Q8_0, Q4_0/1, Q5_0/1, and the K-quants' sub-block scales under a super-block factor).
//
// At decode a step reads every weight once, so the cost is the weight bytes: the GEMVs stream the weights once,
// multiplying their integer codes by int8 codes of the activations, where torch's `_weight_int8pack_mm` stays
// well below a bf16 GEMV's bandwidth (and slower still with fp32 activations; figures in docs/performance.md).
// Both formats share one layout and one kernel (below); beyond the dispatch table's quant_gemv_max_rows the
// caller dequantizes tiles and runs a GEMM.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
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
#if defined(PAGEDSERVE_AVX512) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#define PAGEDSERVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

// dequantized tile for the many-row GEMM: one GEMM call per tile, and each GEMM call has a fixed cost, so a tile
// holds most projections whole (smaller tiles were slower at every M measured; figures in docs/performance.md)
constexpr int64_t TILE_KIB = 16384;

using pagedserve::narrow;
using pagedserve::widen;

// ---- layout ----------------------------------------------------------------------------------------
// w[n, k] = c * scale[n, g] + bias[n, g] for the code c of k in group g = k / group (a multiple of 32, or 16:
// Q6_K's sub-blocks); int8 codes are signed and may have no bias, int4 codes are 0..15 and always have one. So
//   y = sum_g scale_g * sum_{k in g} c_k x_k  +  sum_g bias_g * sum_{k in g} x_k.
// Rows come in panels of 16 (engine/quant/formats.py to_panels / int8_to_panels). Per step of K, a panel holds
// 64 bytes, row r's 4 bytes at 4r: int4 steps are 8 codes (byte i: code 8q + i in its low nibble, 8q + 4 + i
// in its high one), int8 steps 4 codes (byte i: code 4q + i). Scale and bias are [N / 16, G, 16]. So one 64-byte
// load feeds 16 rows at once, each int32 lane one row: no horizontal sums, no per-row setup, and a group's 16
// scales are one load. A scale or bias is stored as fp16/fp32, or as 8-bit codes times an fp16 factor per
// super-block of groups (GroupValues): llama.cpp's K-quants keep 6- or 8-bit sub-block scales under one fp16 d,
// and their product is exact in fp32, where an fp16 copy of it would round. Row by row (the earlier layouts) the GEMVs were compute-bound, below the memory's speed,
// and int8 on int16 activation codes slower than int4 per weight byte, the more so at several rows
// (figures: docs/performance.md).
// 6-bit codes (0..63: Q6_K, Q5_x, and fusions mixing them with Q4_K) keep the int4 steps for their low 4 bits and
// add their high 2 bits in a plane beside them: per 32 codes of a panel, the 4 nibble steps (256 bytes) and then
// 2 x 64 bytes of 2-bit pieces, byte 4r + i of piece h holding bits 4-5 of row r's codes 16h + i, 16h + 4 + i,
// 16h + 8 + i, 16h + 12 + i in its bits 0-1, 2-3, 4-5, 6-7 (a step's two nibble halves, then the next step's).
// They hold c + 32 for codes c in -32..31 (the 32 comes off each block's integer sum, as int8's 128 does), so a
// 6-bit weight costs 6 bits, as in the file, and the GEMV does the int4 work plus two shifts and masks.
// The activations are int8 codes with a scale per 32 values (llama.cpp's Q8_0: relative error <= 1/254 of the
// block's absmax, ~0.5 % of a product), so one u8 x s8 vpdpbusd does 64 multiply-adds. int4 codes are u8 as
// they are; int8 codes go in as c + 128, and 128 times the block's sum of activation codes comes off the block's
// int32 sum, exactly. int32 lanes are exact: a 32-value block adds at most 32 * 255 * 127.
constexpr int64_t PANEL = 16;  // rows per panel
constexpr int64_t XB = 32;  // activation values per scale

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

// A panel's per-group values (scales or biases), [N / 16, G, 16]: fp16 or fp32 as they are, or int8/uint8 codes
// times an fp16 factor [N / 16, G / per_d, 16] shared by per_d groups (a K-quant's super-block).
struct GroupValues {
  const void* v = nullptr;  // null: all zero (no bias)
  at::ScalarType type = at::kFloat;
  const at::Half* d = nullptr;
  int64_t G = 1, per_d = 1;

  float value(int64_t p, int64_t g, int64_t r) const {
    const int64_t i = (p * G + g) * PANEL + r;
    switch (type) {
      case at::kFloat: return static_cast<const float*>(v)[i];
      case at::kHalf: return widen(static_cast<const at::Half*>(v)[i]);
      case at::kByte: return static_cast<float>(static_cast<const uint8_t*>(v)[i]) * factor(p, g, r);
      default: return static_cast<float>(static_cast<const int8_t*>(v)[i]) * factor(p, g, r);
    }
  }
  float factor(int64_t p, int64_t g, int64_t r) const { return widen(d[(p * (G / per_d) + g / per_d) * PANEL + r]); }
#ifdef PAGEDSERVE_AVX512
  // the 16 rows' values of group g in panel p
  __m512 load(int64_t p, int64_t g) const {
    const int64_t i = (p * G + g) * PANEL;
    switch (type) {
      case at::kFloat: return _mm512_loadu_ps(static_cast<const float*>(v) + i);
      case at::kHalf:
        return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const at::Half*>(v) + i)));
      default: return _mm512_mul_ps(codes(p, g), factors(p, g));
    }
  }
  // 8-bit values only: the 16 rows' codes of group g, and the factor of the super-block holding it
  __m512 codes(int64_t p, int64_t g) const {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(v) + (p * G + g) * PANEL));
    return _mm512_cvtepi32_ps(type == at::kByte ? _mm512_cvtepu8_epi32(b) : _mm512_cvtepi8_epi32(b));
  }
  __m512 factors(int64_t p, int64_t g) const {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + (p * (G / per_d) + g / per_d) * PANEL)));
  }
#endif
};

// where a step q's codes sit: 64 bytes of nibbles (int4, int6) or int8 codes, and for int6 the 64 bytes of
// 2-bit pieces that step shares with its neighbour (BLOCK6 bytes per 32 codes of a panel)
constexpr int64_t BLOCK6 = 384;
template <int BITS>
inline int64_t step_offset(int64_t q) {
  return BITS == 6 ? (q / 4) * BLOCK6 + (q % 4) * 64 : q * 64;
}
inline int64_t pieces_offset(int64_t q) { return (q / 4) * BLOCK6 + 256 + ((q % 4) / 2) * 64; }

// A GEMV's time is the time to stream its weights in, and on its own one core keeps too few cache-line reads in
// flight to reach the memory's speed: each step asks for the line PREFETCH_AHEAD bytes further on in the panels
// (contiguous, so the distance runs on into the next panel). Distances from 3 to 8 KiB measured alike, 512 bytes
// and 16 KiB less (benchmarks/kernels/bench_gguf_gemv.py; figures in docs/performance.md).
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

// A panel op's operands, checked and contiguous: codes (int4: uint8 [N / 16, 8 K]; int8: int8 [N / 16, 16 K]),
// scale [N / 16, G, 16] and bias (int4 always; int8 optional) shaped as the scale, each fp16/fp32 or 8-bit codes
// with an fp16 factor [N / 16, G / per_d, 16] (scale_d, bias_d). Groups: 16 or a multiple of 32.
struct Panels {
  at::Tensor x, codes, scale, bias, scale_d, bias_d;  // undefined where absent
  int64_t K, N, G;

  static bool given(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined() && t->numel() > 0; }

  void check_values(const at::Tensor& v, const std::optional<at::Tensor>& d, const char* what, const char* op) const {
    const auto t = v.scalar_type();
    TORCH_CHECK((t == at::kHalf || t == at::kFloat || t == at::kByte || t == at::kChar) && v.dim() == 3 &&
                    v.size(0) == codes.size(0) && v.size(1) == G && v.size(2) == PANEL,
                op, ": ", what, " [N / 16, G, 16] fp16, fp32, uint8 or int8");
    const bool coded = t == at::kByte || t == at::kChar;
    TORCH_CHECK(coded == given(d), op, ": 8-bit ", what, " codes need their fp16 factor, and only they take one");
    if (coded)
      TORCH_CHECK(d->scalar_type() == at::kHalf && d->dim() == 3 && d->size(0) == v.size(0) && d->size(1) > 0 &&
                      G % d->size(1) == 0 && d->size(2) == PANEL,
                  op, ": ", what, " factor fp16 [N / 16, G / per, 16]");
  }

  Panels(const at::Tensor& x_, const at::Tensor& codes_, const at::Tensor& scale_,
         const std::optional<at::Tensor>& bias_, const std::optional<at::Tensor>& scale_d_,
         const std::optional<at::Tensor>& bias_d_, int bits, const char* op) {
    const auto code_type = bits == 8 ? at::kChar : at::kByte;
    TORCH_CHECK(x_.dim() == 2 && codes_.dim() == 2 && codes_.scalar_type() == code_type &&
                    codes_.size(1) == PANEL * bits / 8 * x_.size(1) && (bits != 6 || x_.size(1) % XB == 0),
                op, ": x [M, K], codes ", bits == 4 ? "uint8 [N / 16, 8 K]" : bits == 6 ? "uint8 [N / 16, 12 K]" :
                "int8 [N / 16, 16 K]", " (16-row panels)");
    x = x_.contiguous(), codes = codes_.contiguous();
    K = x.size(1), N = codes.size(0) * PANEL;
    TORCH_CHECK(scale_.dim() == 3 && scale_.size(1) > 0 && K % scale_.size(1) == 0, op, ": scale [N / 16, G, 16]");
    G = scale_.size(1);
    const int64_t group = K / G;
    TORCH_CHECK(group == 16 || group % XB == 0, op, ": groups of 16 or a multiple of 32, got ", group);
    check_values(scale_, scale_d_, "scale", op);
    scale = scale_.contiguous();
    if (given(scale_d_)) scale_d = scale_d_->contiguous();
    TORCH_CHECK(given(bias_) || bits != 4, op, ": int4 takes a bias");
    if (given(bias_)) {
      check_values(*bias_, bias_d_, "bias", op);
      bias = bias_->contiguous();
      if (given(bias_d_)) bias_d = bias_d_->contiguous();
    }
  }
  const uint8_t* c() const { return static_cast<const uint8_t*>(codes.data_ptr()); }
  GroupValues values(const at::Tensor& v, const at::Tensor& d) const {
    GroupValues r;
    if (!v.defined()) return r;
    r.v = v.data_ptr(), r.type = v.scalar_type(), r.G = G;
    if (d.defined()) r.d = d.data_ptr<at::Half>(), r.per_d = G / d.size(1);
    return r;
  }
  GroupValues scales() const { return values(scale, scale_d); }
  GroupValues biases() const { return values(bias, bias_d); }
};

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

// one row r of a panel back to K values: 16 of its 4-byte pieces (64 int8 codes, or 128 int4 ones whose nibbles
// are then put in k order) per gather, widened 16 at a time and scaled by their group's scale (plus bias: int4)
template <int BITS, typename T>
inline void dequant_panel_row(const uint8_t* c, int64_t r, const float* sc, const float* bi, int64_t K, int64_t group,
                              T* o) {
  constexpr int PER = BITS == 4 ? 8 : 4;  // codes per 64-byte step
  const int64_t steps = K / PER;
  const __m512i offs = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32(64));
  const __m512i nib = _mm512_set1_epi8(15);
  // unpacklo/hi_epi32(lo, hi) leave q-steps (0 1 4 5 8 9 12 13) and (2 3 6 7 10 11 14 15) in their 64-bit lanes
  const __m512i first = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0);
  const __m512i second = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
  for (int64_t q0 = 0; q0 < steps; q0 += 16) {
    const __mmask16 mask = q0 + 16 <= steps ? 0xFFFF : static_cast<__mmask16>((1u << (steps - q0)) - 1);
    const __m512i d = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mask, offs, c + q0 * 64 + 4 * r, 1);
    alignas(64) uint8_t bytes[128];
    if constexpr (BITS == 4) {
      const __m512i lo = _mm512_and_si512(d, nib), hi = _mm512_and_si512(_mm512_srli_epi32(d, 4), nib);
      const __m512i a = _mm512_unpacklo_epi32(lo, hi), b = _mm512_unpackhi_epi32(lo, hi);
      _mm512_store_si512(bytes, _mm512_permutex2var_epi64(a, first, b));
      _mm512_store_si512(bytes + 64, _mm512_permutex2var_epi64(a, second, b));
    } else {
      _mm512_store_si512(bytes, d);
    }
    for (int64_t j = 0; j < PER && PER * q0 + 16 * j < K; j += 2) {  // 32 codes, each 16 within one group
      __m512 f[2];
      for (int h = 0; h < 2; ++h) {
        const int64_t g = (PER * q0 + 16 * (j + h)) / group;
        const __m128i v = _mm_load_si128(reinterpret_cast<const __m128i*>(bytes + 16 * (j + h)));
        f[h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(BITS == 4 ? _mm512_cvtepu8_epi32(v) : _mm512_cvtepi8_epi32(v)),
                               _mm512_set1_ps(sc[g]), _mm512_set1_ps(bi[g]));
      }
      store32(o + PER * q0 + 16 * j, f[0], f[1]);
    }
  }
}
#endif

// row r of panel p back to K values in o, given its groups' scales sc and biases bi
template <int BITS, typename T>
void dequant_row(const uint8_t* codes, int64_t p, int64_t r, const float* sc, const float* bi, int64_t K,
                 int64_t group, T* o) {
  constexpr int PER = BITS == 8 ? 4 : 8;
  const uint8_t* c = codes + p * PANEL * K * BITS / 8;
  if constexpr (BITS == 6) {  // per 32 codes: the 4 nibble steps and their 2 pieces, then scale and bias
    uint8_t code[XB];
    for (int64_t b = 0; b < K / XB; ++b) {
      const uint8_t* blk = c + b * BLOCK6 + 4 * r;
      for (int s = 0; s < 4; ++s)
        for (int i = 0; i < 4; ++i) {
          const uint8_t byte = blk[64 * s + i], piece = blk[256 + 64 * (s / 2) + i] >> (4 * (s % 2));
          code[8 * s + i] = (byte & 15) | ((piece & 3) << 4);
          code[8 * s + 4 + i] = (byte >> 4) | (((piece >> 2) & 3) << 4);
        }
      for (int64_t i = 0; i < XB; ++i) {
        const int64_t g = (b * XB + i) / group;
        o[b * XB + i] = narrow<T>(static_cast<float>(code[i] - 32) * sc[g] + bi[g]);
      }
    }
    return;
  }
#ifdef PAGEDSERVE_AVX512
  if constexpr (!std::is_same_v<T, double>) {
    dequant_panel_row<BITS>(c, r, sc, bi, K, group, o);
    return;
  }
#endif
  for (int64_t q = 0; q < K / PER; ++q)
    for (int64_t i = 0; i < 4; ++i) {
      const uint8_t byte = c[q * 64 + 4 * r + i];
      const int64_t g = PER * q / group;
      if constexpr (BITS == 4) {
        o[8 * q + i] = narrow<T>(static_cast<float>(byte & 15) * sc[g] + bi[g]);
        o[8 * q + 4 + i] = narrow<T>(static_cast<float>(byte >> 4) * sc[g] + bi[g]);
      } else {
        o[4 * q + i] = narrow<T>(static_cast<float>(static_cast<int8_t>(byte)) * sc[g] + bi[g]);
      }
    }
}

// row r of panel p's group scales and biases, in fp32
inline void row_values(const GroupValues& scale, const GroupValues& bias, int64_t G, int64_t p, int64_t r, float* sc,
                       float* bi) {
  for (int64_t g = 0; g < G; ++g) {
    sc[g] = scale.value(p, g, r);
    bi[g] = bias.v ? bias.value(p, g, r) : 0.f;
  }
}

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


// ---- many rows on AMX: int8 activations times int8 weights ------------------------------------------------
// AMX multiplies u8 by s8 at twice its bf16 rate, so a prefill-sized GEMM runs on int8 codes of both sides: each
// activation row gets one scale (its absmax / 127; u8 codes c + 128, the 128 taken off through the weights' code
// sums), and each weight row one scale, its codes re-quantized from the group values per call (no resident int8
// copy: it would double a 4-bit model's memory). One scale per row alone lost the bundled model's perplexity
// visibly, as a few channels carry most of the range; two things bring it near the reference (docs/performance.md):
// - as SmoothQuant does, channel k of x is divided by f_k = sqrt(max_m |x_mk| / max_n |w_nk|) and column k of W
//   multiplied by it (the product is unchanged), which evens the ranges of both sides; the activations' maxima
//   are this call's, the weights' taken once at load (panel_column_absmax);
// - the 64 channels with the largest max |x| max |w| leave that part and form a block of their own, with scales
//   of their own, at the end of each row: one more tile step, its sums scaled apart and added.
// An int8 panel step is exactly an AMX B tile's row (16 output rows of 4 consecutive codes), so a re-quantized
// panel is its K / 64 tile steps of 1 KiB laid end to end, then the outlier block's.
#ifdef PAGEDSERVE_AMX
constexpr int64_t AMX_K = 64;  // codes per tile row, and the most outlier channels
constexpr int64_t AMX_KB = 1024;  // codes of K per pass: 32 rows' worth of activations stay in L1
constexpr int64_t AMX_BLOCK_KIB = 1024;  // a thread's re-quantized weight block: L2-sized, reused by every row block

bool amx_permitted() {
  static const bool ok = [] {  // Linux hands out the tile state only on request (once per process)
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tiles 0-3: a 32 x 32 int32 block of the output; 4-5: 2 x 16 activation rows; 6-7: 2 panels of weights
inline void configure_tiles() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) c.colsb[t] = 64, c.rows[t] = 16;
  _tile_loadconfig(&c);
}

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

// widen.h's silu_times on 16 lanes, step for step (the same values to the bit)
template <typename T>
inline __m512 silu_times16(__m512 g, __m512 u) {
  const __m512 a = round_to<T>(g), x = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(a));
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
  return _mm512_mul_ps(round_to<T>(_mm512_mul_ps(a, sig)), round_to<T>(u));
}

// rows of x -> u8 codes (c + 128, rows M..Mp of zeros) at a row stride of lda, and a scale per row
template <typename T>
void quantize_rows_u8(const T* x, int64_t M, int64_t Mp, int64_t K, int64_t lda, const float* inv_f, uint8_t* q,
                      float* scale) {
  at::parallel_for(0, Mp, 16, [&](int64_t m0, int64_t m1) {
    std::vector<float> row(K);
    for (int64_t m = m0; m < m1; ++m) {
      uint8_t* o = q + m * lda;
      if (m >= M) {
        std::memset(o, 128, K);
        continue;
      }
      __m512 amax = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; k += 16) {
        const __m512 v = _mm512_mul_ps(load16f(x + m * K + k), _mm512_loadu_ps(inv_f + k));
        _mm512_storeu_ps(row.data() + k, v);
        amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
      }
      const float a = _mm512_reduce_max_ps(amax);
      scale[m] = a / 127.f;
      const __m512 inv = _mm512_set1_ps(a > 0.f ? 127.f / a : 0.f);
      const __m512i off = _mm512_set1_epi32(128);
      for (int64_t k = 0; k < K; k += 16) {
        const __m512i c = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(row.data() + k), inv)), off);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o + k), _mm512_cvtusepi32_epi8(c));
      }
    }
  });
}

// the outlier channels of each row as they are -> u8 codes in the row's last AMX_K bytes (the unused ones 128)
// with a scale of their own
template <typename T>
void quantize_outliers(const T* x, int64_t M, int64_t Mp, int64_t K, int64_t lda, const int64_t* outl, int64_t n_out,
                       uint8_t* q, float* scale) {
  for (int64_t m = 0; m < Mp; ++m) {
    uint8_t* o = q + m * lda + K;
    std::memset(o, 128, AMX_K);
    if (m >= M) {
      scale[m] = 0.f;
      continue;
    }
    float v[AMX_K], a = 0.f;
    for (int64_t i = 0; i < n_out; ++i) a = std::max(a, std::abs(v[i] = widen(x[m * K + outl[i]])));
    scale[m] = a / 127.f;
    const float inv = a > 0.f ? 127.f / a : 0.f;
    for (int64_t i = 0; i < n_out; ++i) o[i] = static_cast<uint8_t>(std::nearbyint(v[i] * inv) + 128);
  }
}

// max_m |x_mk| per column k
template <typename T>
std::vector<float> column_absmax(const T* x, int64_t M, int64_t K) {
  const int64_t threads = at::get_num_threads();
  std::vector<float> part(threads * K, 0.f);
  at::parallel_for(0, M, 64, [&](int64_t m0, int64_t m1) {
    float* mx = part.data() + at::get_thread_num() * K;
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t k = 0; k < K; k += 16)  // K: a multiple of 64
        _mm512_storeu_ps(mx + k, _mm512_max_ps(_mm512_loadu_ps(mx + k), _mm512_abs_ps(load16f(x + m * K + k))));
  });
  for (int64_t t = 1; t < threads; ++t)
    for (int64_t k = 0; k < K; ++k) part[k] = std::max(part[k], part[t * K + k]);
  part.resize(K);
  return part;
}

// 4 int32 lanes' low bytes -> one lane of 4 bytes (a, b, c, d in bytes 0-3): an int8 panel step
inline __m512i pack_bytes(__m512i a, __m512i b, __m512i c, __m512i d) {
  const __m512i m = _mm512_set1_epi32(0xFF);
  return _mm512_or_si512(_mm512_or_si512(_mm512_and_si512(a, m), _mm512_slli_epi32(_mm512_and_si512(b, m), 8)),
                         _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(c, m), 16), _mm512_slli_epi32(d, 24)));
}

// the 16 rows' weights of step q's codes (PER of them), times the smoothing factors: lane r is row r
template <int BITS>
inline void step_values(const uint8_t* c, int64_t q, __m512 sc, __m512 bi, const float* f, __m512* v) {
  constexpr int PER = BITS == 4 ? 8 : 4;
  const __m512i d = _mm512_loadu_si512(c + q * 64);
  for (int i = 0; i < PER; ++i) {
    __m512i code;
    if constexpr (BITS == 4)  // byte i: code i in its low nibble, code 4 + i in its high one
      code = _mm512_and_si512(_mm512_srl_epi32(d, _mm_cvtsi32_si128(i < 4 ? 8 * i : 8 * (i - 4) + 4)),
                              _mm512_set1_epi32(15));
    else  // byte i: code i, signed
      code = _mm512_sra_epi32(_mm512_sll_epi32(d, _mm_cvtsi32_si128(24 - 8 * i)), _mm_cvtsi32_si128(24));
    v[i] = _mm512_mul_ps(_mm512_fmadd_ps(_mm512_cvtepi32_ps(code), sc, bi), _mm512_set1_ps(f[PER * q + i]));
  }
}

// the outlier block of a panel: the 16 rows' values of the outlier channels (col[o], o < n_out; the rest of the
// AMX_K codes zero) -> int8 codes with their own scale per row, as 16 int8 panel steps, and the rows' code sums
inline void quantize_outlier_block(const __m512* col, int64_t n_out, int8_t* o, float* wscale, int32_t* wsum) {
  __m512 amax = _mm512_setzero_ps();
  for (int64_t i = 0; i < n_out; ++i) amax = _mm512_max_ps(amax, _mm512_abs_ps(col[i]));
  _mm512_storeu_ps(wscale, _mm512_div_ps(amax, _mm512_set1_ps(127.f)));
  const __m512 inv = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(amax, _mm512_setzero_ps(), _CMP_GT_OQ),
                                         _mm512_set1_ps(127.f), amax);
  __m512i sum = _mm512_setzero_si512(), r[AMX_K];
  for (int64_t i = 0; i < AMX_K; ++i) {
    r[i] = i < n_out ? _mm512_cvtps_epi32(_mm512_mul_ps(col[i], inv)) : _mm512_setzero_si512();
    sum = _mm512_add_epi32(sum, r[i]);
  }
  for (int64_t q = 0; q < AMX_K / 4; ++q)
    _mm512_storeu_si512(o + q * 64, pack_bytes(r[4 * q], r[4 * q + 1], r[4 * q + 2], r[4 * q + 3]));
  _mm512_storeu_si512(wsum, sum);
}

// panels p0..p1 re-quantized to int8 [p1 - p0, KP / 4, 64] (int8 panels, KP = K + AMX_K): their K channels times
// the smoothing factors f (0 for the outlier channels) with a scale per row, then the outlier channels `outl` as
// they are with a scale of their own; scales and code sums [p1 - p0, 16] for each part (wscale, wsum; wscale2,
// wsum2). int4 and int8 panels go a step at a time, the 16 rows in the 16 lanes (two passes: the rows' maxima,
// then the codes); 6-bit ones row by row through dequant_row.
template <int BITS>
void requantize_panels(const uint8_t* codes, const GroupValues& scale, const GroupValues& bias, int64_t K, int64_t G,
                       const float* f, const int64_t* outl, int64_t n_out, int64_t p0, int64_t p1, int8_t* w8,
                       float* wscale, int32_t* wsum, float* wscale2, int32_t* wsum2) {
  const int64_t KP = K + AMX_K, group = K / G;
  __m512 col[AMX_K];
  if constexpr (BITS != 6) {
    constexpr int PER = BITS == 4 ? 8 : 4;
    const int64_t steps_per_group = group / PER;
    for (int64_t p = p0; p < p1; ++p) {
      const uint8_t* c = codes + p * PANEL * K * BITS / 8;
      int8_t* o = w8 + (p - p0) * PANEL * KP;
      const int64_t n = (p - p0) * PANEL;
      __m512 v[PER], amax = _mm512_setzero_ps();
      for (int64_t g = 0; g < G; ++g) {
        const __m512 sc = scale.load(p, g), bi = bias.v ? bias.load(p, g) : _mm512_setzero_ps();
        for (int64_t q = g * steps_per_group; q < (g + 1) * steps_per_group; ++q) {
          step_values<BITS>(c, q, sc, bi, f, v);
          for (int i = 0; i < PER; ++i) amax = _mm512_max_ps(amax, _mm512_abs_ps(v[i]));
        }
      }
      _mm512_storeu_ps(wscale + n, _mm512_div_ps(amax, _mm512_set1_ps(127.f)));
      const __mmask16 live = _mm512_cmp_ps_mask(amax, _mm512_setzero_ps(), _CMP_GT_OQ);
      const __m512 inv = _mm512_maskz_div_ps(live, _mm512_set1_ps(127.f), amax);
      __m512i sum = _mm512_setzero_si512();
      for (int64_t g = 0; g < G; ++g) {
        const __m512 sc = scale.load(p, g), bi = bias.v ? bias.load(p, g) : _mm512_setzero_ps();
        for (int64_t q = g * steps_per_group; q < (g + 1) * steps_per_group; ++q) {
          step_values<BITS>(c, q, sc, bi, f, v);
          __m512i r[PER];
          for (int i = 0; i < PER; ++i) {
            r[i] = _mm512_cvtps_epi32(_mm512_mul_ps(v[i], inv));
            sum = _mm512_add_epi32(sum, r[i]);
          }
          if constexpr (BITS == 4) {  // codes 8q..8q+3, then 8q+4..8q+7: int8 steps 2q and 2q + 1
            _mm512_storeu_si512(o + 2 * q * 64, pack_bytes(r[0], r[1], r[2], r[3]));
            _mm512_storeu_si512(o + (2 * q + 1) * 64, pack_bytes(r[4], r[5], r[6], r[7]));
          } else {
            _mm512_storeu_si512(o + q * 64, pack_bytes(r[0], r[1], r[2], r[3]));
          }
        }
      }
      _mm512_storeu_si512(wsum + n, sum);
      for (int64_t i = 0; i < n_out; ++i) {  // the outlier channels' values, 16 rows at a time
        const int64_t k = outl[i], g = k / group;
        const __m512i d = _mm512_loadu_si512(c + k / PER * 64);
        const int j = static_cast<int>(k % PER);
        const __m512i code =
            BITS == 4 ? _mm512_and_si512(_mm512_srl_epi32(d, _mm_cvtsi32_si128(j < 4 ? 8 * j : 8 * (j - 4) + 4)),
                                         _mm512_set1_epi32(15))
                      : _mm512_sra_epi32(_mm512_sll_epi32(d, _mm_cvtsi32_si128(24 - 8 * j)), _mm_cvtsi32_si128(24));
        col[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(code), scale.load(p, g),
                                 bias.v ? bias.load(p, g) : _mm512_setzero_ps());
      }
      quantize_outlier_block(col, n_out, o + PANEL * K, wscale2 + n, wsum2 + n);
    }
    return;
  }
  std::vector<float> sc(G), bi(G), row(K);
  alignas(64) float cols[AMX_K][PANEL];
  for (int64_t p = p0; p < p1; ++p) {
    for (int64_t r = 0; r < PANEL; ++r) {
      row_values(scale, bias, G, p, r, sc.data(), bi.data());
      dequant_row<BITS>(codes, p, r, sc.data(), bi.data(), K, group, row.data());
      for (int64_t i = 0; i < n_out; ++i) cols[i][r] = row[outl[i]];
      __m512 amax = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; k += 16) {
        const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(row.data() + k), _mm512_loadu_ps(f + k));
        _mm512_storeu_ps(row.data() + k, v);
        amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
      }
      const float a = _mm512_reduce_max_ps(amax);
      const int64_t n = (p - p0) * PANEL + r;
      wscale[n] = a / 127.f;
      const __m512 inv = _mm512_set1_ps(a > 0.f ? 127.f / a : 0.f);
      __m512i sum = _mm512_setzero_si512();
      int8_t* o = w8 + (p - p0) * PANEL * KP + 4 * r;
      for (int64_t k = 0; k < K; k += 16) {  // 16 codes: 4 steps of this row's 4 bytes
        const __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(row.data() + k), inv));
        sum = _mm512_add_epi32(sum, c);
        alignas(16) int32_t four[4];
        _mm_store_si128(reinterpret_cast<__m128i*>(four), _mm512_cvtsepi32_epi8(c));
        for (int j = 0; j < 4; ++j) std::memcpy(o + (k / 4 + j) * 64, four + j, 4);
      }
      wsum[n] = _mm512_reduce_add_epi32(sum);
    }
    for (int64_t i = 0; i < n_out; ++i) col[i] = _mm512_load_ps(cols[i]);
    const int64_t n = (p - p0) * PANEL;
    quantize_outlier_block(col, n_out, w8 + (p - p0) * PANEL * KP + PANEL * K, wscale2 + n, wsum2 + n);
  }
}

// out [M, N] = x [M, K] @ W^T: per thread a block of panels re-quantized, then every 32-row block of x against it
template <int BITS, typename T>
void amx_gemm_impl(const Panels& a, const T* x, int64_t M, const float* wmax, bool gated, T* out) {
  // gated: W is gate|up (N / 2 rows each) and out [M, N / 2] = SiLU(x gate^T) * (x up^T): gate panel i and up
  // panel i are re-quantized side by side, so each pair of B tiles yields both and the product never goes to memory
  const int64_t K = a.K, N = a.N, P = (gated ? N / 2 : N) / PANEL, Mp = (M + 31) / 32 * 32;
  const int64_t N_out = P * PANEL, KP = K + AMX_K, n_out = std::min(AMX_K, K / 4);
  // the outlier channels: the n_out with the largest max|x| max|w|, which set the rows' ranges even smoothed
  std::vector<float> f = column_absmax(x, M, K), inv_f(K), weight(K);
  for (int64_t k = 0; k < K; ++k) weight[k] = f[k] * wmax[k];
  std::vector<int64_t> outl(K);
  std::iota(outl.begin(), outl.end(), 0);
  std::partial_sort(outl.begin(), outl.begin() + n_out, outl.end(),
                    [&](int64_t i, int64_t j) { return weight[i] > weight[j]; });
  outl.resize(n_out);
  for (int64_t k = 0; k < K; ++k) {  // a column all zero on either side keeps its factor 1
    f[k] = f[k] > 0.f && wmax[k] > 0.f ? std::sqrt(f[k] / wmax[k]) : 1.f;
    inv_f[k] = 1.f / f[k];
  }
  for (const int64_t k : outl) f[k] = inv_f[k] = 0.f;  // out of the main part, on both sides
  // a row: K codes, then the outlier block. Its length (not a power of two) also keeps the 16 rows a tile load
  // reads out of each other's cache sets.
  const int64_t lda = KP;
  // scratch from torch's allocator, uninitialized: a fresh zeroed vector cost page faults on every call
  auto xq_t = at::empty({Mp * lda}, at::kByte);
  auto xscale_t = at::empty({2, Mp}, at::kFloat);
  uint8_t* xq = xq_t.data_ptr<uint8_t>();
  float* xscale = xscale_t.data_ptr<float>();
  float* xscale2 = xscale + Mp;
  quantize_rows_u8(x, M, Mp, K, lda, inv_f.data(), xq, xscale);
  quantize_outliers(x, M, Mp, K, lda, outl.data(), n_out, xq, xscale2);
  const int64_t threads = at::get_num_threads();
  const int64_t most = std::max<int64_t>(2, (AMX_BLOCK_KIB << 10) / (PANEL * K)) / (gated ? 2 : 1);  // per block
  int64_t blocks = (P + most - 1) / most;
  blocks = std::min(P, (blocks + threads - 1) / threads * threads);  // whole rounds of threads
  const int64_t per = (P + blocks - 1) / blocks;
  const GroupValues sv = a.scales(), bv = a.biases();
  const int64_t slots = gated ? 2 * per : per;  // re-quantized panels a block holds
  const int64_t w8_bytes = slots * PANEL * KP;
  const int64_t part_ints = ((slots + 1) / 2 + 1) * 32 * 32;  // part: a pair's 32 x 32 sums, and the outliers'
  auto w8_t = at::empty({threads, w8_bytes}, at::kChar);
  auto part_t = at::empty({threads, part_ints}, at::kInt);
  auto ws_t = at::empty({threads, 4, slots * PANEL}, at::kFloat);
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    configure_tiles();
    const int64_t t = at::get_thread_num();
    int8_t* w8 = w8_t.data_ptr<int8_t>() + t * w8_bytes;
    int32_t* part = part_t.data_ptr<int32_t>() + t * part_ints;
    int32_t* part2 = part + part_ints - 32 * 32;
    float* wscale = ws_t.data_ptr<float>() + t * 4 * slots * PANEL;
    int32_t* wsum = reinterpret_cast<int32_t*>(wscale + slots * PANEL);
    float* wscale2 = wscale + 2 * slots * PANEL;
    int32_t* wsum2 = reinterpret_cast<int32_t*>(wscale + 3 * slots * PANEL);
    const auto requantize = [&](int64_t q0, int64_t q1, int64_t slot) {  // panels q0..q1 into slots from `slot`
      requantize_panels<BITS>(a.c(), sv, bv, K, a.G, f.data(), outl.data(), n_out, q0, q1, w8 + slot * PANEL * KP,
                              wscale + slot * PANEL, wsum + slot * PANEL, wscale2 + slot * PANEL,
                              wsum2 + slot * PANEL);
    };
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t p0 = b * per, p1 = std::min(P, p0 + per);
      if (p0 >= p1) continue;
      if (gated) {
        for (int64_t i = 0; i < p1 - p0; ++i)
          for (int64_t h = 0; h < 2; ++h)  // slot 2i: gate panel p0 + i, slot 2i + 1: its up panel
            requantize(p0 + i + h * P, p0 + i + h * P + 1, 2 * i + h);
      } else {
        requantize(p0, p1, 0);
      }
      const int64_t used = gated ? 2 * (p1 - p0) : p1 - p0;  // slots filled
      const int64_t pairs = (used + 1) / 2;
      for (int64_t m0 = 0; m0 < Mp; m0 += 32) {
        const uint8_t* xa = xq + m0 * lda;
        for (int64_t kb = 0; kb < K; kb += AMX_KB) {  // this slice of the 32 rows stays in L1 across the block
          const int64_t ke = std::min(K, kb + AMX_KB);
          const bool last = ke == K;
          for (int64_t j = 0; j < pairs; ++j) {
            const bool two = 2 * j + 1 < used;
            const int8_t* wa = w8 + 2 * j * PANEL * KP;
            int32_t* c = part + j * 32 * 32;
            if (kb == 0) {
              _tile_zero(0);
              _tile_zero(1);
              _tile_zero(2);
              _tile_zero(3);
            } else {
              _tile_loadd(0, c, 128);
              _tile_loadd(1, c + 16, 128);
              _tile_loadd(2, c + 16 * 32, 128);
              _tile_loadd(3, c + 16 * 32 + 16, 128);
            }
            for (int64_t k0 = kb; k0 < ke; k0 += AMX_K) {
              _tile_loadd(4, xa + k0, lda);
              _tile_loadd(5, xa + 16 * lda + k0, lda);
              _tile_loadd(6, wa + k0 * PANEL, 64);
              _tile_dpbusd(0, 4, 6);
              _tile_dpbusd(2, 5, 6);
              if (two) {
                _tile_loadd(7, wa + PANEL * KP + k0 * PANEL, 64);
                _tile_dpbusd(1, 4, 7);
                _tile_dpbusd(3, 5, 7);
              }
            }
            _tile_stored(0, c, 128);
            _tile_stored(1, c + 16, 128);
            _tile_stored(2, c + 16 * 32, 128);
            _tile_stored(3, c + 16 * 32 + 16, 128);
            if (!last) continue;
            // the outlier block: one more tile step, on its own scales
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            _tile_loadd(4, xa + K, lda);
            _tile_loadd(5, xa + 16 * lda + K, lda);
            _tile_loadd(6, wa + K * PANEL, 64);
            _tile_dpbusd(0, 4, 6);
            _tile_dpbusd(2, 5, 6);
            if (two) {
              _tile_loadd(7, wa + PANEL * KP + K * PANEL, 64);
              _tile_dpbusd(1, 4, 7);
              _tile_dpbusd(3, 5, 7);
            }
            _tile_stored(0, part2, 128);
            _tile_stored(1, part2 + 16, 128);
            _tile_stored(2, part2 + 16 * 32, 128);
            _tile_stored(3, part2 + 16 * 32 + 16, 128);
            const int64_t rows = std::min<int64_t>(32, M - m0);
            __m512 ws[2], ws2[2];
            __m512i off[2], off2[2];  // 128 x the code sums
            for (int h = 0; h < (two ? 2 : 1); ++h) {
              const int64_t n = (2 * j + h) * PANEL;
              ws[h] = _mm512_loadu_ps(wscale + n);
              off[h] = _mm512_slli_epi32(_mm512_loadu_si512(wsum + n), 7);
              ws2[h] = _mm512_loadu_ps(wscale2 + n);
              off2[h] = _mm512_slli_epi32(_mm512_loadu_si512(wsum2 + n), 7);
            }
            const auto value = [&](int64_t i, int h) {
              const __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_loadu_si512(c + i * 32 + 16 * h), off[h]));
              const __m512 v2 =
                  _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_loadu_si512(part2 + i * 32 + 16 * h), off2[h]));
              return _mm512_fmadd_ps(v, _mm512_mul_ps(ws[h], _mm512_set1_ps(xscale[m0 + i])),
                                     _mm512_mul_ps(v2, _mm512_mul_ps(ws2[h], _mm512_set1_ps(xscale2[m0 + i]))));
            };
            for (int64_t i = 0; i < rows; ++i) {
              if (gated) {
                store16(out + (m0 + i) * N_out + (p0 + j) * PANEL, silu_times16<T>(value(i, 0), value(i, 1)));
                continue;
              }
              for (int h = 0; h < (two ? 2 : 1); ++h)
                store16(out + (m0 + i) * N_out + (p0 + 2 * j + h) * PANEL, value(i, h));
            }
          }
        }
      }
    }
    _tile_release();
  });
}
#endif

bool amx_int8() {
#ifdef PAGEDSERVE_AMX
  return amx_permitted();
#else
  return false;
#endif
}

template <int BITS>
at::Tensor panel_amx_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                          const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& scale_d,
                          const std::optional<at::Tensor>& bias_d, const at::Tensor& wmax, bool silu_mul) {
  const char* op = BITS == 4 ? "int4_amx_gemm" : BITS == 6 ? "int6_amx_gemm" : "int8_amx_gemm";
  TORCH_CHECK(amx_int8(), op, ": this build or CPU has no AMX-INT8");
  const Panels a(x, codes, scale, bias, scale_d, bias_d, BITS, op);
  TORCH_CHECK(a.K % 64 == 0, op, ": K a multiple of 64, got ", a.K);
  TORCH_CHECK(wmax.scalar_type() == at::kFloat && wmax.dim() == 1 && wmax.size(0) == a.K, op,
              ": wmax fp32 [K] (panel_column_absmax)");
  TORCH_CHECK(!silu_mul || a.N % (2 * PANEL) == 0, op, ": silu_mul takes gate|up, each a multiple of 16 rows");
  const auto wm = wmax.contiguous();
  auto out = at::empty({x.size(0), silu_mul ? a.N / 2 : a.N}, x.options());
#ifdef PAGEDSERVE_AMX
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "panel_amx_gemm", [&] {
    if constexpr (!std::is_same_v<scalar_t, double>)
      amx_gemm_impl<BITS, scalar_t>(a, a.x.data_ptr<scalar_t>(), x.size(0), wm.data_ptr<float>(), silu_mul,
                                    out.data_ptr<scalar_t>());
    else
      TORCH_CHECK(false, op, ": fp32, bf16 or fp16 activations");
  });
#endif
  return out;
}

// max_n |w_nk| per column k of the dequantized panels (the weights' side of the AMX GEMM's smoothing)
at::Tensor panel_column_absmax(const at::Tensor& codes, const at::Tensor& scale, const std::optional<at::Tensor>& bias,
                               const std::optional<at::Tensor>& scale_d, const std::optional<at::Tensor>& bias_d,
                               int64_t bits, int64_t K) {
  TORCH_CHECK(bits == 4 || bits == 6 || bits == 8, "panel_column_absmax: bits 4, 6 or 8");
  const Panels a(at::empty({0, K}), codes, scale, bias, scale_d, bias_d, bits, "panel_column_absmax");
  const int64_t threads = at::get_num_threads(), P = a.N / PANEL;
  auto part = at::zeros({threads, K}, at::kFloat);
  const GroupValues sv = a.scales(), bv = a.biases();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    float* mx = part.data_ptr<float>() + at::get_thread_num() * K;
    std::vector<float> sc(a.G), bi(a.G), row(K);
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t r = 0; r < PANEL; ++r) {
        row_values(sv, bv, a.G, p, r, sc.data(), bi.data());
        if (bits == 4) dequant_row<4>(a.c(), p, r, sc.data(), bi.data(), K, K / a.G, row.data());
        else if (bits == 6) dequant_row<6>(a.c(), p, r, sc.data(), bi.data(), K, K / a.G, row.data());
        else dequant_row<8>(a.c(), p, r, sc.data(), bi.data(), K, K / a.G, row.data());
        for (int64_t k = 0; k < K; ++k) mx[k] = std::max(mx[k], std::abs(row[k]));
      }
  });
  return std::get<0>(part.max(0));
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
#define PAGEDSERVE_AMX_SCHEMA \
  "(Tensor x, Tensor codes, Tensor scale, Tensor? bias, Tensor? scale_d, Tensor? bias_d, Tensor wmax, " \
  "bool silu_mul=False) -> Tensor"
TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("int8_linear" PAGEDSERVE_PANEL_SCHEMA);
  m.def("int4_linear" PAGEDSERVE_PANEL_SCHEMA);
  m.def("int8_gemm" PAGEDSERVE_PANEL_SCHEMA);
  m.def("int4_gemm" PAGEDSERVE_PANEL_SCHEMA);
  m.def("int6_linear" PAGEDSERVE_PANEL_SCHEMA);
  m.def("int6_gemm" PAGEDSERVE_PANEL_SCHEMA);
  m.def("int8_amx_gemm" PAGEDSERVE_AMX_SCHEMA);
  m.def("int4_amx_gemm" PAGEDSERVE_AMX_SCHEMA);
  m.def("int6_amx_gemm" PAGEDSERVE_AMX_SCHEMA);
  m.def("panel_column_absmax(Tensor codes, Tensor scale, Tensor? bias, Tensor? scale_d, Tensor? bias_d, int bits, "
        "int k) -> Tensor");
  m.def("amx_int8", &amx_int8);
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("int8_linear", &pagedserve::int8_linear);
  m.impl("int4_linear", &pagedserve::int4_linear);
  m.impl("int8_gemm", &int8_gemm);
  m.impl("int4_gemm", &int4_gemm);
  m.impl("int6_linear", &pagedserve::int6_linear);
  m.impl("int6_gemm", &int6_gemm);
  m.impl("int8_amx_gemm", &panel_amx_gemm<8>);
  m.impl("int4_amx_gemm", &panel_amx_gemm<4>);
  m.impl("int6_amx_gemm", &panel_amx_gemm<6>);
  m.impl("panel_column_absmax", &panel_column_absmax);
}
