// The many-row GEMM of a quantized projection on int8 codes of both sides (the dispatch table's quant_gemm_amx and
// quant_gemm_vnni): the activations as int8 codes, times the panels' weights re-quantized to int8 per call, on AMX
// tiles or, on CPUs with AVX512-VNNI and no AMX, in vpdpbusd registers.
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

#include "panels.h"
#include "vec16.h"
#include "widen.h"

#if defined(PAGEDSERVE_AVX512) && defined(__AVX512VNNI__)
#define PAGEDSERVE_VNNI 1
#endif
#if defined(PAGEDSERVE_VNNI) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#define PAGEDSERVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

using pagedserve::narrow;
using pagedserve::widen;
using namespace pagedserve::panels;
#ifdef PAGEDSERVE_VNNI
using pagedserve::load16f;
using pagedserve::round_to;
using pagedserve::silu_times16;
#endif

// ---- many rows: int8 activations times int8 weights ----------------------------------------------------------
// AMX and VNNI multiply u8 by s8 at about twice their CPU's bf16 rate, so a prefill-sized GEMM runs on int8 codes of
// both sides: each activation row gets one scale (its absmax / 127; u8 codes c + 128, the 128 taken off through the
// weights' code sums), and each weight row one scale, its codes re-quantized from the group values per call (no
// resident int8 copy: it would double a 4-bit model's memory). One scale per row alone lost the bundled model's
// perplexity visibly, as a few channels carry most of the range; two things bring it near the reference
// (docs/performance.md):
// - as SmoothQuant does, channel k of x is divided by f_k = sqrt(max_m |x_mk| / max_n |w_nk|) and column k of W
//   multiplied by it (the product is unchanged), which evens the ranges of both sides; the activations' maxima
//   are this call's, the weights' taken once at load (panel_column_absmax);
// - the 64 channels with the largest max |x| max |w| leave that part and form a block of their own, with scales
//   of their own, at the end of each row: one more tile step, its sums scaled apart and added.
// An int8 panel step is exactly an AMX B tile's row and one vpdpbusd's weight operand (16 output rows of 4
// consecutive codes), so a re-quantized panel is its K / 4 steps of 64 bytes laid end to end, then the outlier
// block's. Both engines leave the same int32 sums of a 32-row block and two panels, and one epilogue scales them.
#ifdef PAGEDSERVE_VNNI
constexpr int64_t AMX_K = 64;  // codes per tile row, and the most outlier channels
constexpr int64_t AMX_KB = 1024;  // codes of K per pass: 32 rows' worth of activations stay in L1
constexpr int64_t AMX_BLOCK_KIB = 1024;  // a thread's re-quantized weight block: L2-sized, reused by every row block
constexpr int64_t VNNI_MR = 12;  // activation rows per register block: 2 x 12 sums, 2 weight vectors

// rows 0..MR of xa (u8 codes, row stride lda), codes k0..k1, times one panel of int8 steps (wa) or two (the second
// panel_bytes further on): int32 sums into c (row stride 32, the second panel's at +16), as AMX's tiles 0-3 hold them
template <int MR, bool TWO>
inline void vnni_rows(const uint8_t* xa, int64_t lda, const int8_t* wa, int64_t panel_bytes, int64_t k0, int64_t k1,
                      int32_t* c) {
  __m512i s0[MR], s1[MR];
  for (int m = 0; m < MR; ++m) s0[m] = s1[m] = _mm512_setzero_si512();
  const int8_t* w = wa + k0 * PANEL;
  for (int64_t k = k0; k < k1; k += 4, w += 64) {
    const __m512i b0 = _mm512_loadu_si512(w);
    const __m512i b1 = TWO ? _mm512_loadu_si512(w + panel_bytes) : b0;
    for (int m = 0; m < MR; ++m) {
      int32_t four;
      std::memcpy(&four, xa + m * lda + k, 4);
      const __m512i a = _mm512_set1_epi32(four);
      s0[m] = _mm512_dpbusd_epi32(s0[m], a, b0);
      if (TWO) s1[m] = _mm512_dpbusd_epi32(s1[m], a, b1);
    }
  }
  for (int m = 0; m < MR; ++m) {
    _mm512_storeu_si512(c + m * 32, s0[m]);
    if (TWO) _mm512_storeu_si512(c + m * 32 + 16, s1[m]);
  }
}

