"""CPU paged attention: a C++ kernel that reads K/V from the cache blocks in place.

The reference backend copies every sequence's context out of its blocks each layer and then runs SDPA on the
copy. This one walks each sequence's block table inside the kernel (engine/csrc/paged_attention.cpp): decodes,
extends and prefill chunks all go through the same varlen kernel, GQA heads grouped per KV head, contexts split
across threads when there are too few sequences to keep every core busy. Chunks longer than the dispatch table's
limit go to SDPA instead (engine/layers/dispatch.py says where each wins).

The kernel is built with the project's other C++ kernels (`engine.cpu_kernels`); where that fails the engine
uses the PyTorch reference instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import cpu_kernels
from ..layers.dispatch import KernelTable
from .base import AttentionBackend, AttentionMetadata
from .torch_paged import attend_chunks, drop_padding, store_rows

# A query tile of this many tokens (x the GQA group) shares each K/V row it reads
QUERY_TILE = 16
# Never split a context into pieces shorter than this: merging partials is not free
MIN_TOKENS_PER_SPLIT = 128
MAX_SPLITS = 16


def num_splits(num_items: int, max_seq_len: int, threads: int) -> int:
    """KV splits per work item so that items x splits cover the threads about twice."""
    if num_items == 0 or num_items >= 2 * threads:
        return 1
    want = min(-(-2 * threads // num_items), max_seq_len // MIN_TOKENS_PER_SPLIT, MAX_SPLITS)
    return max(1, want)


@dataclass(slots=True)
class CpuAttentionMetadata(AttentionMetadata):
    """The common fields plus this backend's plan, shared by every layer of the step."""

    slots: torch.Tensor  # slot_mapping without padding rows
    keep: torch.Tensor | None  # rows to store, None when there is no padding
    num_kernel_seqs: int  # sequences 0 .. n-1 (decodes first, then short chunks) go through the kernel
    num_kernel_rows: int
    kernel_args: tuple  # block_tables, seq_lens, query_start_loc of those sequences
    splits: int



class CpuPagedAttention(AttentionBackend):
    """The C++ kernel for decodes and chunks up to the table's length, SDPA for longer prefill/extend chunks."""

    name = "cpu"

    def __init__(self, table: KernelTable | None = None) -> None:
        if not cpu_kernels.load():
            raise RuntimeError("the CPU paged-attention kernel is not available")
        self.kernel = torch.ops.pagedserve.paged_attention
        self.table = table or KernelTable()

    def build_metadata(self, meta: AttentionMetadata, num_kv_heads: int, dtype: torch.dtype) -> CpuAttentionMetadata:
        limit = self.table.attention_query_limit(dtype)
        slots, keep = drop_padding(meta.slot_mapping)
        lens = meta.query_lens_cpu
        n = next((b for b, q_len in enumerate(lens) if q_len > limit), len(lens))
        items = sum(-(-q_len // QUERY_TILE) for q_len in lens[:n]) * num_kv_heads
        splits = num_splits(items, max(meta.seq_lens_cpu[:n], default=0), torch.get_num_threads())
        args = (meta.block_tables[:n], meta.seq_lens[:n], meta.query_start_loc[:n + 1])
        return meta.for_backend(CpuAttentionMetadata, slots, keep, n, sum(lens[:n]), args, splits)

    def fused_decode_args(self, meta: AttentionMetadata, k_cache: torch.Tensor) -> tuple | None:
        """The attention operands of the fused decode layer (engine/layers/fused_decode.py): slots, the kernel's
        tables, its query tile and splits; None unless every sequence goes through the kernel, unpadded."""
        if not isinstance(meta, CpuAttentionMetadata) or not k_cache.is_contiguous():
            return None
        if meta.keep is not None or meta.num_kernel_seqs != meta.num_seqs:
            return None
        return (meta.slots, *meta.kernel_args, QUERY_TILE, meta.splits)

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if not isinstance(meta, CpuAttentionMetadata):
            meta = self.build_metadata(meta, k_cache.shape[2], q.dtype)
        store_rows(k, v, k_cache, v_cache, meta.slots, meta.keep)
        n = meta.num_kernel_seqs
        if n == meta.num_seqs:  # the steady state: decodes only
            return self.kernel(q, k_cache, v_cache, *meta.kernel_args, scale, QUERY_TILE, meta.splits)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        rows = meta.num_kernel_rows
        if n:
            out[:rows] = self.kernel(q[:rows], k_cache, v_cache, *meta.kernel_args, scale, QUERY_TILE, meta.splits)
        attend_chunks(q, k, v, k_cache, v_cache, meta, scale, n, out)
        return out
