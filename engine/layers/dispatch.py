"""The dispatch table: every kernel choice the layers make, stated once, with the measurement behind it.

Layers read the table once, when the model is built (`select_kernels`), and keep the routes they chose, so the
same machine, flags and options always compute the same way. Three entries depend on timings that differ between
CPUs with the same flags: start-up probes measure them once per machine, cache them with their inputs (CPU model,
flags, torch version) in the cache directory and log them; `--kernel-policy NAME=VALUE,...` (or
PAGEDSERVE_KERNEL_POLICY, which the test suite sets) pins any entry. docs/performance.md has the figures.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .. import cpu_kernels
from ..machine import cache_dir, cpu

logger = logging.getLogger(__name__)

POLICY_ENV = "PAGEDSERVE_KERNEL_POLICY"
PROBE_VERSION = 1  # bump when a probe's shapes or rule change: cached results are then measured again


@dataclass(frozen=True)
class KernelTable:
    """Each entry: what it decides, and what set it (a benchmark under benchmarks/kernels/, a probe, a flag)."""

    # our C++ kernels (engine/csrc) at all, else PyTorch's ops everywhere: whether they built (cpu_kernels.py)
    cpp: bool = False
    # `--dtype auto` on a CPU is bf16: native bf16 in the flags and a >= 1.15x GEMM win (probe_bf16_speedup)
    auto_bf16: bool = False
    # dense projections of up to this many rows: our GEMV on the row-major weight (bench_dense_linear.py)
    dense_gemv_max_rows: int = 2
    # dense bf16 above that: oneDNN on a prepacked weight, where bf16 is native (bench_dense_linear.py)
    prepack_bf16: bool = False
    # dense fp32 above that: oneDNN prepacked rather than F.linear's BLAS (probe_prepack_fp32)
    prepack_fp32: bool = False
    # keep the row-major weight beside the prepacked one while it costs at most this share of memory
    plain_copy_max_fraction: float = 0.10
    # decode steps of up to this many rows run each layer as one C++ call, dense projections
    # (bench_fused_decode.py); quantized ones up to quant_gemv_max_rows
    fused_decode_max_rows: int = 8
    # int8/int4 in our panels: our GEMV up to this many rows, our tiled GEMM above (bench_quant_linear.py)
    quant_gemv_max_rows: int = 64
    # ... and that GEMM on int8 codes of activations and weights instead of bf16 tiles: on AMX-INT8 where the CPU
    # and the build have AMX, else on AVX512-VNNI where it measured faster than the bf16 tiles
    # (probe_quant_gemm_vnni; bench_quant_gemm.py; quality: `pagedserve eval`, docs/performance.md)
    quant_gemm_amx: bool = False
    quant_gemm_vnni: bool = False
    # ... for projections of at least this many weights: at SmolLM2-135M's sizes the per-call costs (column maxima,
    # re-quantization) outweigh the faster GEMM (bench_quant_gemm.py --model 135m)
    quant_gemm_int8_min_weights: int = 1 << 21
    # without our kernels: torch's `_weight_int8pack_mm` up to this many rows, a GEMM on the codes above
    torch_int8_max_rows: int = 8
    # without our kernels, fp32 models: torch's packed int kernels run in bf16 (probe_torch_int_bf16)
    torch_int_bf16: bool = False
    # CPU attention: chunks of up to this many query tokens in our paged kernel, longer ones in SDPA
    # (bench_cpu_attention.py) ...
    attention_kernel_max_query: int = 16
    # ... but every chunk in our kernel for bf16 with AVX512-BF16 and no AMX (its vdpbf16ps path beat SDPA)
    attention_kernel_bf16_all: bool = False

    def attention_query_limit(self, dtype: torch.dtype) -> int:
        """Longest chunk (query tokens) the CPU paged-attention kernel takes for this dtype."""
        return 1 << 62 if dtype == torch.bfloat16 and self.attention_kernel_bf16_all else \
            self.attention_kernel_max_query

    def prepacks(self, dtype: torch.dtype) -> bool:
        return self.prepack_bf16 if dtype == torch.bfloat16 else dtype == torch.float32 and self.prepack_fp32


class CppLayer(nn.Module):
    """A layer with a C++ form (engine/csrc/layer_ops.cpp), which it runs where the table says our kernels do."""

    cpp = False

    def select_kernels(self, table: KernelTable, device: torch.device) -> None:
        self.cpp = table.cpp and device.type == "cpu"


def parse_policy(text: str | None) -> dict[str, Any]:
    """`name=value,...` (values: integers, numbers, 1/0/true/false/on/off) -> overrides of KernelTable fields."""
    out: dict[str, Any] = {}
    types = {f.name: f.type for f in dataclasses.fields(KernelTable)}
    for item in filter(None, (s.strip() for s in (text or "").split(","))):
        name, sep, value = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or name not in types:
            raise ValueError(f"kernel policy: {item!r} is not NAME=VALUE with NAME one of {', '.join(types)}")
        value = value.strip().lower()
        if types[name] in ("bool", bool):
            if value not in ("1", "0", "true", "false", "on", "off", "yes", "no"):
                raise ValueError(f"kernel policy: {name} takes on/off, got {value!r}")
            out[name] = value in ("1", "true", "on", "yes")
        else:
            kind = float if types[name] in ("float", float) else int
            try:
                out[name] = kind(value)
            except ValueError:
                raise ValueError(f"kernel policy: {name} takes {'a number' if kind is float else 'an integer'}, got "
                                 f"{value!r}") from None
    return out


def kernel_table(device: torch.device, dtype: torch.dtype | None = None, policy: str | None = None) -> KernelTable:
    """The table for a model on `device` in `dtype` (None: before the dtype is known, as `auto` asks). Probes run
    only where their answer matters here; `policy` (else $PAGEDSERVE_KERNEL_POLICY) pins any entry."""
    pinned = parse_policy(os.environ.get(POLICY_ENV)) | parse_policy(policy)
    if device.type != "cpu":  # CUDA: our CPU kernels and oneDNN play no part
        return dataclasses.replace(KernelTable(), **{k: v for k, v in pinned.items() if k != "cpp"})
    machine = cpu()
    cpp = pinned["cpp"] if "cpp" in pinned else cpu_kernels.load()
    if cpp and not cpu_kernels.load():
        raise ValueError("kernel policy cpp=on, but the C++ kernels did not build")
    if pinned.get("quant_gemm_amx") and not (cpp and cpu_kernels.amx_int8()):
        raise ValueError("kernel policy quant_gemm_amx=on, but this CPU or build has no AMX-INT8")
    if pinned.get("quant_gemm_vnni") and not (cpp and cpu_kernels.vnni_int8()):
        raise ValueError("kernel policy quant_gemm_vnni=on, but this CPU or build has no AVX512-VNNI")

    def decide(name: str, applies: bool, probe: Callable[[], tuple[bool, str]]) -> bool:
        if name in pinned:
            return pinned[name]
        return applies and measured(name, probe)

    fp32 = dtype == torch.float32
    amx = pinned.get("quant_gemm_amx", cpp and cpu_kernels.amx_int8())
    vnni = cpp and "avx512_vnni" in (machine.flags or ()) and cpu_kernels.vnni_int8()  # asked for a model's table
    table = KernelTable(
        cpp=cpp,
        auto_bf16=decide("auto_bf16", dtype is None and (machine.native_bf16 or not machine.is_x86),
                         probe_bf16_speedup),
        prepack_bf16=machine.native_bf16,
        prepack_fp32=decide("prepack_fp32", fp32, probe_prepack_fp32),
        torch_int_bf16=decide("torch_int_bf16", fp32 and not cpp, probe_torch_int_bf16),
        attention_kernel_bf16_all="avx512_bf16" in (machine.flags or ()) and not machine.amx,
        quant_gemm_amx=amx,
        quant_gemm_vnni=decide("quant_gemm_vnni", dtype is not None and vnni and not amx, probe_quant_gemm_vnni),
    )
    return dataclasses.replace(table, **pinned)


def auto_dtype(device: torch.device, policy: str | None = None) -> torch.dtype:
    """What `--dtype auto` means: bf16 on CUDA where supported (else fp16); on a CPU, bf16 only where the flags
    say native bf16 and the probe measured it faster (emulated bf16 runs at a fraction of fp32's speed)."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type != "cpu":
        return torch.float32
    return torch.bfloat16 if kernel_table(device, None, policy).auto_bf16 else torch.float32


# ---- probes: measured once per machine, cached ---------------------------------------------------------
# bf16 must beat fp32 by this factor: a tie keeps fp32's extra precision
BF16_MIN_SPEEDUP = 1.15
# (M, K, N): a 64-row batch through a SmolLM2-sized projection, big enough to time
BF16_PROBE_SHAPE = (64, 576, 1536)
# fp32 projections are prepacked where that beats F.linear by this factor (the reorder and, with the row-major
# copy kept for our GEMV, twice the weight bytes are its cost)
PACK_MIN_SPEEDUP = 1.1
PACK_PROBE_SHAPES = ((4, 576, 3072), (256, 576, 1536))  # a decode-sized and a prefill-sized GEMM
TORCH_INT_MIN_SPEEDUP = 1.5
# the VNNI int8 GEMM must beat the bf16-tile GEMM by this factor (its activations lose precision to int8 codes)
VNNI_MIN_SPEEDUP = 1.2
VNNI_PROBE_SHAPE = (256, 1024, 1024)  # (M, K, N): a prefill chunk through a 1B-sized projection


def _machine_key() -> str:
    m = cpu()
    text = f"{m.model}|{' '.join(sorted(m.flags or ()))}|{m.arch}|{torch.__version__}|{PROBE_VERSION}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _probe_file():
    return cache_dir() / "probes.json"


def _read_probes() -> dict[str, Any]:
    """Every machine's cached probes, by machine key ({} where there is no readable cache)."""
    try:
        return json.loads(_probe_file().read_text())
    except (OSError, ValueError):
        return {}


@functools.cache
def _cached_probes() -> dict[str, Any]:
    return _read_probes().get(_machine_key(), {})


def measured(name: str, probe: Callable[[], tuple[bool, str]]) -> bool:
    """The probe's cached answer on this machine, or a fresh measurement (then cached and logged)."""
    cached = _cached_probes().get(name)
    if cached is not None:
        logger.info("kernel table: %s=%s (measured on this machine %s: %s; pin with --kernel-policy)",
                    name, cached["value"], cached["when"], cached["detail"])
        return bool(cached["value"])
    value, detail = probe()
    when = datetime.date.today().isoformat()
    _cached_probes()[name] = {"value": value, "detail": detail, "when": when}
    logger.info("kernel table: %s=%s (measured now: %s; cached in %s)", name, value, detail, _probe_file())
    try:  # merge with what other processes wrote meanwhile; a read-only cache only costs a probe next time
        path = _probe_file()
        path.parent.mkdir(parents=True, exist_ok=True)
        everything = _read_probes()
        everything.setdefault(_machine_key(), {})[name] = _cached_probes()[name]
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(everything, indent=1))
        os.replace(tmp, path)
    except OSError as e:
        logger.info("probe cache not written: %s", e)
    return value