// the first `rows` (rounded up to 4) of a 32-row block through vnni_rows, VNNI_MR at a time
template <bool TWO>
inline void vnni_block(const uint8_t* xa, int64_t lda, const int8_t* wa, int64_t panel_bytes, int64_t k0, int64_t k1,
                       int64_t rows, int32_t* c) {
  int64_t i = 0;
  for (; i + VNNI_MR <= rows; i += VNNI_MR) vnni_rows<VNNI_MR, TWO>(xa + i * lda, lda, wa, panel_bytes, k0, k1, c + i * 32);
  if (rows - i > 4)
    vnni_rows<8, TWO>(xa + i * lda, lda, wa, panel_bytes, k0, k1, c + i * 32);
  else if (rows > i)
    vnni_rows<4, TWO>(xa + i * lda, lda, wa, panel_bytes, k0, k1, c + i * 32);
}
inline void vnni_block(const uint8_t* xa, int64_t lda, const int8_t* wa, int64_t panel_bytes, int64_t k0, int64_t k1,
                       bool two, int64_t rows, int32_t* c) {
  if (two)
    vnni_block<true>(xa, lda, wa, panel_bytes, k0, k1, rows, c);
  else
    vnni_block<false>(xa, lda, wa, panel_bytes, k0, k1, rows, c);
}
#endif

#ifdef PAGEDSERVE_AMX
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

// the output block's tiles 0-3 <- zero, or the 32 x 32 int32 block at c (row stride 32), and back
inline void zero_sums() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}
inline void load_sums(const int32_t* c) {
  _tile_loadd(0, c, 128);
  _tile_loadd(1, c + 16, 128);
  _tile_loadd(2, c + 16 * 32, 128);
  _tile_loadd(3, c + 16 * 32 + 16, 128);
}
inline void store_sums(int32_t* c) {
  _tile_stored(0, c, 128);
  _tile_stored(1, c + 16, 128);
  _tile_stored(2, c + 16 * 32, 128);
  _tile_stored(3, c + 16 * 32 + 16, 128);
}

// one tile step: codes k0..k0+63 of 32 activation rows (xa, row stride lda) times those of one panel (wa) or two
// (the second panel_bytes further on), added into tiles 0-3
inline void tile_step(const uint8_t* xa, int64_t lda, const int8_t* wa, int64_t panel_bytes, int64_t k0, bool two) {
  _tile_loadd(4, xa + k0, lda);
  _tile_loadd(5, xa + 16 * lda + k0, lda);
  _tile_loadd(6, wa + k0 * PANEL, 64);
  _tile_dpbusd(0, 4, 6);
  _tile_dpbusd(2, 5, 6);
  if (two) {
    _tile_loadd(7, wa + panel_bytes + k0 * PANEL, 64);
    _tile_dpbusd(1, 4, 7);
    _tile_dpbusd(3, 5, 7);
  }
}

#endif

#ifdef PAGEDSERVE_VNNI
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
        const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(row.data() + k), inv);
        const __m512i c = _mm512_add_epi32(_mm512_cvtps_epi32(v), off);
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

