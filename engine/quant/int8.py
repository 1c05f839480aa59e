"""int8 weights: codes with a scale (and optionally a bias) per row, per group along K, or per tensor.

w = c * scale + bias per group. Our own `quantize` is symmetric with an fp16 scale per row (or one per tensor);
GGUF blocks map exactly (engine/quant/gguf_blocks.py): Q8_0 and Q5_0 (fp16 scale per 32), Q5_1 (plus an fp16
bias), Q5_K (codes 0..31, 6-bit scale and min codes times the super-block's fp16 d and -dmin) and Q6_K (codes
-32..31, groups of 16, int8 scale codes times d). A scale or bias held as 8-bit codes comes with its fp16 factor
per super-block (`scale_d`, `bias_d` [N, G / per]).

Layouts (`lay_out`): "panels" for our C++ kernels (16-row panels, engine/quant/layouts.py; the per-group values
as [N/16, G, 16]; codes within -32..31, as every 5- and 6-bit GGUF type's are, at 6 bits each), or "rows"
(row-major, for torch's `_weight_int8pack_mm` and plain GEMMs where a plain row scale is all there is).
Embeddings use either as a row lookup.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..layers.linear import ANY, Route, padded
from .layouts import (
    PANEL,
    int6_from_panels,
    int6_to_panels,
    int8_from_panels,
    int8_to_panels,
)
from .weight import GroupedWeight, narrow_values

if TYPE_CHECKING:
    from ..layers.dispatch import KernelTable


class Int8Weight(GroupedWeight):
    kind = "int8"
    row_major = "rows"

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, fmt: str = "int8", bias: torch.Tensor | None = None,
                 scale_d: torch.Tensor | None = None, bias_d: torch.Tensor | None = None) -> None:
        # codes: int8 [N, K]; [N/16, 16K] as panels
        # scale: [N, G] fp16/fp32 (or 8-bit codes with scale_d); fp32 [1, 1] per tensor
        super().__init__(codes, scale, bias, scale_d, bias_d, fmt, codes.shape[1])
        self.row_scale: torch.Tensor | None = None  # fp32 [N] for torch's kernel ("rows", per row or per tensor)
        self.code_bits = 6 if self.format not in ("int8", "int8-tensor") and _fits_6_bits(codes) else 8

    @classmethod
    def quantize(cls, w: torch.Tensor, per_tensor: bool = False) -> Int8Weight:
        w = w.float()
        if per_tensor:
            scale = (w.abs().max().reshape(1, 1) / 127).clamp(min=1e-12)
        else:  # fp16 per row, as stored
            scale = (w.abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-7).half()
        q = torch.round(w / scale.float()).clamp(-128, 127).to(torch.int8)
        return cls(q, scale, "int8-tensor" if per_tensor else "int8")

    @property
    def plain(self) -> bool:
        """A plain scale (fp16/fp32, no bias, no factor): what torch's kernels and `codes_gemm` can apply."""
        return self.bias is None and self.scale_d is None

    def narrow(self, dim: int, start: int, length: int) -> Int8Weight:
        if self.layout is not None:
            raise ValueError("narrow an int8 weight before it is laid out")
        codes = self.codes[start:start + length] if dim == 0 else self.codes[:, start:start + length]
        values = [narrow_values(v, dim, start, length, self.shape[1]) for v in self.values()]
        w = Int8Weight(codes.clone(), values[0], self.format, *values[1:])
        w.code_bits = self.code_bits  # a shard keeps the whole matrix's code width (its kernels, its bits)
        return w

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        codes = self.codes
        if self.layout == "panels":
            codes = int6_from_panels(codes) if self.code_bits == 6 else int8_from_panels(codes)
        return self._dense(codes, slice(None), dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Dequantized rows (an embedding lookup)."""
        if self.layout != "panels":
            return self._dense(self.codes[ids], ids, dtype)
        p, r = ids // PANEL, ids % PANEL
        if self.code_bits == 6:  # the rows' panels, decoded
            codes = int6_from_panels(self.codes[p]).view(len(ids), PANEL, -1)[torch.arange(len(ids)), r]
        else:  # row n's 4-byte pieces sit at 4 (n % 16) of every 64-byte step of panel n // 16
            codes = self.codes.view(-1, self.shape[1] // 4, PANEL, 4)[p, :, r].reshape(len(ids), -1)
        return self._dense(codes, ids, dtype)

    def panels_fit(self) -> bool:
        """Whether our kernels' layout can hold it (any scale layout: per row, per 16 or 32k, per tensor)."""
        fits = self.shape[0] % PANEL == 0 and (self.group % 32 == 0 or self.group == 16)
        return fits and (self.code_bits == 8 or self.shape[1] % 32 == 0)

    def lay_out(self, device: torch.device, layout: str) -> None:
        """Move to `device` in our kernels' "panels" or row-major "rows". Once: a tied embedding and LM head share
        it."""
        if self.layout is not None:
            return
        if layout not in ("panels", "rows"):
            raise ValueError(f"int8 weights are laid out in panels or rows, not {layout!r}")
        self._move_to(device)
        self.layout = layout
        if layout == "panels":
            self._values_to_panels()
            self.codes = int6_to_panels(self.codes) if self.code_bits == 6 else int8_to_panels(self.codes)
        elif self.plain and self.scale.shape[1] == 1:  # per row or per tensor: torch's kernel applies
            self.row_scale = self.scale.expand(self.shape[0], 1).reshape(-1).float().contiguous()

    def select_kernels(self, table: KernelTable, device: torch.device, dtype: torch.dtype,
                       row_int8: bool = True) -> list[Route]:
        """Our panels where our kernels serve the matrix (the layout a row lookup takes too); else rows: with a
        plain scale per row or per tensor, torch's `_weight_int8pack_mm` for a few rows on a CPU (in bf16 where the
        table says torch's int kernels are faster so) and a GEMM on the codes above; with group-wise scales or a
        bias, which no kernel of torch's takes, dequantized."""
        self.lay_out_rows(table, device)
        if self.layout == "panels":
            return self.panel_routes(table, row_int8)
        if self.row_scale is None:
            return self.dequantized_routes()
        routes = [Route(ANY, "GEMM on the int8 codes", padded(self.codes_gemm))]
        if device.type == "cpu":
            fp32_kernel = torch.bfloat16 if table.torch_int_bf16 else dtype
            routes.insert(0, Route(table.torch_int8_max_rows, "torch _weight_int8pack_mm",
                                   lambda x: self.torch_gemv(x, torch.bfloat16 if x.dtype == torch.bfloat16
                                                             else fp32_kernel)))
        return routes

    # ---- torch's kernels, on rows (`select_kernels`) --------------------------------------------------------
    def torch_gemv(self, x: torch.Tensor, kernel_dtype: torch.dtype) -> torch.Tensor:
        """torch's `_weight_int8pack_mm` ("rows" with a row scale), computed in `kernel_dtype`."""
        if self.shape[1] % 32:  # its bf16 path returns garbage unless K % 32 == 0 (torch 2.13): fp32 there
            kernel_dtype = torch.float32
        s = self.row_scale
        return torch.ops.aten._weight_int8pack_mm(x.to(kernel_dtype), self.codes, s.to(kernel_dtype)).to(x.dtype)

    def codes_gemm(self, x: torch.Tensor) -> torch.Tensor:
        """A dense GEMM on the codes (exact in bf16/fp32), the row scale applied to the output ("rows")."""
        return F.linear(x, self.codes.to(x.dtype)) * self.row_scale.to(x.dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in [self.codes, self.row_scale, *self.values()] if t is not None]


def _fits_6_bits(q: torch.Tensor) -> bool:
    """Codes within -32..31 (GGUF's 5- and 6-bit types, alone or fused with 4-bit ones): 6 bits each."""
    return q.numel() > 0 and int(q.min()) >= -32 and int(q.max()) <= 31
