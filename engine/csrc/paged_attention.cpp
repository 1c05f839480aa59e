// Paged attention on the CPU, reading K/V from the cache blocks in place (no gather copy).
//
// One entry point serves decode, extend and prefill: every sequence b has query rows
// [query_start_loc[b], query_start_loc[b+1]) at positions ctx .. seq_len-1 (ctx = seq_len - q_len) and
// attends causally over keys 0 .. its own position. Work items are (sequence, KV head, query tile,
// KV split): the GROUP query heads that share a KV head are done together, so each K/V row is read
// (and, for bf16, widened to fp32) once per tile, not once per query head. On CPUs with AVX512-BF16, bf16
// skips the widening: block_bf16 multiplies the cache's bf16 rows directly (and, for prefill and extend,
// chunk_many_bf16 scores keys in lanes). Items are handed out through
// an atomic counter because causal tiles and varlen sequences differ in cost. Splits of one
// (sequence, head, tile) write unnormalised partials (acc, max, sum) that a second pass merges, so a
// long context still spreads over all threads at batch 1.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "ops.h"
#include "widen.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

using pagedserve::fast_exp;
using pagedserve::narrow;
using pagedserve::widen;

struct Tile {
  int64_t seq, row0, rows, ctx, seq_len;  // query rows [row0, row0 + rows) of seq; first at position ctx
};

constexpr int64_t ROWS = 4;  // query rows scored together: four independent FMA chains per key vector
constexpr int64_t MANY = 8;  // query rows scored together on the keys-in-lanes path (bf16, below)
constexpr int64_t PREFETCH_BLOCKS = 6;  // how far ahead a work item prefetches its blocks (into L2)

// s[r * s_stride + j] = q_r . k_j for the ROWS query rows (fp32, pre-scaled) and n keys (rows of D floats).
// Each key row is loaded once for all rows; one horizontal sum per score (vectorised auto-reductions
// spilled to the stack and summed 16 scalars in a row).
inline void qk_rows(const float* q, const float* k, int64_t k_stride, int64_t n, int64_t D, float* s,
                    int64_t s_stride) {
#ifdef __AVX512F__
  if (D % 16 == 0) {
    for (int64_t j = 0; j < n; ++j) {
      __m512 a[ROWS];
      for (int r = 0; r < ROWS; ++r) a[r] = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; d += 16) {
        const __m512 kv = _mm512_loadu_ps(k + j * k_stride + d);
        for (int r = 0; r < ROWS; ++r) a[r] = _mm512_fmadd_ps(_mm512_loadu_ps(q + r * D + d), kv, a[r]);
      }
      for (int r = 0; r < ROWS; ++r) s[r * s_stride + j] = _mm512_reduce_add_ps(a[r]);
    }
    return;
  }
#endif
  for (int64_t j = 0; j < n; ++j)
    for (int r = 0; r < ROWS; ++r) {
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int64_t d = 0; d < D; ++d) acc += q[r * D + d] * k[j * k_stride + d];
      s[r * s_stride + j] = acc;
    }
}

// acc_r = alpha_r * acc_r + sum_j p[r * p_stride + j] v_j for the ROWS rows together: each V row is loaded
// once for all rows, and 64 dims x ROWS rows of accumulators stay in registers across the keys (a loop
// over d per key and row is one FMA latency chain with a load and a store per key; figures in
// docs/performance.md).
inline void pv_rows(float* acc, const float* p, int64_t p_stride, const float* alpha, const float* v,
                    int64_t v_stride, int64_t n, int64_t D) {
  int64_t d0 = 0;
#ifdef __AVX512F__
  for (; d0 + 64 <= D; d0 += 64) {
    __m512 a[ROWS][4];
    for (int r = 0; r < ROWS; ++r)
      for (int c = 0; c < 4; ++c)
        a[r][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + d0 + 16 * c), _mm512_set1_ps(alpha[r]));
    for (int64_t j = 0; j < n; ++j) {
      __m512 vv[4];
      for (int c = 0; c < 4; ++c) vv[c] = _mm512_loadu_ps(v + j * v_stride + d0 + 16 * c);
      for (int r = 0; r < ROWS; ++r) {
        const __m512 pr = _mm512_set1_ps(p[r * p_stride + j]);
        for (int c = 0; c < 4; ++c) a[r][c] = _mm512_fmadd_ps(pr, vv[c], a[r][c]);
      }
    }
    for (int r = 0; r < ROWS; ++r)
      for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc + r * D + d0 + 16 * c, a[r][c]);
  }
