"""Paged attention in Triton: every kernel reads K/V through the block tables, never a gathered copy.

* `store_kv`: one program per new token scatters its K and V rows into their cache slots.
* `decode_attention`: one program per (sequence, KV head, KV split). All query heads of a GQA group
  share the program, so each K/V tile is loaded once per KV head. With several splits
  (flash-decoding) each program covers a slice of the context and a reduce kernel merges the
  partial softmaxes; that keeps the GPU busy when batch x KV heads alone is too few programs.
* `prefill_attention`: one program per (sequence, query head, tile of new tokens); causal and
  bottom-right aligned, over the cached prefix (prefix-cache hits included) plus the chunk itself.

Softmax runs online in fp32 in the exp2 domain (scale folded with log2 e). Forward stores K/V
first, then attends, exactly as the PyTorch reference backend does. fp16, bf16 and fp32; any head
dim (tiles padded to a power of two >= 16), block size and GQA ratio (MHA, GQA, MQA).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from .base import AttentionBackend, AttentionMetadata

LOG2E = 1.4426950408889634
MIN_TOKENS_PER_SPLIT = 256  # below this a split's fixed cost (partials + reduce) outweighs its gain
MAX_KV_SPLITS = 64


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    if UPCAST:  # exact: bf16 products fit in fp32, which is also what the MMA accumulates in
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if a.dtype == tl.float32:  # fp32 models want fp32 accuracy, not tf32
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


# Under TRITON_INTERPRET=1 (read when triton.jit decorates, i.e. at import) bf16 tensors are numpy uint16
# bit patterns: loads, stores and casts are exact, but arithmetic, reductions and tl.dot act on the raw
# integers (bf16 1.0 + 1.0 gives 1.7e38, larger values NaN; a dot gives ~1e10). So interpreted kernels
# upcast bf16 tiles to fp32 before any math (UPCAST); compiled ones keep bf16 for the tensor cores.
_INTERPRET = isinstance(_dot, InterpretedFunction)


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_cs, stride_ch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)
    if slot < 0:  # padding token
        return
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    dst = (slot // PAGE) * stride_cb + (slot % PAGE) * stride_cs + h * stride_ch + d
    tl.store(k_cache_ptr + dst, tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask), mask=mask)
    tl.store(v_cache_ptr + dst, tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask), mask=mask)


@triton.jit
def _attend(
    q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, block_table_ptr, lo, hi, q_pos, kv_head_off, scale_log2,
    stride_cb, stride_cs, offs_d, d_mask,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr,
):
    """Fold keys [lo, hi) into the running softmax (acc, m_i, l_i) of the rows of q.

    Each key's physical row comes from its page's entry in the block table, so a tile may span
    several pages (block_size < BLOCK_N) or part of one.
    """
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        pos = start + offs_n
        n_mask = pos < hi
        page = tl.load(block_table_ptr + pos // PAGE, mask=n_mask, other=0).to(tl.int64)
        rows = page * stride_cb + (pos % PAGE) * stride_cs + kv_head_off
        kv_mask = n_mask[:, None] & d_mask[None, :]
        # masked rows load as 0, not cache garbage: a zero softmax weight times NaN is still NaN
        k = tl.load(k_cache_ptr + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        s = _dot(q, tl.trans(k), UPCAST) * scale_log2
        visible = n_mask[None, :]
        if CAUSAL:
            visible = visible & (pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        # every row sees >= 1 key in its first tile, so m_new is finite and no row ever gets NaN
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    scale_log2, stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    # whole BLOCK_N tiles per split, so a short sequence leaves its last splits empty
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * split_len
    hi = tl.minimum(lo + split_len, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    d_mask = offs_d < HEAD_DIM
    hd_mask = (offs_g < GROUP)[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=hd_mask, other=0.0)

    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc, m_i, l_i = _attend(
        q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, block_tables_ptr + b.to(tl.int64) * stride_bt, lo, hi, 0,
        kv_head.to(tl.int64) * stride_ch, scale_log2, stride_cb, stride_cs, offs_d, d_mask,
        PAGE, BLOCK_N, False, UPCAST,
    )

    if NUM_SPLITS == 1:
        o_ptrs = out_ptr + b.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=hd_mask)
    else:
        # an empty split has l = 0 and m = -inf: it stores o = 0 and lse = -inf, i.e. weight 0
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        part = (b * tl.num_programs(1) * GROUP + heads) * NUM_SPLITS + split
        tl.store(part_o_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc / l_safe[:, None], mask=hd_mask)
        tl.store(part_lse_ptr + part, m_i + tl.log2(l_safe), mask=offs_g < GROUP)


@triton.jit
def _decode_reduce_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Merge one (sequence, query head)'s split partials, weighting each by its softmax mass."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = b * tl.num_programs(1) + h
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(part_lse_ptr + row * NUM_SPLITS + offs_s, mask=s_mask, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))  # split 0 is never empty, so the max is finite
    o = tl.load(part_o_ptr + (row * NUM_SPLITS + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    o_ptrs = out_ptr + b.to(tl.int64) * stride_ot + h * stride_oh + offs_d
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=d_mask)


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr, out_ptr, first_seq,
    scale_log2, stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
):
    b = first_seq + tl.program_id(0)
    h = tl.program_id(1)
    m0 = tl.program_id(2) * BLOCK_M
    q_start = tl.load(query_start_ptr + b)
    q_len = tl.load(query_start_ptr + b + 1) - q_start
    if m0 >= q_len:  # the grid is sized for the longest chunk in the batch
        return
    seq_len = tl.load(seq_lens_ptr + b)
    ctx = seq_len - q_len  # query i of the chunk sits at position ctx + i

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    md_mask = (offs_m < q_len)[:, None] & d_mask[None, :]
    tokens = (q_start + offs_m).to(tl.int64)
    q_ptrs = q_ptr + tokens[:, None] * stride_qt + h * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=md_mask, other=0.0)

    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    table = block_tables_ptr + b.to(tl.int64) * stride_bt
    kv_head_off = (h // GROUP).to(tl.int64) * stride_ch
    # keys up to the tile's first query position are visible to every row: skip the causal mask there
    diag = (ctx + m0 + 1) // BLOCK_N * BLOCK_N
    acc, m_i, l_i = _attend(
        q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table, 0, diag, ctx + offs_m, kv_head_off, scale_log2,
        stride_cb, stride_cs, offs_d, d_mask, PAGE, BLOCK_N, False, UPCAST,
    )
    end = tl.minimum(seq_len, ctx + m0 + BLOCK_M)
    acc, m_i, l_i = _attend(
        q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table, diag, end, ctx + offs_m, kv_head_off, scale_log2,
        stride_cb, stride_cs, offs_d, d_mask, PAGE, BLOCK_N, True, UPCAST,
    )
    o_ptrs = out_ptr + tokens[:, None] * stride_ot + h * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=md_mask)


# ---- host side ------------------------------------------------------------------------------------------


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter new K/V rows [T, Hkv, D] into caches [num_blocks, block_size, Hkv, D]; slot -1 = skip."""
    _check_layout(k_cache, v_cache, k, v)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), *k_cache.stride()[:3],
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, PAGE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, num_splits: int,
                     out: torch.Tensor) -> None:
    """One query token per sequence: q [B, Hq, D] -> out [B, Hq, D] over each sequence's seq_lens[b] keys."""
    _check_layout(k_cache, v_cache, q, out)
    batch, num_heads, head_dim = q.shape
    num_kv_heads, page = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    block_d, block_n, warps = decode_tiles(head_dim, q.dtype)
    if num_splits > 1:
        part_o = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    else:  # never touched: the kernel writes the output directly
        part_o = part_lse = out
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_o, part_lse,
        scale * LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1), *k_cache.stride()[:3],
        block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, PAGE=page, NUM_SPLITS=num_splits,
        BLOCK_G=max(16, triton.next_power_of_2(group)),  # tl.dot wants >= 16 rows; spare rows are masked
        BLOCK_D=block_d, BLOCK_N=block_n, UPCAST=_upcast(q.dtype), num_warps=warps, num_stages=2,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(batch, num_heads)](
            part_o, part_lse, out, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_D=block_d, num_warps=4 if block_d >= 128 else 2,
        )


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                      first_seq: int, num_seqs: int, max_query_len: int, scale: float,
                      out: torch.Tensor) -> None:
    """Causal attention for sequences first_seq .. first_seq + num_seqs - 1, written into out's rows.

    q/out are the whole batch's [T, Hq, D]; each sequence's rows are given by query_start_loc.
    """
    _check_layout(k_cache, v_cache, q, out)
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, page = k_cache.shape[2], k_cache.shape[1]
    block_d, block_m, block_n, warps = prefill_tiles(head_dim, q.dtype)
    grid = (num_seqs, num_heads, triton.cdiv(max_query_len, block_m))
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out, first_seq,
        scale * LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1), *k_cache.stride()[:3],
        block_tables.stride(0),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, PAGE=page,
        BLOCK_M=block_m, BLOCK_D=block_d, BLOCK_N=block_n, UPCAST=_upcast(q.dtype),
        num_warps=warps, num_stages=2,
    )