def time_gemm(dtype: torch.dtype, shape: tuple[int, int, int], reps: int = 9, packed: bool = False) -> float:
    """Median ms of one [M, K] x [K, N] matmul on one thread (one core's rate; steady under load): F.linear, or
    with `packed` oneDNN's linear on a prepacked weight (what dense layers run when the table says prepack)."""
    m, k, n = shape
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).to(dtype)
    if packed:
        wp = torch.ops.mkldnn._reorder_linear_weight(w, None)
        return _median_ms(lambda: torch.ops.mkldnn._linear_pointwise(x, wp, None, "none", [], ""), reps)
    return _median_ms(lambda: torch.nn.functional.linear(x, w), reps)


def _median_ms(fn: Callable[[], Any], reps: int) -> float:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(2):
            fn()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    finally:
        torch.set_num_threads(threads)
    return sorted(times)[reps // 2] * 1e3


def probe_bf16_speedup(timer: Callable[[torch.dtype], float] | None = None) -> tuple[bool, str]:
    """bf16 against fp32 on a model-shaped GEMM. oneDNN "supports" bf16 on any AVX-512 CPU but emulates it
    without AVX512-BF16/AMX, so the table only asks where the flags say native bf16 (or cannot be read)."""
    timer = timer or (lambda dtype: time_gemm(dtype, BF16_PROBE_SHAPE))
    fp32_ms, bf16_ms = timer(torch.float32), timer(torch.bfloat16)
    detail = f"GEMM {BF16_PROBE_SHAPE}: fp32 {fp32_ms:.3f} ms, bf16 {bf16_ms:.3f} ms"
    return bf16_ms * BF16_MIN_SPEEDUP <= fp32_ms, detail


def probe_prepack_fp32(timer: Callable[[bool], float] | None = None) -> tuple[bool, str]:
    """fp32 F.linear (the BLAS torch was built with: MKL on x86) against oneDNN's prepacked GEMM. Which wins
    depends on the CPU's vendor and on the row count, so it is measured here rather than assumed (figures in
    docs/performance.md, "prepack_fp32")."""
    timer = timer or (lambda packed: sum(time_gemm(torch.float32, s, packed=packed) for s in PACK_PROBE_SHAPES))
    try:
        plain_ms, packed_ms = timer(False), timer(True)
    except RuntimeError as e:  # a torch built without oneDNN
        return False, f"no oneDNN linear ({e})"
    detail = f"fp32 GEMMs {PACK_PROBE_SHAPES}: F.linear {plain_ms:.3f} ms, oneDNN prepacked {packed_ms:.3f} ms"
    return packed_ms * PACK_MIN_SPEEDUP <= plain_ms, detail


def probe_torch_int_bf16() -> tuple[bool, str]:
    """torch's packed int4 CPU kernel at M = 1 on a SmolLM2 shape, fp32 against bf16 activations."""
    n, k = 1536, 576
    gen = torch.Generator().manual_seed(0)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        torch.randint(0, 16, (n, k), dtype=torch.int32, generator=gen), 1)
    sz = torch.rand(k // 64, n, 2, generator=gen)

    def run(dtype: torch.dtype) -> float:
        x = torch.ones(1, k, dtype=dtype)
        return _median_ms(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 64, sz.to(dtype)), 7)

    fp32_ms, bf16_ms = run(torch.float32), run(torch.bfloat16)
    detail = f"torch int4 kernel, M = 1: fp32 activations {fp32_ms:.3f} ms, bf16 {bf16_ms:.3f} ms"
    return bf16_ms * TORCH_INT_MIN_SPEEDUP <= fp32_ms, detail


