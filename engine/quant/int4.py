"""int4 weights: 4-bit codes c in 0..15 with w = (c - 8) * scale + zero per group of `group` along K.

`quantize` is symmetric (zero = 0, the chapter's absmax with qmax 7); llama.cpp's Q4_0 maps exactly (zero = 0)
and Q4_1's `d * c + m` maps as zero = m + 8d. Layouts (`lay_out`): "panels" for our C++ kernels (16-row panels;
scale and bias = zero - 8 * scale as [N/16, G, 16] in the scale's dtype: fp16 per group, exact for our scales and
for GGUF's d and m); "torch" for `_weight_int4pack_mm_for_cpu` (its own layout, which depends on the CPU's
vector width; the row-major codes are dropped); "codes" (row-major, dequantized for a GEMM).
"""

from __future__ import annotations

import torch

from pagedserve.engine.quant.layouts import (
    PANEL,
    from_panels,
    pack_nibbles,
    rows_from_panels,
    rows_to_panels,
    to_panels,
    unpack_nibbles,
)
from pagedserve.engine.quant.weight import QuantWeight, grouped

TORCH_KERNEL_GROUPS = (256, 128, 64, 32)  # group sizes `_weight_int4pack_mm_for_cpu` takes


class Int4Weight(QuantWeight):
    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, fmt: str = "int4",
                 group: int | None = None) -> None:
        self.codes = codes  # uint8 [N, K/2] (pack_nibbles); [N/16, 8K] as panels
        self.scale = scale  # [N, G] fp16 (or fp32), or [1, 1] per tensor; [N/16, G, 16] as panels
        self.zero = zero  # [N, G] fp32 or None
        self.format = fmt
        self.shape = (codes.shape[0], codes.shape[1] * 2)
        self.group = group or self.shape[1] // scale.shape[1]
        self.layout = None
        self.bias: torch.Tensor | None = None  # zero - 8 * scale [N/16, G, 16], as panels
        self._packed: torch.Tensor | None = None  # torch's CPU kernel layout
        self._sz: torch.Tensor | None = None  # [K / kernel group, N, 2] scale and zero, in the kernel's dtype
        self._kgroup = 0

    @classmethod
    def quantize(cls, w: torch.Tensor, group: int, per_tensor: bool = False) -> Int4Weight:
        n, k = w.shape
        if per_tensor:
            scale = (w.float().abs().max() / 7).clamp(min=1e-12).reshape(1, 1)
            q = torch.round(w.float() / scale).clamp(-8, 7) + 8
            return cls(pack_nibbles(q), scale, None, "int4-tensor", group=k)
        wg = grouped(w, group)
        scale = (wg.abs().amax(dim=-1) / 7).clamp(min=1e-8).half()  # stored as fp16
        q = torch.round(wg / scale.float()[:, :, None]).clamp(-8, 7) + 8
        return cls(pack_nibbles(q.view(n, k)), scale, None, "int4", group=group)

    def _scale_zero_full(self) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 [N, G] scale and zero (per-tensor expanded to one group per row)."""
        if self.layout == "panels":
            scale, bias = (rows_from_panels(t.float(), self.shape[0]) for t in (self.scale, self.bias))
            return scale, bias + 8 * scale
        scale = self.scale.float()
        if scale.shape[0] == 1:
            scale = scale.expand(self.shape[0], self.shape[1] // self.group)
        zero = self.zero.float() if self.zero is not None else torch.zeros_like(scale)
        return scale, zero

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.shape
        if self.layout == "torch":  # the kernel on the identity matrix reads the codes back
            eye = torch.eye(k, dtype=torch.float32, device=self._packed.device)
            return self._torch_kernel(eye, self._sz.float()).t().contiguous().to(dtype)
        scale, zero = self._scale_zero_full()
        codes = from_panels(self.codes) if self.layout == "panels" else self.codes
        c = unpack_nibbles(codes).float().view(n, -1, self.group)
        return ((c - 8) * scale[:, :, None] + zero[:, :, None]).view(n, k).to(dtype)

    def panels_fit(self) -> bool:
        return self.group % 32 == 0 and self.shape[0] % PANEL == 0

    def torch_kernel_group(self) -> int:
        """The largest group of torch's kernel that tiles ours (0: none does, or N is not a multiple of 16)."""
        if self.shape[0] % 16:
            return 0
        return next((g for g in TORCH_KERNEL_GROUPS if self.group % g == 0 and self.shape[1] % g == 0), 0)

    def lay_out(self, device: torch.device, layout: str, kernel_dtype: torch.dtype | None = None) -> None:
        """"panels" (ours), "torch" (its kernel, running in `kernel_dtype`) or "codes"; on `device`."""
        if self.layout is not None:
            return
        n = self.shape[0]
        if layout == "panels":
            scale, zero = self._scale_zero_full()
            sdtype = torch.float32 if self.scale.dtype == torch.float32 else torch.float16
            self.scale, self.bias = (rows_to_panels(t.to(sdtype)) for t in (scale, zero - 8 * scale))
            self.codes = to_panels(self.codes)
            self.zero = None  # folded into the bias
        elif layout == "torch":
            kgroup = self.torch_kernel_group()
            scale, zero = self._scale_zero_full()
            rep = self.group // kgroup  # a format group spans rep kernel groups
            sz = torch.stack((scale, zero), dim=-1).repeat_interleave(rep, dim=1)  # [N, K/kgroup, 2]
            self._sz = sz.transpose(0, 1).contiguous().to(kernel_dtype)
            self._kgroup = kgroup
            self._packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                unpack_nibbles(self.codes).to(torch.int32), 1)
            self.codes = self.codes.new_empty(0)  # the kernel layout is the only copy kept
        else:
            self.codes, self.scale = self.codes.to(device), self.scale.to(device)
            self.zero = None if self.zero is None else self.zero.to(device)
        assert n == self.shape[0]
        self.layout = layout

    @property
    def kernel_dtype(self) -> torch.dtype | None:
        """The activation dtype torch's kernel runs in ("torch" layout only)."""
        return None if self._sz is None else self._sz.dtype

    # ---- kernels (engine/layers/linear.py picks) ------------------------------------------------------------
    def gemv(self, x: torch.Tensor) -> torch.Tensor:
        """Ours, panels: int8 codes of the activations (a scale per 32) times the nibbles (VNNI)."""
        return torch.ops.pagedserve.int4_linear(x, self.codes, self.scale, self.bias)

    def gemm(self, x: torch.Tensor) -> torch.Tensor:
        """Ours, panels: cache-sized tiles dequantized to x's dtype, each through oneDNN's GEMM."""
        return torch.ops.pagedserve.int4_gemm(x, self.codes, self.scale, self.bias)

    def _torch_kernel(self, x: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self._packed, self._kgroup, sz.to(x.dtype))

    def torch_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """torch's `_weight_int4pack_mm_for_cpu` ("torch"), in its kernel dtype, cast back to x's."""
        return self._torch_kernel(x.to(self._sz.dtype), self._sz).to(x.dtype)

    def panel_operands(self) -> list[torch.Tensor] | None:
        return [self.codes, self.scale, self.bias] if self.layout == "panels" else None

    def tensors(self) -> list[torch.Tensor]:
        if self.layout == "torch":
            return [self._packed, self._sz]
        return [t for t in (self.codes, self.scale, self.zero, self.bias) if t is not None]

    def storage_bits(self) -> int:
        n, k = self.shape
        if self.format == "int4-tensor":
            return 4 * n * k + 32 * self.scale.unique().numel()
        has_zero = self.zero is not None or (self.bias is not None and bool((self.bias != -8 * self.scale).any()))
        per_group = 32 if has_zero else 16
        return 4 * n * k + per_group * n * (k // self.group)

    @classmethod
    def cat(cls, parts: list[QuantWeight]) -> Int4Weight:
        if parts[0].format == "int4-tensor":  # one scale per original matrix, spelled out per row
            scale = torch.cat([p.scale.expand(p.shape[0], 1) for p in parts])
            return cls(torch.cat([p.codes for p in parts]), scale, None, "int4-tensor", parts[0].shape[1])
        if len({p.group for p in parts}) != 1 or len({p.zero is None for p in parts}) != 1:
            raise ValueError("cannot fuse int4 weights with different groups or zero-point use")
        zero = None if parts[0].zero is None else torch.cat([p.zero for p in parts])
        return cls(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]), zero,
                   parts[0].format, parts[0].group)
