// Our quantized weights' panel layout, shared by the kernels that read it (quant_linear.cpp: the GEMV and the
// bf16-tile GEMM; int8_gemm.cpp: the int8 GEMM on AMX or VNNI): the layout, a panel's group values, the operand
// checks, and the dequantization of a panel row.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "vec16.h"
#include "widen.h"

namespace pagedserve::panels {

#ifdef PAGEDSERVE_AVX512
using pagedserve::store16;
using pagedserve::store32;
#endif

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
// and their product is exact in fp32, where an fp16 copy of it would round. Row by row (the earlier layouts) the
// GEMVs were compute-bound, below the memory's speed, and int8 on int16 activation codes slower than int4 per
// weight byte, the more so at several rows (figures: docs/performance.md).
// 6-bit codes (0..63: Q6_K, Q5_x, and fusions mixing them with Q4_K) keep the int4 steps for their low 4 bits and
// add their high 2 bits in a plane beside them: per 32 codes of a panel, the 4 nibble steps (256 bytes) and then
// 2 x 64 bytes of 2-bit pieces, byte 4r + i of piece h holding bits 4-5 of row r's codes 16h + i, 16h + 4 + i,
// 16h + 8 + i, 16h + 12 + i in its bits 0-1, 2-3, 4-5, 6-7 (a step's two nibble halves, then the next step's).
// They hold c + 32 for codes c in -32..31 (the 32 comes off each block's integer sum, as int8's 128 does), so a
// 6-bit weight costs 6 bits, as in the file, and the GEMV does the int4 work plus two shifts and masks.
constexpr int64_t PANEL = 16;  // rows per panel
constexpr int64_t XB = 32;  // codes per 6-bit block; the GEMV's activation values per scale

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

#ifdef PAGEDSERVE_AVX512
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

// the same for 6-bit panels, a block of 32 codes at a time: row r's 16 nibble bytes (4 steps of 4) and 8 piece
// bytes (2 x 4), the pieces spread to the nibble bytes they extend and shifted into place by bytes, then the codes
// put in k order (byte i of a step: codes i and 4 + i) and widened 16 at a time
template <typename T>
inline void dequant_panel_row6(const uint8_t* c, int64_t r, const float* sc, const float* bi, int64_t K,
                               int64_t group, T* o) {
  const __m128i nib = _mm_set1_epi8(15), two = _mm_set1_epi8(3);
  // byte 4s + i takes piece byte 4 (s / 2) + i, its bits 4 (s % 2) and up
  const __m128i spread = _mm_setr_epi8(0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7);
  constexpr __mmask16 odd_steps = 0xF0F0;
  for (int64_t b = 0; b < K / XB; ++b) {
    const uint8_t* blk = c + b * BLOCK6 + 4 * r;
    int32_t n4[4], p4[2];
    for (int s = 0; s < 4; ++s) std::memcpy(n4 + s, blk + 64 * s, 4);
    for (int h = 0; h < 2; ++h) std::memcpy(p4 + h, blk + 256 + 64 * h, 4);
    const __m128i n = _mm_setr_epi32(n4[0], n4[1], n4[2], n4[3]);
    __m128i pc = _mm_shuffle_epi8(_mm_setr_epi32(p4[0], p4[1], 0, 0), spread);
    pc = _mm_mask_mov_epi8(pc, odd_steps, _mm_srli_epi16(pc, 4));
    const __m128i lo = _mm_or_si128(_mm_and_si128(n, nib), _mm_slli_epi16(_mm_and_si128(pc, two), 4));
    const __m128i hi = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(n, 4), nib),
                                    _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(pc, 2), two), 4));
    const __m128i codes[2] = {_mm_unpacklo_epi32(lo, hi), _mm_unpackhi_epi32(lo, hi)};  // codes 0-15, 16-31
    __m512 f[2];
    for (int h = 0; h < 2; ++h) {
      const int64_t g = (b * XB + 16 * h) / group;
      const __m512 v = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(codes[h])), _mm512_set1_ps(32.f));
      f[h] = _mm512_fmadd_ps(v, _mm512_set1_ps(sc[g]), _mm512_set1_ps(bi[g]));
    }
    store32(o + b * XB, f[0], f[1]);
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
#ifdef PAGEDSERVE_AVX512
    if constexpr (!std::is_same_v<T, double>) {
      dequant_panel_row6(c, r, sc, bi, K, group, o);
      return;
    }
#endif
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

}  // namespace pagedserve::panels
