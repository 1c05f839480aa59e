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

import torch
import torch.nn.functional as F

from pagedserve.engine.quant.layouts import (
    PANEL,
    int6_from_panels,
    int6_to_panels,
    int8_from_panels,
    int8_to_panels,
    rows_to_panels,
    value_rows,
)
from pagedserve.engine.quant.weight import QuantWeight, group_values, narrow_values

VALUES = ("scale", "bias", "scale_d", "bias_d")  # the per-group tensors, laid out beside the codes


class Int8Weight(QuantWeight):
    def __init__(self, q: torch.Tensor, scale: torch.Tensor, fmt: str = "int8", bias: torch.Tensor | None = None,
                 scale_d: torch.Tensor | None = None, bias_d: torch.Tensor | None = None) -> None:
        self.q = q  # int8 [N, K]; [N/16, 16K] as panels
        self.scale = scale  # [N, G] fp16/fp32 (or 8-bit codes with scale_d); fp32 [1, 1] per tensor
        self.bias, self.scale_d, self.bias_d = bias, scale_d, bias_d
        self.format = fmt
        self.shape = (q.shape[0], q.shape[1])
        self.group = self.shape[1] // scale.shape[1]
        self.layout = None
        self.row_scale: torch.Tensor | None = None  # fp32 [N] for torch's kernel ("rows", per row or per tensor)
        self.column_max: torch.Tensor | None = None  # for the AMX GEMM's smoothing
        self.code_bits = 6 if self.format not in ("int8", "int8-tensor") and _fits_6_bits(q) else 8

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
        k = self.shape[1]
        q = self.q[start:start + length] if dim == 0 else self.q[:, start:start + length]
        values = [narrow_values(getattr(self, n), dim, start, length, k) for n in VALUES]
        w = Int8Weight(q.clone(), values[0], self.format, *values[1:])
        w.code_bits = self.code_bits  # a shard keeps the whole matrix's code width (its kernels, its bits)
        return w

    def _dense(self, q: torch.Tensor, rows: torch.Tensor | slice, dtype: torch.dtype) -> torch.Tensor:
        """Dequantized codes q [R, K] of rows `rows`."""
        scale, bias, scale_d, bias_d = (value_rows(getattr(self, n), rows, self.shape[0], self.layout == "panels")
                                        for n in VALUES)
        s = group_values(scale, scale_d)
        n, k = q.shape
        g = s.shape[1]
        w = q.float().view(n, g, k // g) * s[:, :, None]
        if bias is not None:
            w = w + group_values(bias, bias_d)[:, :, None]
        return w.view(n, k).to(dtype)

    def _codes(self) -> torch.Tensor:
        """Row-major int8 codes [N, K], whichever layout is held."""
        if self.layout != "panels":
            return self.q
        return int6_from_panels(self.q) if self.code_bits == 6 else int8_from_panels(self.q)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self._dense(self._codes(), slice(None), dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Dequantized rows (an embedding lookup)."""
        if self.layout == "panels" and self.code_bits == 6:  # the rows' panels, decoded
            p, r = ids // PANEL, ids % PANEL
            q = int6_from_panels(self.q[p]).view(len(ids), PANEL, -1)[torch.arange(len(ids)), r]
        elif self.layout == "panels":  # row n's 4-byte pieces sit at 4 (n % 16) of every 64-byte step of panel n // 16
            p, r = ids // PANEL, ids % PANEL
            q = self.q.view(-1, self.shape[1] // 4, PANEL, 4)[p, :, r].reshape(len(ids), -1)
        else:
            q = self.q[ids]
        return self._dense(q, ids, dtype)

    def panels_fit(self) -> bool:
        """Whether our kernels' layout can hold it (any scale layout: per row, per 16 or 32k, per tensor)."""
        fits = self.shape[0] % PANEL == 0 and (self.group % 32 == 0 or self.group == 16)
        return fits and (self.code_bits == 8 or self.shape[1] % 32 == 0)

    def lay_out(self, device: torch.device, panels: bool) -> None:
        """Move to `device` in our kernels' panels or row-major. Once: a tied embedding and LM head share it."""
        if self.layout is not None:
            return
        for name in ("q",) + VALUES:
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name).to(device))
        n = self.shape[0]
        if panels:
            self.scale = self.scale.expand(n, -1)
            for name in VALUES:
                if getattr(self, name) is not None:
                    setattr(self, name, rows_to_panels(getattr(self, name)))
            self.q = int6_to_panels(self.q) if self.code_bits == 6 else int8_to_panels(self.q)
            self.layout = "panels"
            return
        self.layout = "rows"
        if self.plain and self.scale.shape[1] == 1:  # per row or per tensor: torch's kernel applies
            self.row_scale = self.scale.expand(n, 1).reshape(-1).float().contiguous()

    # ---- kernels (engine/layers/linear.py picks) ------------------------------------------------------------
    def gemv(self, x: torch.Tensor) -> torch.Tensor:
        """Ours, panels: int8 codes of the activations (a scale per 32) times the weight codes (VNNI)."""
        op = torch.ops.pagedserve.int6_linear if self.code_bits == 6 else torch.ops.pagedserve.int8_linear
        return op(x, self.q, self.scale, self.bias, self.scale_d, self.bias_d)

    def gemm(self, x: torch.Tensor) -> torch.Tensor:
        """Ours, panels: cache-sized tiles dequantized to x's dtype, each through oneDNN's GEMM."""
        op = torch.ops.pagedserve.int6_gemm if self.code_bits == 6 else torch.ops.pagedserve.int8_gemm
        return op(x, self.q, self.scale, self.bias, self.scale_d, self.bias_d)

    def amx_gemm(self, x: torch.Tensor, silu_mul: bool = False) -> torch.Tensor:
        """Ours, panels, AMX: int8 codes of x (a scale per row) times the weights re-quantized to int8 per row,
        both sides smoothed per channel by the column maxima (`column_absmax`, taken when the route is chosen),
        the channels with the largest maxima apart with scales of their own (engine/csrc/amx_gemm.cpp).
        `silu_mul` (a fused gate|up weight): SiLU(gate) * up, computed as the products are."""
        op = torch.ops.pagedserve.int6_amx_gemm if self.code_bits == 6 else torch.ops.pagedserve.int8_amx_gemm
        return op(x, self.q, self.scale, self.bias, self.scale_d, self.bias_d, self.column_max, silu_mul)

    def column_absmax(self) -> torch.Tensor:
        """max over rows of |w| per column (panels), fp32 [K]."""
        return torch.ops.pagedserve.panel_column_absmax(self.q, self.scale, self.bias, self.scale_d, self.bias_d,
                                                        self.code_bits, self.shape[1])

    def torch_gemv(self, x: torch.Tensor, kernel_dtype: torch.dtype) -> torch.Tensor:
        """torch's `_weight_int8pack_mm` ("rows" with a row scale), computed in `kernel_dtype`."""
        if self.shape[1] % 32:  # its bf16 path returns garbage unless K % 32 == 0 (torch 2.13): fp32 there
            kernel_dtype = torch.float32
        s = self.row_scale
        return torch.ops.aten._weight_int8pack_mm(x.to(kernel_dtype), self.q, s.to(kernel_dtype)).to(x.dtype)

    def codes_gemm(self, x: torch.Tensor) -> torch.Tensor:
        """A dense GEMM on the codes (exact in bf16/fp32), the row scale applied to the output ("rows")."""
        return F.linear(x, self.q.to(x.dtype)) * self.row_scale.to(x.dtype)

    def panel_operands(self) -> list[torch.Tensor] | None:
        """What our GEMV takes (and the fused decode layer, engine/csrc/decode_layer.cpp), in panels only: codes
        and the four group values, an empty tensor for each one absent."""
        if self.layout != "panels":
            return None
        empty = self.q.new_empty(0)
        return [self.q] + [empty if getattr(self, n) is None else getattr(self, n) for n in VALUES]

    def tensors(self) -> list[torch.Tensor]:
        held = [self.q, self.row_scale] + [getattr(self, n) for n in VALUES]
        return [t for t in held if t is not None]

    def storage_bits(self) -> int:
        n, k = self.shape
        if self.format == "int8-tensor":
            return 8 * n * k + 32 * self.scale.unique().numel()
        values = [getattr(self, name) for name in VALUES]
        return self.code_bits * n * k + sum(8 * v.numel() * v.element_size() for v in values if v is not None)

    @classmethod
    def cat(cls, parts: list[QuantWeight]) -> Int8Weight:
        if parts[0].format == "int8-tensor":  # one scale per original matrix, spelled out per row
            scale = torch.cat([p.scale.expand(p.shape[0], 1) for p in parts])
            return cls(torch.cat([p.q for p in parts]), scale, "int8-tensor")
        if len({(p.group, p.bias is None, p.scale_d is None, p.bias_d is None) for p in parts}) != 1:
            raise ValueError("cannot fuse int8 weights with different groups or value layouts")
        if parts[0].scale_d is not None and len({p.scale.shape[1] // p.scale_d.shape[1] for p in parts}) != 1:
            raise ValueError("cannot fuse int8 weights with different super-blocks")
        cat = lambda name: None if getattr(parts[0], name) is None else torch.cat([getattr(p, name) for p in parts])
        return cls(torch.cat([p.q for p in parts]), cat("scale"), parts[0].format, cat("bias"), cat("scale_d"),
                   cat("bias_d"))


def _fits_6_bits(q: torch.Tensor) -> bool:
    """Codes within -32..31 (GGUF's 5- and 6-bit types, alone or fused with 4-bit ones): 6 bits each."""
    return q.numel() > 0 and int(q.min()) >= -32 and int(q.max()) <= 31