#endif
  if (d0 == D) return;
  for (int r = 0; r < ROWS; ++r)
    for (int64_t d = d0; d < D; ++d) acc[r * D + d] *= alpha[r];
  for (int64_t j = 0; j < n; ++j)
    for (int r = 0; r < ROWS; ++r) {
      const float pr = p[r * p_stride + j];
#pragma omp simd
      for (int64_t d = d0; d < D; ++d) acc[r * D + d] += pr * v[j * v_stride + d];
    }
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define PAGEDSERVE_ATTN_BF16 1
// bf16 K/V, ROWS query rows at a time: products straight from the cache's bf16 rows with vdpbf16ps, nothing
// widened into buffers. Scores: per query row, one accumulator per key of a 16-key chunk, then a
// transpose-reduce (45 shuffles and adds for 16 scores, where a horizontal sum per score took ~8). P V: P rounded to bf16 (as PyTorch's CPU flash attention does for bf16), key pairs
// interleaved word by word so each vdpbf16ps adds two keys' weighted rows; the accumulators hold the
// head dims in the order unpacklo/hi_epi16 leave them (bf16_dim_slot maps them back).

// lane j of the result = the sum of a[j]'s lanes
inline __m512 reduce16(__m512* a) {
  __m512 c[8], e[4], f[2];
  for (int i = 0; i < 8; ++i)
    c[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    e[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 2; ++i)
    f[i] = _mm512_add_ps(_mm512_shuffle_f32x4(e[2 * i], e[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(e[2 * i], e[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(f[0], f[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(f[0], f[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// where head dim d sits in a row of the bf16 path's accumulators (per 32 dims: the unpacklo lanes, then unpackhi)
inline int64_t bf16_dim_slot(int64_t d) {
  const int64_t c = d / 32, x = d % 32;
  return 32 * c + (x % 8 >= 4 ? 16 : 0) + 4 * (x / 8) + x % 4;
}

// Keys [start, start + n) of one block (n <= 16), at k / v with row stride `stride`, for query rows
// row0 .. row0 + rows of the item (rows <= ROWS; qb, m, l, acc point at row0's: bf16 unscaled q, D apart);
// row r is query token r / group at position ctx + r / group. Updates the online-softmax state m, l and the
// permuted accumulators acc (D apart).
// FIXED_ROWS = ROWS (every group but a sequence's last) makes the row count a constant, so the P V
// accumulators stay in registers: with a runtime count they were spilled to the stack on every key pair.
template <int64_t FIXED_ROWS>
inline void block_bf16(const uint16_t* qb, const uint16_t* k, const uint16_t* v, int64_t stride, int64_t n,
                       int64_t start, int64_t ctx, int64_t row0, int64_t any_rows, int64_t group, int64_t D,
                       float scale, float* m, float* l, float* acc) {
  const int64_t rows = FIXED_ROWS > 0 ? FIXED_ROWS : any_rows;
  alignas(64) uint16_t pb[ROWS][16];
  float alpha[ROWS];
  int64_t max_visible = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t visible = std::min(n, ctx + (row0 + r) / group + 1 - start);
    alpha[r] = 1.f;
    std::memset(pb[r], 0, sizeof pb[r]);
    if (visible <= 0) continue;
    max_visible = std::max(max_visible, visible);
    __m512 a[16];
    for (int j = 0; j < 16; ++j) a[j] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 32) {
      const __m512bh qv = (__m512bh)_mm512_loadu_si512(qb + r * D + d);
      for (int j = 0; j < 16; ++j)  // keys past `visible` are never loaded: their slots may hold anything
        if (j < visible) a[j] = _mm512_dpbf16_ps(a[j], (__m512bh)_mm512_loadu_si512(k + j * stride + d), qv);
    }
    const __mmask16 live = static_cast<__mmask16>((1u << visible) - 1);
    const __m512 sc = _mm512_mul_ps(reduce16(a), _mm512_set1_ps(scale));
    const float mx = std::max(m[r], _mm512_mask_reduce_max_ps(live, sc));
    alignas(64) float p[16];
    _mm512_store_ps(p, _mm512_maskz_mov_ps(live, _mm512_sub_ps(sc, _mm512_set1_ps(mx))));
#pragma omp simd
    for (int j = 0; j < 16; ++j) p[j] = fast_exp(p[j]);
    const __m512 e = _mm512_maskz_mov_ps(live, _mm512_load_ps(p));  // keys past `visible`: no weight
    alpha[r] = m[r] == -std::numeric_limits<float>::infinity() ? 0.f : fast_exp(m[r] - mx);
    l[r] = l[r] * alpha[r] + _mm512_reduce_add_ps(e);
    m[r] = mx;
    _mm256_store_si256(reinterpret_cast<__m256i*>(pb[r]), (__m256i)_mm512_cvtneps_pbh(e));
  }
  if (max_visible == 0) return;
  for (int64_t d0 = 0; d0 < D; d0 += 64) {  // 4 accumulators per row: 64 dims
    __m512 o[ROWS][4];
    for (int64_t r = 0; r < rows; ++r)
      for (int c = 0; c < 4; ++c)
        o[r][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + d0 + 16 * c), _mm512_set1_ps(alpha[r]));
    for (int64_t j = 0; j < max_visible; j += 2) {
      const bool pair = j + 1 < max_visible;
      __m512i lo[2], hi[2];
      for (int c = 0; c < 2; ++c) {
        const __m512i a = _mm512_loadu_si512(v + j * stride + d0 + 32 * c);
        const __m512i b = pair ? _mm512_loadu_si512(v + (j + 1) * stride + d0 + 32 * c) : _mm512_setzero_si512();
        lo[c] = _mm512_unpacklo_epi16(a, b);
        hi[c] = _mm512_unpackhi_epi16(a, b);
      }
      for (int64_t r = 0; r < rows; ++r) {
        int32_t w;
        std::memcpy(&w, pb[r] + j, sizeof w);  // (p_j, p_j+1); p_j+1 is 0 past the end
        const __m512bh pp = (__m512bh)_mm512_set1_epi32(w);
        for (int c = 0; c < 2; ++c) {
          o[r][2 * c] = _mm512_dpbf16_ps(o[r][2 * c], (__m512bh)lo[c], pp);
          o[r][2 * c + 1] = _mm512_dpbf16_ps(o[r][2 * c + 1], (__m512bh)hi[c], pp);
        }
      }
    }
    for (int64_t r = 0; r < rows; ++r)
      for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc + r * D + d0 + 16 * c, o[r][c]);
  }
}

// Many query rows (prefill, extend): keys in lanes. Each block's K is turned once into dim-pair rows (kt[p]
// lane j = key j's dims 2p, 2p+1) and its V into key-pair rows (the P V operand above, built once, not once
// per four rows), both shared by every row of the item. A row's 16 scores are then a run of vdpbf16ps with
// no horizontal sum, softmax works on them as one vector, and the row sums l stay in lanes until the end.

inline __m512 exp16(__m512 x) {  // fast_exp, 16 lanes
  const __m512 t = _mm512_max_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f)), _mm512_set1_ps(-126.f));
  const __m512 i = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, i);
  __m512 p = _mm512_set1_ps(1.5403530e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_add_epi32(_mm512_castps_si512(p), _mm512_slli_epi32(_mm512_cvtps_epi32(i), 23));
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_GE_OQ), _mm512_castsi512_ps(bits));
}

// Up to 16 keys (one block's, or half of one) into half h of a chunk's layouts. kt: D / 2 rows of 32 dwords
// (half h in lanes 16h..); vp: 16 key pairs x D dwords (half h: pairs 8h..), each 64 dims as unpacklo/hi of 32
// (see above). Slots past n are zeros: a block's unused slots may hold anything, and a NaN times a zero
// weight is NaN.
inline void half_layout(const uint16_t* k, const uint16_t* v, int64_t stride, int64_t n, int64_t D, int h,
                        uint32_t* kt, uint32_t* vp) {
  const __mmask16 live = static_cast<__mmask16>((1u << n) - 1);
  const __m512i idx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                         _mm512_set1_epi32(static_cast<int32_t>(stride / 2)));
  for (int64_t p = 0; p < D / 2; ++p)
    _mm512_storeu_si512(kt + 32 * p + 16 * h,
                        _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, idx, k + 2 * p, 4));
  for (int64_t i = 0; i < 8; ++i)
    for (int64_t d = 0; d < D; d += 32) {
      const __m512i a = 2 * i < n ? _mm512_loadu_si512(v + 2 * i * stride + d) : _mm512_setzero_si512();
      const __m512i b = 2 * i + 1 < n ? _mm512_loadu_si512(v + (2 * i + 1) * stride + d) : _mm512_setzero_si512();
      _mm512_storeu_si512(vp + (8 * h + i) * D + d, _mm512_unpacklo_epi16(a, b));
      _mm512_storeu_si512(vp + (8 * h + i) * D + d + 16, _mm512_unpackhi_epi16(a, b));
    }
}

