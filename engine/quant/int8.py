"""int8 weights: symmetric codes with a scale per row, per group of 32 along K (llama.cpp's Q8_0), or per tensor.

Layouts (`lay_out`): "panels" for our C++ kernels (16-row panels, engine/quant/layouts.py; the scales spelled
out per group as [N/16, G, 16]), or "rows" (row-major, for torch's `_weight_int8pack_mm` and plain GEMMs).
Embeddings use either as a row lookup.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.engine.quant.layouts import PANEL, int8_from_panels, int8_to_panels, rows_from_panels, rows_to_panels
from pagedserve.engine.quant.weight import QuantWeight


class Int8Weight(QuantWeight):
    def __init__(self, q: torch.Tensor, scale: torch.Tensor, fmt: str = "int8") -> None:
        self.q = q  # int8 [N, K]; [N/16, 16K] as panels
        self.scale = scale  # fp16 [N, G] (G = 1: per row; K/32 from Q8_0), or fp32 [1, 1]; [N/16, G, 16] as panels
        self.format = fmt
        self.shape = (q.shape[0], q.shape[1])
        self.group = self.shape[1] // scale.shape[1]
        self.layout = None
        self.row_scale: torch.Tensor | None = None  # fp32 [N] for torch's kernel ("rows", per row or per tensor)

    @classmethod
    def quantize(cls, w: torch.Tensor, per_tensor: bool = False) -> Int8Weight:
        w = w.float()
        if per_tensor:
            scale = (w.abs().max().reshape(1, 1) / 127).clamp(min=1e-12)
        else:  # fp16 per row, as stored
            scale = (w.abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-7).half()
        q = torch.round(w / scale.float()).clamp(-128, 127).to(torch.int8)
        return cls(q, scale, "int8-tensor" if per_tensor else "int8")

    def _row_major(self) -> tuple[torch.Tensor, torch.Tensor]:
        """int8 [N, K] codes and [N, G] (or [1, 1]) scales, whichever layout is held."""
        if self.layout != "panels":
            return self.q, self.scale
        return int8_from_panels(self.q), rows_from_panels(self.scale, self.shape[0])

    @staticmethod
    def _dense(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        n, k = q.shape
        g = scale.shape[1]
        return (q.to(dtype).view(n, g, k // g) * scale.to(dtype)[:, :, None]).view(n, k)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        q, scale = self._row_major()
        return self._dense(q, scale.expand(self.shape[0], -1), dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Dequantized rows (an embedding lookup)."""
        if self.layout == "panels":  # row n's 4-byte pieces sit at 4 (n % 16) of every 64-byte step of panel n // 16
            p, r = ids // PANEL, ids % PANEL
            q = self.q.view(-1, self.shape[1] // 4, PANEL, 4)[p, :, r].reshape(len(ids), -1)
            return self._dense(q, self.scale[p, :, r], dtype)
        scale = self.scale[ids] if self.scale.shape[0] > 1 else self.scale.expand(len(ids), -1)
        return self._dense(self.q[ids], scale, dtype)

    def panels_fit(self) -> bool:
        """Whether our kernels' layout can hold it (any scale layout: per row, per 32, per tensor)."""
        return self.shape[0] % PANEL == 0 and self.group % 32 == 0

    def lay_out(self, device: torch.device, panels: bool) -> None:
        """Move to `device` in our kernels' panels or row-major. Once: a tied embedding and LM head share it."""
        if self.layout is not None:
            return
        self.q, self.scale = self.q.to(device), self.scale.to(device)
        n = self.shape[0]
        if panels:
            scale = self.scale.expand(n, -1)
            self.scale = rows_to_panels(scale.to(torch.float32 if scale.dtype == torch.float32 else torch.float16))
            self.q = int8_to_panels(self.q)
            self.layout = "panels"
            return
        self.layout = "rows"
        if self.scale.shape[1] == 1:  # per row or per tensor: torch's kernel applies
            self.row_scale = self.scale.expand(n, 1).reshape(-1).float().contiguous()

    # ---- kernels (engine/layers/linear.py picks) ------------------------------------------------------------
    def gemv(self, x: torch.Tensor) -> torch.Tensor:
        """Ours, panels: int8 codes of the activations (a scale per 32) times the weight codes (VNNI)."""
        return torch.ops.pagedserve.int8_linear(x, self.q, self.scale)

    def gemm(self, x: torch.Tensor) -> torch.Tensor:
        """Ours, panels: cache-sized tiles dequantized to x's dtype, each through oneDNN's GEMM."""
        return torch.ops.pagedserve.int8_gemm(x, self.q, self.scale)

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
        """What our GEMV takes (and the fused decode layer, engine/csrc/decode_layer.cpp), in panels only."""
        return [self.q, self.scale] if self.layout == "panels" else None

    def tensors(self) -> list[torch.Tensor]:
        return [self.q, self.scale] + ([self.row_scale] if self.row_scale is not None else [])

    def storage_bits(self) -> int:
        n, k = self.shape
        scale_bits = 32 * self.scale.unique().numel() if self.format == "int8-tensor" else 16 * self.scale.numel()
        return 8 * n * k + scale_bits

    @classmethod
    def cat(cls, parts: list[QuantWeight]) -> Int8Weight:
        if parts[0].format == "int8-tensor":  # one scale per original matrix, spelled out per row
            scale = torch.cat([p.scale.expand(p.shape[0], 1) for p in parts])
            return cls(torch.cat([p.q for p in parts]), scale, "int8-tensor")
        return cls(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]), parts[0].format)
