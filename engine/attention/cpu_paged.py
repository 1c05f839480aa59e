"""CPU paged attention: a C++ kernel that reads K/V from the cache blocks in place.

The reference backend copies every sequence's context out of its blocks each layer (an
`index_select` that took 35 % of a B=64 decode step) and then runs SDPA on the copy. This one walks
each sequence's block table inside the kernel (engine/attention/csrc/paged_attention.cpp): decodes,
extends and prefill chunks all go through the same varlen kernel, GQA heads grouped per KV head,
contexts split across threads when there are too few sequences to keep every core busy.

The kernel is compiled on first use (g++ with -march=native, via torch's cpp_extension and ninja) into
a persistent cache directory, so later starts load it in well under a second. If compiling fails the
backend logs a warning and the engine uses the PyTorch reference instead.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.attention.torch_paged import _store, attend_chunks

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_attention.cpp"
CFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp-simd"]
# Sequences with at most this many new tokens go through the kernel; longer chunks are compute-bound,
# where oneDNN's SDPA (AMX/AVX-512 GEMM tiles) is several times faster than the kernel (measured with
# benchmarks/kernels/bench_cpu_attention.py) and their one gather of the context is cheap in comparison.
MAX_KERNEL_QUERY_LEN = 16
# A query tile of this many tokens (x the GQA group) shares each K/V row it reads
QUERY_TILE = 16
# Never split a context into pieces shorter than this: merging partials is not free
MIN_TOKENS_PER_SPLIT = 128
MAX_SPLITS = 16


def cache_dir() -> Path:
    root = os.environ.get("PAGEDSERVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pagedserve")
    return Path(root) / "extensions"


@functools.cache
def load_kernel():
    """The compiled kernel (torch.ops.pagedserve.paged_attention), or None (and a logged warning) if it
    cannot be built."""
    source = SOURCE.read_text()
    # -march=native code is only valid on this CPU: the key covers the CPU model as well as the source
    key = hashlib.sha256("\0".join([source, torch.__version__, *CFLAGS, _cpu_model()]).encode()).hexdigest()[:16]
    name = f"pagedserve_paged_attention_{key}"
    build = cache_dir() / name
    t0 = time.perf_counter()
    try:
        from torch.utils.cpp_extension import load

        build.mkdir(parents=True, exist_ok=True)
        load(name=name, sources=[str(SOURCE)], extra_cflags=CFLAGS, build_directory=str(build),
             is_python_module=False, verbose=False)
        kernel = torch.ops.pagedserve.paged_attention
    except Exception as e:  # no compiler, no ninja, a read-only cache...: slower, never wrong
        logger.warning("could not build the CPU paged-attention kernel (%s: %s); using the PyTorch reference "
                       "backend", type(e).__name__, str(e).strip().splitlines()[-1] if str(e).strip() else "")
        return None
    logger.info("CPU paged-attention kernel ready in %.1fs (%s)", time.perf_counter() - t0, build)
    return kernel


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("model name", "flags"))), "")
    except OSError:
        return ""


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

    def __init__(self, kernel=None, max_kernel_query_len: int = MAX_KERNEL_QUERY_LEN) -> None:
        self.kernel = kernel if kernel is not None else load_kernel()
        if self.kernel is None:
            raise RuntimeError("the CPU paged-attention kernel is not available")
        self.max_kernel_query_len = max_kernel_query_len
        self._plan: _StepPlan | None = None

    def _plan_for(self, meta: AttentionMetadata, num_kv_heads: int) -> _StepPlan:
        if self._plan is not None and self._plan.meta is meta:
            return self._plan
        slots, keep = meta.slot_mapping, None
        if bool((slots < 0).any()):
            keep = slots >= 0
            slots = slots[keep]
        lens = meta.query_lens_cpu
        n = next((b for b, q_len in enumerate(lens) if q_len > self.max_kernel_query_len), len(lens))
        rows = sum(lens[:n])
        items = sum(-(-q_len // QUERY_TILE) for q_len in lens[:n]) * num_kv_heads
        splits = num_splits(items, max(meta.seq_lens_cpu[:n], default=0), torch.get_num_threads())
        args = (meta.block_tables[:n], meta.seq_lens[:n], meta.query_start_loc[:n + 1])
        self._plan = _StepPlan(meta, slots, keep, n, rows, args, splits)
        return self._plan

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        plan = self._plan_for(meta, k_cache.shape[2])
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
