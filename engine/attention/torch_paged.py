"""Reference paged attention in plain PyTorch: runs on CPU and GPU, and is the oracle for kernels.

Decodes (one query each) are done together: their blocks are gathered into a padded
[B, L, Hkv, D] view and masked past each context length. Prefill/extend chunks are done one
sequence at a time with SDPA (few per step, each large, so the loop costs little).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import AttentionBackend, AttentionMetadata


def drop_padding(slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(slots to store, the rows they come from or None when no row is padding, slot -1)."""
    if bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        return slot_mapping[keep], keep
    return slot_mapping, None


def store_rows(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               slots: torch.Tensor, keep: torch.Tensor | None = None) -> None:
    """Scatter the new K/V rows (those in `keep`, if given) into their cache slots."""
    if keep is not None:
        k, v = k[keep], v[keep]
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """Contiguous [length, Hkv, D] K or V of one sequence, read through its block table."""
    total_blocks, block_size = cache.shape[0], cache.shape[1]
    num_blocks = -(-length // block_size)
    rows = cache.view(total_blocks, -1).index_select(0, block_table[:num_blocks])
    return rows.view(num_blocks * block_size, *cache.shape[2:])[:length]


@dataclass(slots=True)
class TorchAttentionMetadata(AttentionMetadata):
    """The common fields plus the decodes' gathered block ids and mask, shared by every layer of the step."""

    slots: torch.Tensor  # slot_mapping without padding rows
    keep: torch.Tensor | None  # rows to store, None when there is no padding
    decode_tables: torch.Tensor | None  # [num_decodes * width] block ids
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, width * block_size] additive mask
    width: int



class TorchPagedAttention(AttentionBackend):
    name = "torch"

    def __init__(self, block_size: int = 16) -> None:
        self.block_size = block_size

    def build_metadata(self, meta: AttentionMetadata, num_kv_heads: int, dtype: torch.dtype,
                       block_size: int | None = None) -> TorchAttentionMetadata:
        slots, keep = drop_padding(meta.slot_mapping)
        nd, tables, mask, width = meta.num_decodes, None, None, 0
        if nd:
            block_size = block_size or self.block_size
            width = -(-max(meta.seq_lens_cpu[:nd]) // block_size)
            tables = meta.block_tables[:nd, :width].reshape(-1)
            pad = torch.arange(width * block_size, device=slots.device)[None, :] >= meta.seq_lens[:nd, None]
            mask = torch.zeros(pad.shape, dtype=dtype, device=slots.device).masked_fill_(pad, float("-inf"))
            mask = mask[:, None, None, :]
        return meta.for_backend(TorchAttentionMetadata, slots, keep, tables, mask, width)

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if not isinstance(meta, TorchAttentionMetadata):
            meta = self.build_metadata(meta, k_cache.shape[2], q.dtype, k_cache.shape[1])
        store_rows(k, v, k_cache, v_cache, meta.slots, meta.keep)
        nd = meta.num_decodes
        if nd == meta.num_seqs:  # the common steady state: decodes only
            return self._decode(q, k_cache, v_cache, meta, scale)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta, scale)
        attend_chunks(q, k, v, k_cache, v_cache, meta, scale, nd, out)
        return out

    @staticmethod
    def _decode(q: torch.Tensor, k_cache, v_cache, meta: TorchAttentionMetadata, scale: float) -> torch.Tensor:
        nd = q.shape[0]
        num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
        length = meta.width * block_size
        # index_select of whole blocks (rows of block_size * Hkv * D) is faster than fancy indexing
        kb = k_cache.view(num_blocks, -1).index_select(0, meta.decode_tables).view(nd, length, num_kv_heads, head_dim)
        vb = v_cache.view(num_blocks, -1).index_select(0, meta.decode_tables).view(nd, length, num_kv_heads, head_dim)
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # [B, Hq, 1, D]
            kb.transpose(1, 2),  # [B, Hkv, L, D]
            vb.transpose(1, 2),
            attn_mask=meta.decode_mask,
            scale=scale,
            enable_gqa=True,
        )
        return o.squeeze(2)


def attend_chunks(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, first: int,
                  out: torch.Tensor) -> None:
    """SDPA for sequences first .. num_seqs - 1, one at a time, into their rows of out.

    A chunk with nothing cached attends to this step's K/V directly; an extend gathers its context
    once (a copy of O(context) against O(chunk x context) of attention work).
    """
    start = sum(meta.query_lens_cpu[:first])
    for b in range(first, meta.num_seqs):
        q_len, kv_len = meta.query_lens_cpu[b], meta.seq_lens_cpu[b]
        end = start + q_len
        if kv_len == q_len:  # nothing cached: this step's K/V are the whole context
            kb, vb = k[start:end], v[start:end]
        else:
            kb = gather_kv(k_cache, meta.block_tables[b], kv_len)
            vb = gather_kv(v_cache, meta.block_tables[b], kv_len)
        out[start:end] = _sdpa(q[start:end], kb, vb, scale, kv_len == q_len)
        start = end


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, pure_causal: bool) -> torch.Tensor:
    """q [n, Hq, D], k/v [c, Hkv, D] -> [n, Hq, D]; causal, bottom-right aligned."""
    n, c = q.shape[0], k.shape[0]
    mask = None
    if not pure_causal:  # query i sits at position c - n + i
        mask = torch.arange(c, device=q.device)[None, :] <= torch.arange(c - n, c, device=q.device)[:, None]
    # 4-D inputs: with 3-D ones PyTorch falls back to its slow math kernel on the CPU
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=mask, is_causal=pure_causal, scale=scale, enable_gqa=True,
    )
    return o[0].transpose(0, 1)
