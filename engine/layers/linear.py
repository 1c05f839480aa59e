"""Linear: y = x W^T (+ b), W dense or in any quantized format, run by the route its row count picks.

`select_kernels` reads the dispatch table (engine/layers/dispatch.py) once, after the weights are loaded: it lays
the weight out for the kernels it picks and keeps an ordered list of routes, each serving inputs of up to
`max_rows` rows; `forward` takes the first that fits (a decode step's few rows, a prefill chunk's many), and
`describe_routes` says which. Before `select_kernels` a Linear runs plain PyTorch, so it works unprepared.
Dense routes are chosen here: our GEMV, then oneDNN prepacked or F.linear. A quantized weight brings its own
(`QuantWeight.select_kernels`, engine/quant/: int8/int4 in our panels, torch's int kernels, or dequantize + GEMM),
so this module knows no format.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from .dispatch import KernelTable

if TYPE_CHECKING:
    from ..quant.weight import QuantWeight

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
            routes, b = self.qweight.select_kernels(table, device, dtype, self.row_int8), self.bias
            self.routes = tuple(routes if b is None else
                                (Route(r.max_rows, r.kernel, lambda x, run=r.run: run(x) + b) for r in routes))
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
