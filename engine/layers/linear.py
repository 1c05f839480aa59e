"""Linear: y = x W^T (+ b), W dense or in any quantized format, and every route a projection can take.

`select_kernels` reads the dispatch table (engine/layers/dispatch.py) once, after the weights are loaded: it lays
the weight out for the kernels it picks and keeps an ordered list of routes, each serving inputs of up to
`max_rows` rows; `forward` takes the first that fits (a decode step's few rows, a prefill chunk's many), and
`describe_routes` says which. Before `select_kernels` a Linear runs plain PyTorch, so it works unprepared.
The routes: dense (our GEMV; oneDNN prepacked or F.linear), int8/int4 in our panels (our GEMV; our GEMM: AMX-INT8
on int8 codes where the CPU has it, else bf16 tiles),
int8 rows without our kernels (torch's `_weight_int8pack_mm`; a GEMM on the codes), int4 in torch's layout (its
`_weight_int4pack_mm_for_cpu`), anything else (nf4, CUDA): dequantize, then a GEMM.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.engine.layers.dispatch import KernelTable
from pagedserve.engine.quant.int4 import Int4Weight
from pagedserve.engine.quant.int8 import Int8Weight
from pagedserve.engine.quant.nf4 import NF4Weight
from pagedserve.engine.quant.weight import GroupedWeight, QuantWeight

logger = logging.getLogger(__name__)

ANY = 1 << 62


@dataclass(frozen=True, slots=True)
class Route:
    max_rows: int
    kernel: str  # what it runs, for the log and the tests
    run: Callable[[torch.Tensor], torch.Tensor]
    # for a fused gate|up weight: SiLU(gate) * up in the same kernel, where it has that form
    gated: Callable[[torch.Tensor], torch.Tensor] | None = None


def gemm_rows(rows: int) -> int:
    """The rows a many-row GEMM runs at: oneDNN builds a kernel for each GEMM shape it meets and keeps it for the
    life of the process, so a server meeting every chunk length up to its token budget grew its heap by hundreds
    of MiB over its first minutes (docs/performance.md). Above 64 rows, rounded up to a multiple of 16 (an AMX
    tile's rows) below 512 and to 16 steps per doubling above, a projection meets a few dozen shapes, for at most
    1/16 more rows."""
    if rows <= 64:
        return rows
    step = 1 << max(4, rows.bit_length() - 5)
    return -(-rows // step) * step


def padded(run: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """`run` (a many-row route through oneDNN) at `gemm_rows` rows: zero rows added, their outputs dropped."""
    def go(x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        extra = gemm_rows(rows) - rows
        return run(x) if extra == 0 else run(F.pad(x, (0, 0, 0, extra)))[:rows]
    return go


class Linear(nn.Module):
    """x [rows, in_features] -> [rows, out_features]. Holds `weight` (dense) or `qweight` (quantized), not both.
    `row_int8`: whether a many-row GEMM may round x to int8 codes with one scale per row (the AMX route); the LM
    head says no, as its logits feed sampling and logprobs directly (docs/performance.md has what it cost)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, row_int8: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.row_int8 = row_int8
        self.weight: nn.Parameter | None = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.qweight: QuantWeight | None = None
        self.packed: torch.Tensor | None = None  # oneDNN's prepacked copy of the dense weight
        self.routes: tuple[Route, ...] = ()
        # this projection's operands for the fused decode layer (engine/csrc/decode_layer.cpp) and the most rows it
        # serves there; None where that layer has no kernel for it
        self.fused_operands: tuple[list[torch.Tensor], int] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        for route in self.routes:
            if rows <= route.max_rows:
                return route.run(x)
        if self.qweight is not None:
            y = self.qweight.dequantized_gemm(x)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)

    def gated(self, x: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """act(self(x)) for a fused gate|up projection and its SiLU(gate) * up: in one kernel where the route has
        that form (the AMX GEMM, whose products then never go to memory), else the projection, then `act`."""
        route = next((r for r in self.routes if x.shape[0] <= r.max_rows), None)
        if route is not None and route.gated is not None:
            return route.gated(x)
        return act(self(x))

    def quantize_to(self, qweight: QuantWeight) -> None:
        """Hold `qweight` instead of a dense weight (before the model is materialized: no dense copy is made)."""
        if qweight.shape != (self.out_features, self.in_features):
            raise ValueError(f"quantized weight {qweight.shape} for a {self.out_features}x{self.in_features} linear")
        self.weight = None
        self.qweight = qweight

    def select_kernels(self, table: KernelTable, device: torch.device, dtype: torch.dtype, *, prepack: bool = False,
                       keep_plain: bool = True) -> None:
        """Lay the weight out and fix the routes. `prepack`: make oneDNN's packed copy of a dense weight;
        `keep_plain`: keep the row-major one too (for our GEMV), else drop it."""
        ours = table.cpp and device.type == "cpu"
        if self.qweight is not None:
            self.routes = tuple(_quant_routes(self.qweight, self.bias, table, device, dtype, self.row_int8))
            ops = self.qweight.panel_operands() if ours else None
            self.fused_operands = None if ops is None else (ops + ([self.bias] if self.bias is not None else []),
                                                            table.quant_gemv_max_rows)
            return
        if prepack and self.packed is None:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)
            if not keep_plain:  # without the row-major copy every row count takes the packed route
                self.weight.data = self.weight.data.new_empty(0)
        w, b, packed = self.weight, self.bias, self.packed
        our_gemv = ours and w.numel() > 0  # our kernels, and the row-major weight they read is kept
        routes = [Route(table.dense_gemv_max_rows, "dense GEMV (ours)",
                        lambda x: torch.ops.pagedserve.dense_linear(x, w, b))] if our_gemv else []
        if packed is not None:
            routes.append(Route(ANY, "oneDNN, prepacked",
                                padded(lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], ""))))
        else:
            routes.append(Route(ANY, "F.linear", padded(lambda x: F.linear(x, w, b))))
        self.routes = tuple(routes)
        self.fused_operands = ([w] + ([b] if b is not None else []), table.fused_decode_max_rows) if our_gemv else None

    def describe_routes(self) -> str:
        out, low = [], 1
        for r in self.routes:
            out.append(f"rows {low}+: {r.kernel}" if r.max_rows >= ANY else f"rows {low}-{r.max_rows}: {r.kernel}")
            low = r.max_rows + 1
        return "; ".join(out) or "not prepared: PyTorch"

    def extra_repr(self) -> str:
        fmt = self.qweight.format if self.qweight is not None else "dense"
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, format={fmt}"