// One chunk of n <= 16 * HALVES keys from `start` for MANY rows from row0 (qb, m, lv, acc at row0's; rows
// past the item's `rows` are computed on and never read). lv: each row's softmax sums, 16 lanes.
template <int HALVES>
inline void chunk_many_bf16(const uint16_t* qb, const uint32_t* kt, const uint32_t* vp, int64_t n, int64_t start,
                            int64_t ctx, int64_t row0, int64_t rows, int64_t group, int64_t D, float scale,
                            float* m, float* lv, float* acc) {
  __m512 s[MANY][2];  // per row: the two halves' scores, or (one half) two chains over alternate dim pairs
  for (int r = 0; r < MANY; ++r) s[r][0] = s[r][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < D / 2; p += 3 - HALVES) {
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kt + 32 * p);
    const __m512bh k1 = (__m512bh)_mm512_loadu_si512(HALVES == 2 ? kt + 32 * p + 16 : kt + 32 * p + 32);
    for (int r = 0; r < MANY; ++r) {
      int32_t w0, w1;
      std::memcpy(&w0, qb + r * D + 2 * p, 4);
      std::memcpy(&w1, qb + r * D + 2 * p + (HALVES == 2 ? 0 : 2), 4);
      s[r][0] = _mm512_dpbf16_ps(s[r][0], k0, (__m512bh)_mm512_set1_epi32(w0));
      s[r][1] = _mm512_dpbf16_ps(s[r][1], k1, (__m512bh)_mm512_set1_epi32(w1));
    }
  }
  alignas(64) uint16_t pb[MANY][32];
  float alpha[MANY];
  int64_t max_visible = 0;
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int r = 0; r < MANY; ++r) {
    const int64_t visible = row0 + r < rows ? std::min(n, ctx + (row0 + r) / group + 1 - start) : 0;
    alpha[r] = 1.f;
    std::memset(pb[r], 0, sizeof pb[r]);
    if (visible <= 0) continue;
    max_visible = std::max(max_visible, visible);
    const auto lanes = [](int64_t k) { return static_cast<__mmask16>(k >= 16 ? 0xffffu : (1u << std::max<int64_t>(k, 0)) - 1); };
    const __mmask16 live0 = lanes(visible), live1 = lanes(visible - 16);
    __m512 sc0, sc1 = ninf;
    if (HALVES == 2) {
      sc0 = _mm512_mask_mov_ps(ninf, live0, _mm512_mul_ps(s[r][0], _mm512_set1_ps(scale)));
      sc1 = _mm512_mask_mov_ps(ninf, live1, _mm512_mul_ps(s[r][1], _mm512_set1_ps(scale)));
    } else {
      sc0 = _mm512_mask_mov_ps(ninf, live0, _mm512_mul_ps(_mm512_add_ps(s[r][0], s[r][1]), _mm512_set1_ps(scale)));
    }
    const float mx = std::max(m[r], _mm512_reduce_max_ps(_mm512_max_ps(sc0, sc1)));
    const __m512 mxv = _mm512_set1_ps(mx);
    const __m512 e0 = _mm512_maskz_mov_ps(live0, exp16(_mm512_sub_ps(sc0, mxv)));
    __m512 sum = e0;
    _mm256_store_si256(reinterpret_cast<__m256i*>(pb[r]), (__m256i)_mm512_cvtneps_pbh(e0));
    if (HALVES == 2 && live1) {
      const __m512 e1 = _mm512_maskz_mov_ps(live1, exp16(_mm512_sub_ps(sc1, mxv)));
      sum = _mm512_add_ps(sum, e1);
      _mm256_store_si256(reinterpret_cast<__m256i*>(pb[r] + 16), (__m256i)_mm512_cvtneps_pbh(e1));
    }
    alpha[r] = m[r] == -std::numeric_limits<float>::infinity() ? 0.f : fast_exp(m[r] - mx);
    m[r] = mx;
    _mm512_storeu_ps(lv + 16 * r, _mm512_fmadd_ps(_mm512_loadu_ps(lv + 16 * r), _mm512_set1_ps(alpha[r]), sum));
  }
  if (max_visible == 0) return;
  const int64_t pairs = (max_visible + 1) / 2;
  for (int g = 0; g < MANY; g += ROWS)
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
      __m512 o[ROWS][4];
      for (int r = 0; r < ROWS; ++r)
        for (int c = 0; c < 4; ++c)
          o[r][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + (g + r) * D + d0 + 16 * c), _mm512_set1_ps(alpha[g + r]));
      for (int64_t i = 0; i < pairs; ++i) {
        __m512bh vv[4];
        for (int c = 0; c < 4; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(vp + i * D + d0 + 16 * c);
        for (int r = 0; r < ROWS; ++r) {
          int32_t w;
          std::memcpy(&w, pb[g + r] + 2 * i, sizeof w);
          const __m512bh pp = (__m512bh)_mm512_set1_epi32(w);
          for (int c = 0; c < 4; ++c) o[r][c] = _mm512_dpbf16_ps(o[r][c], vv[c], pp);
        }
      }
      for (int r = 0; r < ROWS; ++r)
        for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc + (g + r) * D + d0 + 16 * c, o[r][c]);
    }
}
#endif