def probe_quant_gemm_vnni(timer: Callable[[bool], float] | None = None) -> tuple[bool, str]:
    """Our int4 panels' many-row GEMM on VNNI int8 codes against bf16 tiles (fp32 where bf16 is not native).
    How fast vpdpbusd runs against the bf16 units differs between CPUs with the same flags (one 512-bit unit or
    two, or 256-bit halves), so it is measured."""
    from ..quant.layouts import rows_to_panels, to_panels

    m, k, n = VNNI_PROBE_SHAPE
    gen = torch.Generator().manual_seed(0)
    codes = to_panels(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen))
    scale = rows_to_panels((torch.rand(n, k // 32, generator=gen) * 1e-3).half())
    bias = rows_to_panels((torch.randn(n, k // 32, generator=gen) * 1e-3).half())
    dtype = torch.bfloat16 if cpu().native_bf16 else torch.float32
    x = torch.randn(m, k, generator=gen).to(dtype)
    ops = torch.ops.pagedserve
    wmax = ops.panel_column_absmax(codes, scale, bias, None, None, 4, k)
    timer = timer or (lambda vnni: _median_ms(
        (lambda: ops.int4_int8_gemm(x, codes, scale, bias, None, None, wmax)) if vnni else
        (lambda: ops.int4_gemm(x, codes, scale, bias)), 5))
    tiles_ms, vnni_ms = timer(False), timer(True)
    detail = f"int4 GEMM {VNNI_PROBE_SHAPE}: {dtype} tiles {tiles_ms:.3f} ms, VNNI int8 {vnni_ms:.3f} ms"
    return vnni_ms * VNNI_MIN_SPEEDUP <= tiles_ms, detail