// code j of step q for the 16 rows (lane r: row r), as a signed int32: the layout of panels.h
template <int BITS>
inline __m512i lane_code(const uint8_t* c, int64_t q, int j) {
  const __m512i d = _mm512_loadu_si512(c + step_offset<BITS>(q));
  if constexpr (BITS == 8)  // byte j: code j, signed
    return _mm512_sra_epi32(_mm512_sll_epi32(d, _mm_cvtsi32_si128(24 - 8 * j)), _mm_cvtsi32_si128(24));
  // byte i: code i in its low nibble, code 4 + i in its high one
  const int at = j < 4 ? 8 * j : 8 * (j - 4) + 4;
  __m512i code = _mm512_and_si512(_mm512_srl_epi32(d, _mm_cvtsi32_si128(at)), _mm512_set1_epi32(15));
  if constexpr (BITS == 6) {  // its 2 high bits: bits 4 (q % 2) + 2 (j >= 4) of the piece byte i, less the 32
    const __m512i pc = _mm512_loadu_si512(c + pieces_offset(q));
    const int shift = 8 * (j & 3) + 4 * static_cast<int>(q % 2) + 2 * (j >= 4);
    const __m512i high = _mm512_and_si512(_mm512_srl_epi32(pc, _mm_cvtsi32_si128(shift)), _mm512_set1_epi32(3));
    code = _mm512_sub_epi32(_mm512_or_si512(code, _mm512_slli_epi32(high, 4)), _mm512_set1_epi32(32));
  }
  return code;
}

// the 16 rows' weights of step q's codes (PER of them), times the smoothing factors: lane r is row r
template <int BITS>
inline void step_values(const uint8_t* c, int64_t q, __m512 sc, __m512 bi, const float* f, __m512* v) {
  constexpr int PER = BITS == 8 ? 4 : 8;
  for (int i = 0; i < PER; ++i)
    v[i] = _mm512_mul_ps(_mm512_fmadd_ps(_mm512_cvtepi32_ps(lane_code<BITS>(c, q, i)), sc, bi),
                         _mm512_set1_ps(f[PER * q + i]));
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
// wsum2). A step at a time, the 16 rows in the 16 lanes (two passes: the rows' maxima, then the codes).
template <int BITS>
void requantize_panels(const uint8_t* codes, const GroupValues& scale, const GroupValues& bias, int64_t K, int64_t G,
                       const float* f, const int64_t* outl, int64_t n_out, int64_t p0, int64_t p1, int8_t* w8,
                       float* wscale, int32_t* wsum, float* wscale2, int32_t* wsum2) {
  const int64_t KP = K + AMX_K, group = K / G;
  __m512 col[AMX_K];
  constexpr int PER = BITS == 8 ? 4 : 8;
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
        if constexpr (BITS != 8) {  // codes 8q..8q+3, then 8q+4..8q+7: int8 steps 2q and 2q + 1
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
      const __m512i code = lane_code<BITS>(c, k / PER, static_cast<int>(k % PER));
      col[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(code), scale.load(p, g),
                               bias.v ? bias.load(p, g) : _mm512_setzero_ps());
    }
    quantize_outlier_block(col, n_out, o + PANEL * K, wscale2 + n, wsum2 + n);
  }
}

// out [M, N] = x [M, K] @ W^T: per thread a block of panels re-quantized, then every 32-row block of x against it,
// on AMX tiles (amx) or VNNI registers
template <int BITS, typename T>
void int8_gemm_impl(const Panels& a, const T* x, int64_t M, const float* wmax, bool gated, bool amx, T* out) {
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
#ifdef PAGEDSERVE_AMX
    if (amx) configure_tiles();
#endif
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
        const int64_t rows = std::min<int64_t>(32, M - m0);
        // AMX: this slice of the 32 rows stays in L1 across the block; VNNI keeps a block's sums in registers
        // over the whole of K
        const int64_t slice = amx ? AMX_KB : K;
        for (int64_t kb = 0; kb < K; kb += slice) {
          const int64_t ke = std::min(K, kb + slice);
          const bool last = ke == K;
          for (int64_t j = 0; j < pairs; ++j) {
            const bool two = 2 * j + 1 < used;
            const int8_t* wa = w8 + 2 * j * PANEL * KP;
            int32_t* c = part + j * 32 * 32;
#ifdef PAGEDSERVE_AMX
            if (amx) {
              if (kb == 0)
                zero_sums();
              else
                load_sums(c);
              for (int64_t k0 = kb; k0 < ke; k0 += AMX_K) tile_step(xa, lda, wa, PANEL * KP, k0, two);
              store_sums(c);
              if (!last) continue;
              zero_sums();  // the outlier block: one more tile step, on its own scales
              tile_step(xa, lda, wa, PANEL * KP, K, two);
              store_sums(part2);
            }
#endif
            if (!amx) {
              vnni_block(xa, lda, wa, PANEL * KP, 0, K, two, rows, c);
              vnni_block(xa, lda, wa, PANEL * KP, K, KP, two, rows, part2);  // the outlier block
            }
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
                store16(out + (m0 + i) * N_out + (p0 + j) * PANEL,
                        silu_times16<T>(round_to<T>(value(i, 0)), round_to<T>(value(i, 1))));  // as stored
                continue;
              }
              for (int h = 0; h < (two ? 2 : 1); ++h)
                store16(out + (m0 + i) * N_out + (p0 + 2 * j + h) * PANEL, value(i, h));
            }
          }
        }
      }
    }