template <typename T>
void attention(const T* q, int64_t q_stride_t, int64_t q_stride_h, const T* k_cache, const T* v_cache,
               int64_t cache_stride_block, int64_t cache_stride_slot, const int32_t* block_tables,
               int64_t table_stride, const std::vector<Tile>& tiles, int64_t num_kv_heads, int64_t group,
               int64_t head_dim, int64_t block_size, int64_t splits, float scale, T* out, float* part_acc,
               float* part_ml, int64_t max_rows) {
  const int64_t items = static_cast<int64_t>(tiles.size()) * num_kv_heads * splits;
  std::atomic<int64_t> next{0};
  const int64_t D = head_dim, BS = block_size;
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    // rows of one item: query tokens x heads of the group, padded to a multiple of ROWS
    // (the keys-in-lanes path reads and writes up to MANY rows past the last multiple of ROWS)
    const int64_t R = (max_rows * group + ROWS - 1) / ROWS * ROWS + 8;
    std::vector<float> qf(R * D), acc(R * D), m(R), l(R), s(ROWS * BS), kt(D * BS), kf(BS * D), vf(BS * D);
    std::vector<uint16_t> qb(R * D);
    std::vector<float> lv(R * 16);
    std::vector<uint32_t> ktp(D / 2 * 32), vpp(16 * D);
    for (int64_t item; (item = next.fetch_add(1)) < items;) {
      const int64_t split = item % splits;
      const int64_t h = (item / splits) % num_kv_heads;
      const Tile& t = tiles[item / splits / num_kv_heads];
      const int64_t rows = t.rows * group;
      const int64_t padded = (rows + ROWS - 1) / ROWS * ROWS;
      // keys this item may see: [lo, hi), split boundaries on block boundaries
      const int64_t last_pos = t.ctx + t.rows;  // one past the tile's last query position
      const int64_t blocks = (last_pos + BS - 1) / BS;
      const int64_t per_split = (blocks + splits - 1) / splits;
      const int64_t lo = split * per_split * BS;
      const int64_t hi = std::min(last_pos, (split + 1) * per_split * BS);
      bool fast = false;  // the bf16 path above: head dims in 64s; it reads q as bf16, unscaled (qb)
#ifdef PAGEDSERVE_ATTN_BF16
      if constexpr (std::is_same<T, at::BFloat16>::value) fast = D % 64 == 0 && D <= 512;
#endif
      // keys in lanes: the layouts pay for themselves over many rows; halves must not straddle blocks
      const bool many = fast && rows > ROWS && BS % 16 == 0;
      int64_t pending = 0, chunk_start = 0;  // keys laid out and not yet scored, and the first one's position
      const int64_t used = many ? (rows + MANY - 1) / MANY * MANY : padded;  // rows the kernels touch
      if (many) std::fill(lv.begin(), lv.begin() + used * 16, 0.f);
      for (int64_t r = 0; r < used; ++r) {  // r = token * group + g
        m[r] = -std::numeric_limits<float>::infinity();
        l[r] = 0.f;
        const T* src = q + (t.row0 + r / group) * q_stride_t + (h * group + r % group) * q_stride_h;
        if (fast) {
          if (r < rows) std::memcpy(qb.data() + r * D, src, D * sizeof(uint16_t));
          continue;
        }
        float* dst = qf.data() + r * D;
        if (r >= rows) {
          std::fill(dst, dst + D, 0.f);
          continue;
        }
        for (int64_t d = 0; d < D; ++d) dst[d] = widen(src[d]) * scale;
      }
      std::fill(acc.begin(), acc.begin() + used * D, 0.f);
      const int32_t* table = block_tables + t.seq * table_stride;
      for (int64_t start = lo; start < hi; start += BS) {
        const int64_t n = std::min(BS, hi - start);
        const int64_t base = table[start / BS] * cache_stride_block + h * D;
        // The blocks sit anywhere in the pool, so the hardware prefetcher cannot guess them: without this a
        // large decode waits on each block in turn, far below the memory bandwidth. In a pool of real size (the
        // engine's, GBs) one block ahead into L1 was not enough; PREFETCH_BLOCKS ahead into L2 (locality 1) was
        // the best of the distances and cache levels tried (figures: docs/performance.md).
        for (int64_t ahead = start == lo ? 1 : PREFETCH_BLOCKS; ahead <= PREFETCH_BLOCKS; ++ahead) {
          if (start + ahead * BS >= hi) break;
          const int64_t next_base = table[start / BS + ahead] * cache_stride_block + h * D;
          for (int64_t j = 0; j < BS; ++j)
            for (int64_t off = 0; off < D; off += 64 / static_cast<int64_t>(sizeof(T))) {
              __builtin_prefetch(k_cache + next_base + j * cache_stride_slot + off, 0, 1);
              __builtin_prefetch(v_cache + next_base + j * cache_stride_slot + off, 0, 1);
            }
        }
#ifdef PAGEDSERVE_ATTN_BF16
        if (many) {  // 16-key halves into the chunk's layouts; a chunk of two halves is scored at once
          const auto* kb = reinterpret_cast<const uint16_t*>(k_cache + base);
          const auto* vb = reinterpret_cast<const uint16_t*>(v_cache + base);
          for (int64_t j = 0; j < n; j += 16) {
            const int64_t here = std::min<int64_t>(16, n - j);
            half_layout(kb + j * cache_stride_slot, vb + j * cache_stride_slot, cache_stride_slot, here, D,
                        pending ? 1 : 0, ktp.data(), vpp.data());
            if (!pending) chunk_start = start + j;
            pending += here;
            if (pending < 32 && start + j + here < hi) continue;
            for (int64_t r0 = 0; r0 < rows; r0 += MANY) {
              if (t.ctx + (std::min(r0 + MANY, rows) - 1) / group + 1 - chunk_start <= 0) continue;  // none sees it
              (pending > 16 ? chunk_many_bf16<2> : chunk_many_bf16<1>)(
                  qb.data() + r0 * D, ktp.data(), vpp.data(), pending, chunk_start, t.ctx, r0, rows, group, D, scale,
                  m.data() + r0, lv.data() + r0 * 16, acc.data() + r0 * D);
            }
            pending = 0;
          }
          continue;
        }
        if (fast) {
          const auto* kb = reinterpret_cast<const uint16_t*>(k_cache + base);
          const auto* vb = reinterpret_cast<const uint16_t*>(v_cache + base);
          for (int64_t r0 = 0; r0 < rows; r0 += ROWS) {
            const int64_t here = std::min(ROWS, rows - r0);
            for (int64_t j = 0; j < n && t.ctx + (r0 + here - 1) / group + 1 - (start + j) > 0; j += 16)
              (here == ROWS ? block_bf16<ROWS> : block_bf16<0>)(
                  qb.data() + r0 * D, kb + j * cache_stride_slot, vb + j * cache_stride_slot, cache_stride_slot,
                  std::min<int64_t>(16, n - j), start + j, t.ctx, r0, here, group, D, scale, m.data() + r0,
                  l.data() + r0, acc.data() + r0 * D);
          }
          continue;
        }
#endif
        // bf16/fp16 K/V rows are widened into small contiguous fp32 buffers; fp32 ones are read in place.
        // Many rows (extend, prefill): K transposed to [D, n] so scores run along the keys, no horizontal
        // sums. Four rows or fewer (a decode with GQA group <= 4): the transpose would cost more than it
        // saves, so scores are dot products over K rows.
        const bool transposed = padded > ROWS;
        const float* kp;
        const float* vp;
        int64_t kv_stride;
        if constexpr (std::is_same<T, float>::value) {
          kp = k_cache + base;
          vp = v_cache + base;
          kv_stride = cache_stride_slot;
        } else {
          for (int64_t j = 0; j < n; ++j) {
            const T* vs = v_cache + base + j * cache_stride_slot;
            const T* ks = k_cache + base + j * cache_stride_slot;
            for (int64_t d = 0; d < D; ++d) vf[j * D + d] = widen(vs[d]);
            for (int64_t d = 0; !transposed && d < D; ++d) kf[j * D + d] = widen(ks[d]);
          }
          kp = kf.data();
          vp = vf.data();
          kv_stride = D;
        }
        if (transposed) {
          for (int64_t j = 0; j < n; ++j) {
            const T* ks = k_cache + base + j * cache_stride_slot;
            for (int64_t d = 0; d < D; ++d) kt[d * n + j] = widen(ks[d]);
          }
        }
        for (int64_t r0 = 0; r0 < padded; r0 += ROWS) {
          const int64_t last = std::min(r0 + ROWS, rows) - 1;
          if (t.ctx + last / group + 1 - start <= 0) continue;  // no row of the four sees this block yet
          float* s0 = s.data();
          float* s1 = s0 + BS;
          float* s2 = s1 + BS;
          float* s3 = s2 + BS;
          const float* q0 = qf.data() + r0 * D;
          if (!transposed) {
            qk_rows(q0, kp, kv_stride, n, D, s0, BS);
          } else {
            std::fill(s0, s0 + ROWS * BS, 0.f);
          }
          for (int64_t d = 0; transposed && d < D; ++d) {
            const float a0 = q0[d], a1 = q0[D + d], a2 = q0[2 * D + d], a3 = q0[3 * D + d];
            const float* kd = kt.data() + d * n;
#pragma omp simd
            for (int64_t j = 0; j < n; ++j) {
              s0[j] += a0 * kd[j];
              s1[j] += a1 * kd[j];
              s2[j] += a2 * kd[j];
              s3[j] += a3 * kd[j];
            }
          }
          float alpha[ROWS];
          int64_t max_visible = 0;
          for (int64_t rr = 0; rr < ROWS; ++rr) {
            const int64_t r = r0 + rr;
            float* sr = s0 + rr * BS;
            alpha[rr] = 1.f;
            // causal: query at position ctx + r / group sees keys up to and including itself
            const int64_t visible = r < rows ? std::min(n, t.ctx + r / group + 1 - start) : 0;
            for (int64_t j = std::max<int64_t>(visible, 0); j < n; ++j) sr[j] = 0.f;  // no weight in P V
            if (visible <= 0) continue;
            max_visible = std::max(max_visible, visible);
            float mx = m[r];
#pragma omp simd reduction(max : mx)
            for (int64_t j = 0; j < visible; ++j) mx = mx > sr[j] ? mx : sr[j];
            alpha[rr] = m[r] == -std::numeric_limits<float>::infinity() ? 0.f : fast_exp(m[r] - mx);
            float sum = 0.f;
#pragma omp simd reduction(+ : sum)
            for (int64_t j = 0; j < visible; ++j) {
              sr[j] = fast_exp(sr[j] - mx);
              sum += sr[j];
            }
            l[r] = l[r] * alpha[rr] + sum;
            m[r] = mx;
          }
          if (max_visible > 0) pv_rows(acc.data() + r0 * D, s0, BS, alpha, vp, kv_stride, max_visible, D);
        }
      }
#ifdef PAGEDSERVE_ATTN_BF16
      for (int64_t r = 0; many && r < rows; ++r) l[r] = _mm512_reduce_add_ps(_mm512_loadu_ps(lv.data() + 16 * r));
#endif
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t tok = t.row0 + r / group, head = h * group + r % group;
        float* ar = acc.data() + r * D;
#ifdef PAGEDSERVE_ATTN_BF16
        if (fast) {  // back to dimension order
          float tmp[512];
          for (int64_t d = 0; d < D; ++d) tmp[d] = ar[bf16_dim_slot(d)];
          std::memcpy(ar, tmp, D * sizeof(float));
        }
#endif
        if (splits == 1) {
          T* o = out + (tok * num_kv_heads * group + head) * D;
          const float inv = 1.f / l[r];
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) o[d] = narrow<T>(ar[d] * inv);
        } else {  // partials indexed [token, head, split]
          const int64_t p = (tok * num_kv_heads * group + head) * splits + split;
          std::memcpy(part_acc + p * D, ar, D * sizeof(float));
          part_ml[2 * p] = m[r];
          part_ml[2 * p + 1] = l[r];
        }
      }
    }
  });
}