def num_kv_splits(batch: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Splits per sequence so that batch x KV heads x splits programs cover the GPU about twice.

    A power of two (NUM_SPLITS is a compile-time constant: few variants), and never so many that a
    split holds under MIN_TOKENS_PER_SPLIT keys. Off the GPU (the interpreter) programs run one by
    one, so the count only has to be valid.
    """
    sms = _sm_count(device) if device.type == "cuda" else 1
    want = min(triton.cdiv(2 * sms, batch * num_kv_heads), triton.cdiv(max_seq_len, MIN_TOKENS_PER_SPLIT),
               MAX_KV_SPLITS)
    return 1 if want <= 1 else triton.next_power_of_2(want)


# Tile shapes that compile for sm_90 without register spills (ptxas -v, head dims 16-256). fp32 runs its
# dots on FMA units ("ieee"), not tensor cores, and needs smaller tiles or more warps.


def decode_tiles(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """BLOCK_D, BLOCK_N, num_warps of the decode kernel."""
    block_d = _block_d(head_dim)
    return block_d, 64 if block_d * dtype.itemsize <= 256 else 32, 8 if dtype == torch.float32 else 4


def prefill_tiles(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """BLOCK_D, BLOCK_M, BLOCK_N, num_warps of the prefill kernel."""
    block_d = _block_d(head_dim)
    if dtype != torch.float32:
        return (block_d, 128, 64, 8) if block_d <= 128 else (block_d, 64, 32, 4)
    return (block_d, 64, 32, 8) if block_d <= 64 else (block_d, 16, 16, 4)


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16; spare lanes are masked


def _upcast(dtype: torch.dtype) -> bool:
    return _INTERPRET and dtype == torch.bfloat16


def _check_layout(k_cache: torch.Tensor, v_cache: torch.Tensor, *rows: torch.Tensor) -> None:
    """The kernels take one set of cache strides and index every head dim as contiguous."""
    if k_cache.stride() != v_cache.stride() or any(t.stride(-1) != 1 for t in (k_cache, *rows)):
        raise ValueError(f"need K/V caches with equal strides and unit-stride head dims; got caches "
                         f"{k_cache.stride()}, {v_cache.stride()}, others {[t.stride() for t in rows]}")


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


class TritonPagedAttention(AttentionBackend):
    """Triton kernels over the paged cache. `kv_splits` fixes the decode split count (None: heuristic)."""

    name = "triton"

    def __init__(self, kv_splits: int | None = None) -> None:
        if kv_splits is not None and kv_splits < 1:
            raise ValueError(f"kv_splits must be >= 1, got {kv_splits}")
        self.kv_splits = kv_splits

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        nd = meta.num_decodes
        if nd:
            splits = self.kv_splits or num_kv_splits(nd, k_cache.shape[2], max(meta.seq_lens_cpu[:nd]),
                                                     q.device)
            decode_attention(q[:nd], k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, splits,
                             out[:nd])
        if nd < meta.num_seqs:
            prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, nd,
                              meta.num_seqs - nd, max(meta.query_lens_cpu[nd:]), scale, out)
        return out