#ifdef PAGEDSERVE_AMX
    if (amx) _tile_release();
#endif
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

bool vnni_int8() {
#ifdef PAGEDSERVE_VNNI
  return true;
#else
  return false;
#endif
}

template <int BITS>
at::Tensor panel_int8_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                           const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& scale_d,
                           const std::optional<at::Tensor>& bias_d, const at::Tensor& wmax, bool silu_mul, bool amx) {
  const char* op = BITS == 4 ? "int4_int8_gemm" : BITS == 6 ? "int6_int8_gemm" : "int8_int8_gemm";
  TORCH_CHECK(amx ? amx_int8() : vnni_int8(), op, ": this build or CPU has no ", amx ? "AMX-INT8" : "AVX512-VNNI");
  const Panels a(x, codes, scale, bias, scale_d, bias_d, BITS, op);
  TORCH_CHECK(a.K % 64 == 0, op, ": K a multiple of 64, got ", a.K);
  TORCH_CHECK(wmax.scalar_type() == at::kFloat && wmax.dim() == 1 && wmax.size(0) == a.K, op,
              ": wmax fp32 [K] (panel_column_absmax)");
  TORCH_CHECK(!silu_mul || a.N % (2 * PANEL) == 0, op, ": silu_mul takes gate|up, each a multiple of 16 rows");
  const auto wm = wmax.contiguous();
  auto out = at::empty({x.size(0), silu_mul ? a.N / 2 : a.N}, x.options());
#ifdef PAGEDSERVE_VNNI
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "panel_int8_gemm", [&] {
    if constexpr (!std::is_same_v<scalar_t, double>)
      int8_gemm_impl<BITS, scalar_t>(a, a.x.data_ptr<scalar_t>(), x.size(0), wm.data_ptr<float>(), silu_mul, amx,
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

#define PAGEDSERVE_INT8_GEMM_SCHEMA \
  "(Tensor x, Tensor codes, Tensor scale, Tensor? bias, Tensor? scale_d, Tensor? bias_d, Tensor wmax, " \
  "bool silu_mul=False, bool amx=False) -> Tensor"
TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
  m.def("int8_int8_gemm" PAGEDSERVE_INT8_GEMM_SCHEMA);
  m.def("int4_int8_gemm" PAGEDSERVE_INT8_GEMM_SCHEMA);
  m.def("int6_int8_gemm" PAGEDSERVE_INT8_GEMM_SCHEMA);
  m.def("panel_column_absmax(Tensor codes, Tensor scale, Tensor? bias, Tensor? scale_d, Tensor? bias_d, int bits, "
        "int k) -> Tensor");
  m.def("amx_int8", &amx_int8);
  m.def("vnni_int8", &vnni_int8);
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("int8_int8_gemm", &panel_int8_gemm<8>);
  m.impl("int4_int8_gemm", &panel_int8_gemm<4>);
  m.impl("int6_int8_gemm", &panel_int8_gemm<6>);
  m.impl("panel_column_absmax", &panel_column_absmax);
}
