"""Which dtype `auto` means on this CPU: bf16 only where the hardware runs it natively and faster.

oneDNN reports bf16 "support" on any AVX-512 CPU, but without AVX512_BF16 or AMX it emulates bf16
matmuls at a fraction of fp32 speed (measured 62 vs 305 GFLOP/s; a B=64 decode step 5.8 s vs 1.8 s).
So: no native bf16 in the CPU flags -> fp32, no measurement needed. Native flags, or a CPU whose
flags we cannot read (not Linux, not x86) -> time one model-shaped GEMM in both dtypes and keep the
faster. Decided once per process and logged with the reason.
"""

from __future__ import annotations

import functools
import logging
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # x86; aarch64 lists "bf16" among its Features
# bf16 must beat fp32 by this factor: a tie keeps fp32's extra precision
BF16_MIN_SPEEDUP = 1.15
# (M, K, N): a 64-row batch through a SmolLM2-sized projection; big enough to time, ~1 ms in fp32
PROBE_SHAPE = (64, 576, 1536)


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    reason: str


def read_cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str] | None:
    """The first CPU's feature flags, or None where they cannot be read (not Linux)."""
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return None


def is_x86(flags: frozenset[str]) -> bool:
    return "sse2" in flags or "avx2" in flags


def has_native_bf16(flags: frozenset[str]) -> bool:
    if is_x86(flags):
        return any(f in flags for f in NATIVE_BF16_FLAGS)
    return "bf16" in flags


def time_gemm(dtype: torch.dtype, shape: tuple[int, int, int] = PROBE_SHAPE, reps: int = 9,
              packed: bool = False) -> float:
    """Median ms of one [M, K] x [K, N] matmul on one thread (one core's rate; steady under load): F.linear, or
    with `packed` oneDNN's linear on a prepacked weight (what engine.models.llama.Linear.pack sets up)."""
    m, k, n = shape
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).to(dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if packed:
            wp = torch.ops.mkldnn._reorder_linear_weight(w, None)

            def run() -> None:
                torch.ops.mkldnn._linear_pointwise(x, wp, None, "none", [], "")
        else:
            def run() -> None:
                F.linear(x, w)
        for _ in range(2):
            run()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            run()
            times.append(time.perf_counter() - t)
    finally:
        torch.set_num_threads(threads)
    return sorted(times)[reps // 2] * 1e3


def choose_cpu_dtype(flags: frozenset[str] | None,
                     timer: Callable[[torch.dtype], float] = time_gemm) -> DtypeChoice:
    """The decision, with flags and the GEMM timer injectable (tests)."""
    if flags is not None and is_x86(flags) and not has_native_bf16(flags):
        return DtypeChoice(torch.float32, "no AVX512_BF16/AMX in the CPU flags: bf16 matmuls would be emulated")
    fp32_ms, bf16_ms = timer(torch.float32), timer(torch.bfloat16)
    why = "native bf16 in the CPU flags" if flags is not None else "CPU flags unknown"
    timing = f"GEMM {PROBE_SHAPE}: fp32 {fp32_ms:.3f} ms, bf16 {bf16_ms:.3f} ms"
    if bf16_ms * BF16_MIN_SPEEDUP <= fp32_ms:
        return DtypeChoice(torch.bfloat16, f"{why}; {timing}: bf16 is {fp32_ms / bf16_ms:.1f}x faster")
    return DtypeChoice(torch.float32, f"{why}, but {timing}: bf16 is not >= {BF16_MIN_SPEEDUP}x faster")


@functools.cache
def auto_cpu_dtype() -> DtypeChoice:
    choice = choose_cpu_dtype(read_cpu_flags())
    logger.info("dtype=auto on this CPU (%s): %s, because %s", platform.machine(), choice.dtype, choice.reason)
    return choice


# fp32 projections are prepacked for oneDNN where that beats F.linear by this factor (the packed copy costs a
# reorder at load and, with our GEMV's row-major copy kept, twice the weight memory)
PACK_MIN_SPEEDUP = 1.1


# a decode-sized and a prefill-sized GEMM, timed together (M, K, N)
PACK_PROBE_SHAPES = ((4, 576, 3072), (256, 576, 1536))


def _time_probes(packed: bool) -> float:
    return sum(time_gemm(torch.float32, shape, packed=packed) for shape in PACK_PROBE_SHAPES)


def choose_fp32_packing(timer: Callable[[bool], float] = _time_probes) -> tuple[bool, str]:
    """Whether fp32 weights should be prepacked for oneDNN, and why. F.linear's fp32 GEMM is the BLAS torch was
    built with (MKL on x86), fast on Intel CPUs; on AMD ones (Zen 4, torch 2.13) oneDNN's packed GEMM was
    1.1-1.5x faster at 64-2,048 rows and 2-8x at 2-16 (SmolLM2's LM head at 3 rows: 31 -> 4 ms). So: measure
    (the probes there: 5.7 ms F.linear, 4.5 ms packed)."""
    plain_ms, packed_ms = timer(False), timer(True)
    timing = f"fp32 GEMMs {PACK_PROBE_SHAPES}: F.linear {plain_ms:.3f} ms, oneDNN prepacked {packed_ms:.3f} ms"
    return packed_ms * PACK_MIN_SPEEDUP <= plain_ms, timing


@functools.cache
def cpu_packs_fp32() -> bool:
    try:
        pack, timing = choose_fp32_packing()
    except RuntimeError as e:  # a torch built without oneDNN
        pack, timing = False, f"no oneDNN linear ({e})"
    logger.info("fp32 projections %s: %s", "prepacked for oneDNN" if pack else "kept for F.linear", timing)
    return pack


def cpu_has_native_bf16() -> bool:
    flags = read_cpu_flags()
    return flags is not None and has_native_bf16(flags)
