"""CPU paged attention: a C++ kernel that reads K/V from the cache blocks in place.

The reference backend copies every sequence's context out of its blocks each layer (an
`index_select` that took 35 % of a B=64 decode step) and then runs SDPA on the copy. This one walks
each sequence's block table inside the kernel (engine/csrc/paged_attention.cpp): decodes,
extends and prefill chunks all go through the same varlen kernel, GQA heads grouped per KV head,
contexts split across threads when there are too few sequences to keep every core busy.

The kernel is built on first use with the project's other C++ kernels (`engine.cpu_kernels`); if that
fails the engine uses the PyTorch reference instead.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from engine import cpu_kernels
from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.attention.torch_paged import _store, attend_chunks
from engine.cpu_dtype import read_cpu_flags

# Sequences with at most this many new tokens go through the kernel; longer chunks are compute-bound,
# where oneDNN's SDPA (AMX/AVX-512 GEMM tiles) is several times faster than the fp32 kernel (measured with
# benchmarks/kernels/bench_cpu_attention.py) and their one gather of the context is cheap in comparison.
# bf16 on a CPU with AVX512-BF16 but no AMX is the exception: the kernel's vdpbf16ps path beat SDPA at every
# chunk length measured (64-512 tokens, 1.3-2.3x on Zen 4), so there every sequence goes through the kernel.
# (With AMX, SDPA's tiles are the ones measured faster.)
MAX_KERNEL_QUERY_LEN = 16
# A query tile of this many tokens (x the GQA group) shares each K/V row it reads
QUERY_TILE = 16
# Never split a context into pieces shorter than this: merging partials is not free
MIN_TOKENS_PER_SPLIT = 128
MAX_SPLITS = 16


@functools.cache
def _bf16_without_amx() -> bool:
    flags = read_cpu_flags() or frozenset()
    return "avx512_bf16" in flags and "amx_bf16" not in flags


def load_kernel():
    """torch.ops.pagedserve.paged_attention, or None (with a logged warning) if the kernels cannot be built."""
    return torch.ops.pagedserve.paged_attention if cpu_kernels.load() else None


def num_splits(num_items: int, max_seq_len: int, threads: int) -> int:
    """KV splits per work item so that items x splits cover the threads about twice."""
    if num_items == 0 or num_items >= 2 * threads:
        return 1
    want = min(-(-2 * threads // num_items), max_seq_len // MIN_TOKENS_PER_SPLIT, MAX_SPLITS)
    return max(1, want)


@dataclass(slots=True)
class _StepPlan:
    """Per-step values every layer shares (built once, at the first layer)."""

    meta: AttentionMetadata
    slots: torch.Tensor
    keep: torch.Tensor | None
    num_kernel_seqs: int  # sequences 0 .. n-1 (decodes first, then short chunks) go through the kernel
    num_kernel_rows: int
    kernel_args: tuple  # block_tables, seq_lens, query_start_loc of those sequences
    splits: int


class CpuPagedAttention(AttentionBackend):
    """The C++ kernel for decodes and short chunks, SDPA for long prefill/extend chunks."""

    name = "cpu"

    def __init__(self, kernel=None, max_kernel_query_len: int | None = None) -> None:
        self.kernel = kernel if kernel is not None else load_kernel()
        if self.kernel is None:
            raise RuntimeError("the CPU paged-attention kernel is not available")
        self.max_kernel_query_len = max_kernel_query_len  # None: by dtype and CPU (see MAX_KERNEL_QUERY_LEN)
        self._plan: _StepPlan | None = None

    def _kernel_query_limit(self, dtype: torch.dtype) -> int:
        if self.max_kernel_query_len is not None:
            return self.max_kernel_query_len
        return 1 << 62 if dtype == torch.bfloat16 and _bf16_without_amx() else MAX_KERNEL_QUERY_LEN

    def plan(self, meta: AttentionMetadata, num_kv_heads: int, dtype: torch.dtype) -> _StepPlan:
        """The step's plan (built at the first layer that asks, then shared by every layer)."""
        if self._plan is not None and self._plan.meta is meta:
            return self._plan
        limit = self._kernel_query_limit(dtype)
        slots, keep = meta.slot_mapping, None
        if bool((slots < 0).any()):
            keep = slots >= 0
            slots = slots[keep]
        lens = meta.query_lens_cpu
        n = next((b for b, q_len in enumerate(lens) if q_len > limit), len(lens))
        rows = sum(lens[:n])
        items = sum(-(-q_len // QUERY_TILE) for q_len in lens[:n]) * num_kv_heads
        splits = num_splits(items, max(meta.seq_lens_cpu[:n], default=0), torch.get_num_threads())
        args = (meta.block_tables[:n], meta.seq_lens[:n], meta.query_start_loc[:n + 1])
        self._plan = _StepPlan(meta, slots, keep, n, rows, args, splits)
        return self._plan

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        plan = self.plan(meta, k_cache.shape[2], q.dtype)
        if plan.keep is None:
            _store(k, v, k_cache, v_cache, plan.slots)
        else:
            _store(k[plan.keep], v[plan.keep], k_cache, v_cache, plan.slots)
        n = plan.num_kernel_seqs
        if n == meta.num_seqs:  # the steady state: decodes only
            return self.kernel(q, k_cache, v_cache, *plan.kernel_args, scale, QUERY_TILE, plan.splits)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if n:
            out[:plan.num_kernel_rows] = self.kernel(q[:plan.num_kernel_rows], k_cache, v_cache, *plan.kernel_args,
                                                     scale, QUERY_TILE, plan.splits)
        attend_chunks(q, k, v, k_cache, v_cache, meta, scale, n, out)
        return out
