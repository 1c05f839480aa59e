"""Memory-allocator settings for serving on a CPU, applied when an engine is built (`tune`), never on import.

Transparent huge pages: torch's CPU allocator asks for them (madvise) on allocations of 2 MiB and more when
THP_MEM_ALLOC_ENABLE is set, and reads the variable once, at the first tensor the process allocates (of any
size). A decode step streams every weight, and with 4 KiB pages the hardware prefetcher stops at each page.
`tune` sets it for a process that has not allocated a tensor yet, which is why no module of ours makes one on
import (tests/test_allocator.py); a process that made tensors before building an engine keeps 4 KiB pages unless
it set the variable first, and `tune` logs a warning saying so. A value the user set is kept.

Freed blocks: glibc, left to itself, hands every such 2 MiB-aligned block back to the kernel when it is freed, so
each new one faults in (and zeroes) fresh pages: a prefill step's activations and logits paid for that on every
allocation. Fixed thresholds keep freed blocks in the heap for reuse, as jemalloc or tcmalloc would; blocks over
1 GiB (a KV cache) still come from mmap and go back on free. Figures: docs/performance.md.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os

logger = logging.getLogger(__name__)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
_KEEP_BYTES = 1 << 30


def use_huge_pages() -> None:
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


@functools.cache
def tune() -> bool:
    """Huge pages for torch's large CPU allocations, freed blocks kept for reuse; whether glibc took the latter.
    Says so in the log when torch had fixed its page setting already."""
    use_huge_pages()
    kept = _keep_freed_blocks()
    if torch_huge_pages() is False:
        logger.warning("this process made a torch tensor before the engine, with THP_MEM_ALLOC_ENABLE unset, so the "
                       "weights sit on 4 KiB pages and decode runs slower; set THP_MEM_ALLOC_ENABLE=1 before the "
                       "first tensor")
    return kept


def thp_mode() -> str | None:
    """The kernel's transparent-huge-page mode ("always", "madvise", "never"); None off Linux."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


def torch_huge_pages() -> bool | None:
    """Whether torch puts a large tensor on huge pages now (it reads THP_MEM_ALLOC_ENABLE at the process's first
    tensor); None where that cannot be told: not Linux, or transparent huge pages not in `madvise` mode (`always`
    gives them to every large allocation, `never` to none)."""
    if thp_mode() != "madvise":
        return None
    import torch

    probe = torch.empty(4 << 20, dtype=torch.uint8)  # over torch's 2 MiB threshold, whatever its alignment
    addr = probe.data_ptr()
    inside = False
    with open("/proc/self/smaps") as f:  # the mapping holding the probe: torch's madvise marks it eligible
        for line in f:
            head = line.split(maxsplit=1)[0] if line.strip() else ""
            if "-" in head and not head.endswith(":"):  # a mapping's first line, "start-end perms ..."
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= addr < hi
            elif inside and line.startswith("THPeligible:"):
                return line.split()[1] == "1"
    return None


@functools.cache
def _libc():
    """glibc, for its malloc tuning; None where it cannot be loaded."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c"))
    except (OSError, TypeError):
        return None


def release_freed() -> None:
    """Hand freed heap memory back to the kernel (glibc's malloc_trim): after loading, whose temporaries (raw
    blocks, unpacked codes) the kept-blocks setting would otherwise leave resident, and now and then while
    serving (engine/async_engine.py)."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


def _keep_freed_blocks() -> bool:
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:  # not glibc (musl, macOS): their allocators differ
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _KEEP_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, _KEEP_BYTES))