template <typename T>
void merge_splits(const float* part_acc, const float* part_ml, T* out, int64_t rows, int64_t splits,
                  int64_t D) {
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> o(D);
    for (int64_t r = begin; r < end; ++r) {
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t s = 0; s < splits; ++s) mx = std::max(mx, part_ml[2 * (r * splits + s)]);
      std::fill(o.begin(), o.end(), 0.f);
      float total = 0.f;
      for (int64_t s = 0; s < splits; ++s) {
        const int64_t p = r * splits + s;
        if (part_ml[2 * p + 1] == 0.f) continue;  // an empty split (its keys are all in the future)
        const float w = std::exp(part_ml[2 * p] - mx);
        total += w * part_ml[2 * p + 1];
        for (int64_t d = 0; d < D; ++d) o[d] += w * part_acc[p * D + d];
      }
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) out[r * D + d] = narrow<T>(o[d] / total);
    }
  });
}

}  // namespace

// q [T, Hq, D] (any row/head strides, unit stride in D); caches [blocks, block_size, Hkv, D] with unit
// strides inside a slot; block_tables [B, W] int32; seq_lens [B] and query_start_loc [B + 1] int32 (CPU).
// Returns [T, Hq, D] contiguous, in q's dtype. query_tile: query tokens per work item; splits: KV
// splits per item (1 = none).
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens,
                           const at::Tensor& query_start_loc, double scale, int64_t query_tile, int64_t splits) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && q.stride(2) == 1, "bad q / cache shapes");
  TORCH_CHECK(k_cache.strides() == v_cache.strides() && k_cache.stride(3) == 1 &&
                  k_cache.stride(2) == k_cache.size(3),
              "K/V caches need equal strides and contiguous slots");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "q and the caches must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt && block_tables.stride(1) == 1,
              "block tables, seq lens and query offsets must be int32");
  const int64_t num_heads = q.size(1), D = q.size(2), num_kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && num_heads % num_kv_heads == 0, "head shapes do not match");
  const int64_t group = num_heads / num_kv_heads, block_size = k_cache.size(1);
  const auto lens = seq_lens.contiguous();
  const auto qsl = query_start_loc.contiguous();
  const int32_t* lp = lens.data_ptr<int32_t>();
  const int32_t* qp = qsl.data_ptr<int32_t>();
  std::vector<Tile> tiles;
  int64_t max_rows = 1;
  for (int64_t b = 0; b < lens.size(0); ++b) {
    const int64_t q_len = qp[b + 1] - qp[b], ctx = lp[b] - q_len;
    TORCH_CHECK(q_len >= 0 && ctx >= 0, "sequence ", b, " has more query tokens than context");
    for (int64_t i = 0; i < q_len; i += query_tile) {
      const int64_t rows = std::min(query_tile, q_len - i);
      tiles.push_back({b, qp[b] + i, rows, ctx + i, lp[b]});
      max_rows = std::max(max_rows, rows);
    }
  }
  auto out = at::empty({q.size(0), num_heads, D}, q.options());
  at::Tensor part_acc, part_ml;
  float* pa = nullptr;
  float* pml = nullptr;
  if (splits > 1) {
    auto f32 = q.options().dtype(at::kFloat);
    part_acc = at::empty({q.size(0) * num_heads * splits, D}, f32);
    part_ml = at::zeros({q.size(0) * num_heads * splits, 2}, f32);  // untouched (no tile) = empty
    pa = part_acc.data_ptr<float>();
    pml = part_ml.data_ptr<float>();
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    attention<scalar_t>(q.data_ptr<scalar_t>(), q.stride(0), q.stride(1), k_cache.data_ptr<scalar_t>(),
                        v_cache.data_ptr<scalar_t>(), k_cache.stride(0), k_cache.stride(1),
                        block_tables.data_ptr<int32_t>(), block_tables.stride(0), tiles, num_kv_heads, group, D,
                        block_size, splits, static_cast<float>(scale), out.data_ptr<scalar_t>(), pa, pml,
                        max_rows);
    if (splits > 1) merge_splits<scalar_t>(pa, pml, out.data_ptr<scalar_t>(), q.size(0) * num_heads, splits, D);
  });
  return out;
}

namespace pagedserve {
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens,
                           const at::Tensor& query_start_loc, double scale, int64_t query_tile, int64_t splits) {
  return ::paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, query_tile, splits);
}
}  // namespace pagedserve

TORCH_LIBRARY(pagedserve, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "Tensor query_start_loc, float scale, int query_tile, int splits) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) { m.impl("paged_attention", &paged_attention); }
