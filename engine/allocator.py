"""Transparent huge pages for torch's CPU allocations, set before anything large is allocated.

torch's CPU allocator asks for transparent huge pages (madvise) on allocations of 2 MiB and more when
THP_MEM_ALLOC_ENABLE is set, and reads it at its first such allocation, so this runs as engine's first import
(importing transformers already allocates that much). A decode step streams every weight, and with 4 KiB pages
the hardware prefetcher stops at each page: bf16 SmolLM2 at batch 1 on Sapphire Rapids, the 56 MiB LM head took
2.3 ms instead of 3.0 and the step 15.3-15.7 ms instead of 16.1. A value the user set is kept.

glibc, left to itself, hands every such 2 MiB-aligned block back to the kernel when it is freed, so each new
one faults in (and zeroes) fresh huge pages: a prefill step's activations and logits paid 1-5 ms per
allocation of a few MiB (Zen 4; 0.04 ms with this). Fixed thresholds keep freed blocks in the heap for reuse, as
jemalloc or tcmalloc would; blocks over 1 GiB (a KV cache) still come from mmap and go back on free.
"""

import ctypes
import ctypes.util
import os

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
_KEEP_BYTES = 1 << 30


def _keep_freed_blocks() -> bool:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS): their allocators differ
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _KEEP_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, _KEEP_BYTES))


KEEPS_FREED_BLOCKS = _keep_freed_blocks()
