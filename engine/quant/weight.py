"""The interface every quantized weight format implements: storage, its reference, its layouts and its routes.

A format stores rows (output features) independently, so fused projections are row concatenations and
llama.cpp's q/k row permutation applies to codes and scales alike. A format brings its own forward, as vLLM's
`quant_method.apply` does: `select_kernels` lays the codes out for the kernels the dispatch table
(engine/layers/dispatch.py, where every threshold lives) grants this format on this device, and returns the routes
through them; the `Linear` holding it runs them and knows no format.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..layers.linear import ANY, Route, padded
from .layouts import rows_to_panels, value_rows

if TYPE_CHECKING:
    from ..layers.dispatch import KernelTable


class QuantWeight(ABC):
    """One quantized [N, K] weight."""

    format: str
    shape: tuple[int, int]
    layout: str | None = None  # set by `lay_out`: which kernels' layout the codes are in

    @abstractmethod
    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The reference: the dense [N, K] matrix this storage represents."""

    @abstractmethod
    def tensors(self) -> list[torch.Tensor]:
        """Every tensor held (what resident memory is made of)."""

    @abstractmethod
    def storage_bits(self) -> int:
        """Bits a file would need: codes plus scales at the width the format defines."""

    @classmethod
    @abstractmethod
    def cat(cls, parts: list[QuantWeight]) -> QuantWeight:
        """Row-concatenate (fused q|k|v, gate|up) before it is laid out."""

    def narrow(self, dim: int, start: int, length: int) -> QuantWeight:
        """Rows (dim 0) or columns (dim 1) start..start+length as storage of the same format: a tensor-parallel
        rank's shard, taken before `lay_out`. Columns are cut along the format's groups, so the shard holds
        exactly the values the whole matrix does."""
        raise ValueError(f"{self.format} weights cannot be split for tensor parallelism")

    @abstractmethod
    def select_kernels(self, table: KernelTable, device: torch.device, dtype: torch.dtype,
                       row_int8: bool = True) -> list[Route]:
        """Lay the storage out on `device` for the kernels `table` grants it, and return the routes a `Linear`
        takes through them, each serving inputs of up to its `max_rows` rows (the Linear adds its bias). Once: a
        storage already laid out (an embedding's, which a tied LM head shares) keeps its layout. `dtype`: the
        model's; `row_int8`: whether a many-row GEMM may round the activations to int8 codes per row (the AMX
        route; the LM head says no)."""

    def panel_operands(self) -> list[torch.Tensor] | None:
        """What our C++ GEMV (and the fused decode layer) takes, where the format is laid out for it."""
        return None

    def dequantized_gemm(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T through the dense matrix: the kernel every format has."""
        return F.linear(x, self.dequantize(x.dtype))

    def dequantized_routes(self) -> list[Route]:
        """The route every format has: dequantize, then a GEMM."""
        return [Route(ANY, "dequantize + GEMM", padded(self.dequantized_gemm))]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    @property
    def bits_per_weight(self) -> float:
        return self.storage_bits() / (self.shape[0] * self.shape[1])


VALUES = ("scale", "bias", "scale_d", "bias_d")  # the per-group tensors, laid out beside the codes


class GroupedWeight(QuantWeight):
    """Codes times per-group values, w = c * scale + bias per group along K (int4.py, int8.py). A scale or bias
    held as 8-bit codes comes with its fp16 factor per super-block (`scale_d`, `bias_d` [N, G / per]). In "panels"
    both formats run the same family of our C++ kernels, named by the code width: int4_*, int6_*, int8_*."""

    kind: str  # "int4" or "int8": the storage, whatever the format's name
    row_major: str  # the name of its row-major layout, beside "panels"
    codes: torch.Tensor
    code_bits: int
    scale: torch.Tensor | None
    bias: torch.Tensor | None  # None: symmetric
    scale_d: torch.Tensor | None
    bias_d: torch.Tensor | None
    symmetric: bool
    column_max: torch.Tensor | None = None  # for the AMX GEMM's smoothing

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 scale_d: torch.Tensor | None, bias_d: torch.Tensor | None, fmt: str, k: int,
                 group: int | None = None) -> None:
        """[N, k] weights: `codes` and `scale` [N, G] as the format holds them; `group` (default k / G) along K."""
        self.codes, self.scale, self.bias, self.scale_d, self.bias_d = codes, scale, bias, scale_d, bias_d
        self.symmetric = bias is None
        self.format = fmt
        self.shape = (codes.shape[0], k)
        self.group = group or k // scale.shape[1]

    def values(self) -> list[torch.Tensor | None]:
        """scale, bias, scale_d, bias_d, in the layout held (None where absent)."""
        return [self.scale, self.bias, self.scale_d, self.bias_d]

    def _scale_bias(self, rows: torch.Tensor | slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor | None]:
        """fp32 [R, G] scale and bias (None where there is none) of `rows`, whichever layout is held."""
        scale, bias, scale_d, bias_d = (value_rows(v, rows, self.shape[0], self.layout == "panels")
                                        for v in self.values())
        return group_values(scale, scale_d), None if bias is None else group_values(bias, bias_d)

    def _dense(self, codes: torch.Tensor, rows: torch.Tensor | slice, dtype: torch.dtype) -> torch.Tensor:
        """Dequantized row-major codes [R, K] of rows `rows`."""
        scale, bias = self._scale_bias(rows)
        n, k = codes.shape
        w = codes.float().view(n, -1, k // scale.shape[1]) * scale[:, :, None]
        if bias is not None:
            w = w + bias[:, :, None]
        return w.view(n, k).to(dtype)

    def _move_to(self, device: torch.device) -> None:
        """Codes and per-group values to `device`, as they are."""
        self.codes = self.codes.to(device)
        self.scale, self.bias, self.scale_d, self.bias_d = (None if v is None else v.to(device) for v in self.values())

    def _values_to_panels(self) -> None:
        """The per-group values as [N/16, G, 16], one row's beside its codes (a per-tensor scale spelled out)."""
        self.scale = self.scale.expand(self.shape[0], -1)
        self.scale, self.bias, self.scale_d, self.bias_d = (None if v is None else rows_to_panels(v)
                                                            for v in self.values())

    @abstractmethod
    def panels_fit(self) -> bool:
        """Whether our kernels' panels can hold this matrix (its rows, groups and code width)."""

    @abstractmethod
    def lay_out(self, device: torch.device, layout: str) -> None:
        """Move to `device` in `layout` ("panels" or `row_major`, and whatever else the format has). Once: a tied
        embedding and LM head share the storage."""

    def our_kernels(self, table: KernelTable, device: torch.device) -> bool:
        """Whether our kernels serve this matrix here: they built, it is on a CPU, and their panels hold it."""
        return table.cpp and device.type == "cpu" and self.panels_fit()

    def lay_out_rows(self, table: KernelTable, device: torch.device) -> None:
        """The layout for a row lookup (an embedding; a tied LM head then takes its routes over this storage as it
        is): our panels where our kernels serve it, else row-major."""
        self.lay_out(device, "panels" if self.our_kernels(table, device) else self.row_major)

    def panel_routes(self, table: KernelTable, row_int8: bool) -> list[Route]:
        """In our panels: our GEMV for a few rows, then our GEMM: on int8 codes of both sides (AMX tiles, else VNNI
        registers) where the table says so, K is in whole tiles and the matrix is large enough, else on bf16 tiles."""
        n, k = self.shape
        gemv = Route(table.quant_gemv_max_rows, f"{self.kind} GEMV (ours)", self.gemv)
        engine = "AMX-INT8" if table.quant_gemm_amx else "VNNI int8" if table.quant_gemm_vnni else None
        if engine and row_int8 and k % 64 == 0 and n * k >= table.quant_gemm_int8_min_weights:
            if self.column_max is None:
                self.column_max = self.column_absmax()
            amx = engine == "AMX-INT8"
            # no padding: our kernel keeps nothing per shape
            gemm = functools.partial(self.int8_gemm, amx=amx)
            gated = functools.partial(self.int8_gemm, silu_mul=True, amx=amx) if n % 32 == 0 else None  # whole panels
            return [gemv, Route(ANY, f"{self.kind} {engine} GEMM (ours)", gemm, gated)]
        return [gemv, Route(ANY, f"{self.kind} tiled GEMM (ours)", padded(self.gemm))]

    # ---- our kernels, on panels (`panel_routes`) --------------------------------------------------------------
    def _op(self, kind: str):
        return getattr(torch.ops.pagedserve, f"int{self.code_bits}_{kind}")

    def gemv(self, x: torch.Tensor) -> torch.Tensor:
        """int8 codes of the activations (a scale per 32) times the weight codes (VNNI)."""
        return self._op("linear")(x, self.codes, *self.values())

    def gemm(self, x: torch.Tensor) -> torch.Tensor:
        """Cache-sized tiles dequantized to x's dtype, each through oneDNN's GEMM."""
        return self._op("gemm")(x, self.codes, *self.values())

    def int8_gemm(self, x: torch.Tensor, silu_mul: bool = False, amx: bool = False) -> torch.Tensor:
        """int8 codes of x (a scale per row) times the weights re-quantized to int8 per row, both sides smoothed per
        channel by the column maxima (`column_absmax`, taken when the route is chosen), the channels with the
        largest maxima apart with scales of their own, on AMX tiles or VNNI registers (engine/csrc/int8_gemm.cpp).
        `silu_mul` (a fused gate|up weight): SiLU(gate) * up, computed as the products are."""
        return self._op("int8_gemm")(x, self.codes, *self.values(), self.column_max, silu_mul, amx)

    def column_absmax(self) -> torch.Tensor:
        """max over rows of |w| per column, fp32 [K]."""
        return torch.ops.pagedserve.panel_column_absmax(self.codes, *self.values(), self.code_bits, self.shape[1])

    def panel_operands(self) -> list[torch.Tensor] | None:
        """Codes and the four group values (an empty tensor for each one absent), in panels only."""
        if self.layout != "panels":
            return None
        empty = self.codes.new_empty(0)
        return [self.codes] + [empty if v is None else v for v in self.values()]

    def storage_bits(self) -> int:
        n, k = self.shape
        if self.format.endswith("-tensor"):
            return self.code_bits * n * k + 32 * self.scale.unique().numel()
        values = [self.scale, None if self.symmetric else self.bias, self.scale_d, self.bias_d]
        return self.code_bits * n * k + sum(8 * v.numel() * v.element_size() for v in values if v is not None)

    @classmethod
    def cat(cls, parts: list[QuantWeight]) -> GroupedWeight:
        first = parts[0]
        if len({(p.group, p.bias is None, p.scale_d is None, p.bias_d is None) for p in parts}) != 1:
            raise ValueError(f"cannot fuse {first.kind} weights with different groups or value layouts")
        if first.scale_d is not None and len({p.scale.shape[1] // p.scale_d.shape[1] for p in parts}) != 1:
            raise ValueError(f"cannot fuse {first.kind} weights with different super-blocks")
        # a per-tensor scale: one per original matrix, spelled out per row
        values = {name: None if getattr(first, name) is None else
                  torch.cat([getattr(p, name).expand(p.shape[0], -1) for p in parts]) for name in VALUES}
        return cls(torch.cat([p.codes for p in parts]), fmt=first.format, **values)


def group_values(v: torch.Tensor, d: torch.Tensor | None) -> torch.Tensor:
    """fp32 [N, G] per-group values (scales or biases): `v` as it is, or 8-bit codes `v` times an fp16 factor
    `d` [N, G / per] shared by `per` consecutive groups (a K-quant's super-block; the product is exact in fp32)."""
    if d is None:
        return v.float()
    return v.float() * d.float().repeat_interleave(v.shape[1] // d.shape[1], dim=1)


def grouped(w: torch.Tensor, group: int) -> torch.Tensor:
    """[N, K] -> fp32 [N, K / group, group]."""
    n, k = w.shape
    if k % group:
        raise ValueError(f"in-features {k} is not a multiple of the group size {group}")
    return w.float().reshape(n, k // group, group)


def narrow_values(v: torch.Tensor | None, dim: int, start: int, length: int, k: int) -> torch.Tensor | None:
    """The slice of per-group values v [N, G] (or [1, 1] per tensor) for `narrow`: rows as they are; along K,
    whole groups only (a value per row or per tensor applies to every column, so it is kept whole)."""
    if v is None or v.shape[dim] == 1:
        return v
    if dim == 0:
        return v[start:start + length].clone()
    unit = k // v.shape[1]  # weights per value along K
    if start % unit or length % unit:
        raise ValueError(f"columns {start}..{start + length} of a {k}-wide weight do not cut along its groups of "
                         f"{unit}: choose a tensor-parallel size (or group size) that splits whole groups")
    return v[:, start // unit:(start + length) // unit].clone()