def lay_out_int8(w: Int8Weight, table: KernelTable, device: torch.device) -> None:
    """Panels where our kernels serve the matrix (a shared embedding/LM head storage is laid out once)."""
    w.lay_out(device, panels=table.cpp and device.type == "cpu" and w.panels_fit())


def _quant_routes(w: QuantWeight, bias: torch.Tensor | None, table: KernelTable, device: torch.device,
                  dtype: torch.dtype, row_int8: bool) -> list[Route]:
    cpu = device.type == "cpu"
    torch_dtype = torch.bfloat16 if table.torch_int_bf16 else dtype
    if isinstance(w, Int8Weight):
        lay_out_int8(w, table, device)
    elif isinstance(w, Int4Weight):
        if cpu and table.cpp and w.panels_fit():
            w.lay_out(device, "panels")
        elif cpu and w.torch_kernel_group():
            w.lay_out(device, "torch", torch_dtype)
        else:
            w.lay_out(device, "codes")
    else:
        assert isinstance(w, NF4Weight), type(w)
        w.lay_out(device)
    if w.layout == "panels":
        routes = [Route(table.quant_gemv_max_rows, f"{w.kind} GEMV (ours)", w.gemv), _panel_gemm(w, table, row_int8)]
    elif w.layout == "torch":
        routes = [Route(ANY, "torch _weight_int4pack_mm_for_cpu", padded(w.torch_matmul))]
    elif w.layout == "rows" and w.row_scale is not None:
        routes = [Route(ANY, "GEMM on the int8 codes", padded(w.codes_gemm))]
        if cpu:
            routes.insert(0, Route(table.torch_int8_max_rows, "torch _weight_int8pack_mm",
                                   lambda x: w.torch_gemv(x, torch.bfloat16 if x.dtype == torch.bfloat16
                                                          else torch_dtype)))
    else:  # nf4, int4 codes, int8 rows with group-wise scales (no kernel of torch's takes them)
        routes = [Route(ANY, "dequantize + GEMM", padded(w.dequantized_gemm))]
    if bias is None:
        return routes
    return [Route(r.max_rows, r.kernel, lambda x, run=r.run: run(x) + bias) for r in routes]


def _panel_gemm(w: GroupedWeight, table: KernelTable, row_int8: bool) -> Route:
    """The many-row route of a weight in our panels: AMX-INT8 where the table says so (K in whole tiles, the matrix
    large enough)."""
    n, k = w.shape
    if table.quant_gemm_amx and row_int8 and k % 64 == 0 and n * k >= table.quant_gemm_amx_min_weights:
        if w.column_max is None:
            w.column_max = w.column_absmax()
        # no padding: our kernel keeps nothing per shape
        gated = (lambda x: w.amx_gemm(x, silu_mul=True)) if n % 32 == 0 else None  # gate, up: whole panels
        return Route(ANY, f"{w.kind} AMX-INT8 GEMM (ours)", w.amx_gemm, gated)
    return Route(ANY, f"{w.kind} tiled GEMM (ours)", padded(w.gemm))


def _shared_weights(model: nn.Module) -> set[int]:
    """ids of parameters held by more than one module (a tied LM head's weight is the embedding's)."""
    holders = Counter(id(p) for m in model.modules() for p in m.parameters(recurse=False))
    return {k for k, n in holders.items() if n > 1}


def plain_copy_fits(model: nn.Module, table: KernelTable, shared: set[int]) -> bool:
    """Whether keeping each projection's row-major weight beside its prepacked copy (for our GEMV at a few rows)
    costs at most `plain_copy_max_fraction` of physical memory (a tied LM head's is the embedding's anyway)."""
    if not table.cpp:  # no GEMV to read the copy
        return False
    extra = sum(m.weight.numel() * m.weight.element_size() for m in model.modules()
                if isinstance(m, Linear) and m.weight is not None and id(m.weight) not in shared)
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return False
    return extra <= table.plain_copy_max_fraction * total


def select_kernels(model: nn.Module, table: KernelTable, device: torch.device, dtype: torch.dtype) -> None:
    """Fix every layer's kernels for this table (after the weights are loaded, before the first step)."""
    prepack = device.type == "cpu" and table.prepacks(dtype)
    shared = _shared_weights(model)
    keep_plain = prepack and plain_copy_fits(model, table, shared)
    for m in model.modules():
        if isinstance(m, Linear):
            tied = m.weight is not None and id(m.weight) in shared
            m.select_kernels(table, device, dtype, prepack=prepack, keep_plain=keep_plain or tied)
        elif m is not model and hasattr(m, "select_kernels"):
            m.select_kernels(table, device)
    if prepack:
        logger.info("%s projections prepacked for oneDNN%s", str(dtype).removeprefix("torch."),
                    " (row-major copies kept for the few-row GEMV)" if keep_plain else
                    f"; no row-major copies (over {table.plain_copy_max_fraction:.0%} of memory), so the GEMV "
                    "serves only a tied LM head")
