"""engine.allocator: huge pages for big CPU tensors, and freed blocks reused instead of faulted in again."""

import platform
import resource

import pytest
import torch

from engine import allocator


def faults_for_reallocating(nbytes: int, times: int) -> int:
    for _ in range(2):  # the first ones may fault in (and start the thread pool)
        torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(times):
        torch.empty(nbytes, dtype=torch.uint8).fill_(1)  # allocated, touched, freed
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt thresholds are glibc's")
def test_freed_big_blocks_are_reused_without_page_faults():
    assert allocator.KEEPS_FREED_BLOCKS
    # 8 MiB x 20 is 2,560 4-KiB pages (or 80 huge ones) if each block came fresh from the kernel
    faults = faults_for_reallocating(8 << 20, 20)
    assert faults < 40, f"{faults} page faults"  # without the thresholds: ~10,000 measured
