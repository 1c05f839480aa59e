"""int4 weights: 4-bit codes c in 0..15 with w = c * scale + bias per group of `group` along K.

`quantize` is symmetric (bias None: -8 * scale, the chapter's absmax with qmax 7). GGUF blocks map exactly
(engine/quant/gguf_blocks.py): Q4_0 (bias None), Q4_1 (`d * c + m`: fp16 scale and bias), Q4_K (6-bit scale and
min codes per 32 times the super-block's fp16 d and -dmin: `scale_d`, `bias_d` [N, G / 8]). Layouts (`lay_out`):
"panels" for our C++ kernels (16-row panels; the per-group values as [N/16, G, 16], a symmetric bias spelled out
in the scale's dtype, exact); "torch" for `_weight_int4pack_mm_for_cpu` (its own layout, which depends on the
CPU's vector width; the row-major codes are dropped); "codes" (row-major, dequantized for a GEMM).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..layers.linear import ANY, Route, padded
from .layouts import PANEL, from_panels, pack_nibbles, to_panels, unpack_nibbles
from .weight import GroupedWeight, grouped, narrow_values

if TYPE_CHECKING:
    from ..layers.dispatch import KernelTable

TORCH_KERNEL_GROUPS = (256, 128, 64, 32)  # group sizes `_weight_int4pack_mm_for_cpu` takes


class Int4Weight(GroupedWeight):
    kind = "int4"
    row_major = "codes"
    code_bits = 4

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, fmt: str = "int4",
                 group: int | None = None, scale_d: torch.Tensor | None = None,
                 bias_d: torch.Tensor | None = None) -> None:
        # codes: uint8 [N, K/2] (pack_nibbles); [N/16, 8K] as panels
        # scale: [N, G] fp16/fp32 (or 8-bit codes with scale_d), or [1, 1] per tensor; panels [N/16, G, 16]
        # bias: as scale (codes with bias_d), or None: symmetric, -8 * scale
        super().__init__(codes, scale, bias, scale_d, bias_d, fmt, codes.shape[1] * 2, group)
        self._packed: torch.Tensor | None = None  # torch's CPU kernel layout
        self._sz: torch.Tensor | None = None  # [K / kernel group, N, 2] scale and zero, in the kernel's dtype
        self._kgroup = 0
        self._bits = 0

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

    def narrow(self, dim: int, start: int, length: int) -> Int4Weight:
        if self.layout is not None:
            raise ValueError("narrow an int4 weight before it is laid out")
        if dim == 0:
            codes = self.codes[start:start + length]
        elif start % 2 or length % 2:
            raise ValueError(f"int4 columns {start}..{start + length}: a byte holds two, so cut at even columns")
        else:
            codes = self.codes[:, start // 2:(start + length) // 2]
        scale, bias, scale_d, bias_d = (narrow_values(v, dim, start, length, self.shape[1]) for v in self.values())
        return Int4Weight(codes.clone(), scale, bias, self.format, None, scale_d, bias_d)

    def _scale_bias(self, rows: torch.Tensor | slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
        scale, bias = super()._scale_bias(rows)
        return scale, (-8 * scale if bias is None else bias)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.layout == "torch":  # the kernel on the identity matrix reads the codes back
            eye = torch.eye(self.shape[1], dtype=torch.float32, device=self._packed.device)
            return self._torch_kernel(eye, self._sz.float()).t().contiguous().to(dtype)
        codes = from_panels(self.codes) if self.layout == "panels" else self.codes
        return self._dense(unpack_nibbles(codes), slice(None), dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Dequantized rows (an embedding lookup), from panels or row-major codes."""
        if self.layout == "panels":  # row n's 4-byte pieces sit at 4 (n % 16) of every 64-byte step of panel n // 16
            p, r = ids // PANEL, ids % PANEL
            b = self.codes.view(-1, self.shape[1] // 8, PANEL, 4)[p, :, r]  # [R, K/8, 4]
            codes = torch.stack((b & 15, b >> 4), dim=2).reshape(len(ids), -1)
        else:
            codes = unpack_nibbles(self.codes[ids])
        return self._dense(codes, ids, dtype)

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
        if layout == "panels":
            if self.bias is None:  # spelled out for the kernel: -8 * scale, exact in the scale's fp16/fp32
                self.bias = -8 * self.scale.expand(self.shape[0], -1)
            self._move_to(device)
            self._values_to_panels()
            self.codes = to_panels(self.codes)
        elif layout == "torch":
            kgroup = self.torch_kernel_group()
            scale, bias = self._scale_bias()
            rep = self.group // kgroup  # a format group spans rep kernel groups
            sz = torch.stack((scale, bias + 8 * scale), dim=-1).repeat_interleave(rep, dim=1)  # [N, K/kgroup, 2]
            self._sz = sz.transpose(0, 1).contiguous().to(kernel_dtype)
            self._bits = self.storage_bits()
            self._kgroup = kgroup
            self._packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                unpack_nibbles(self.codes).to(torch.int32), 1)
            self.codes = self.codes.new_empty(0)  # the kernel layout is the only copy kept
            self.scale = self.bias = self.scale_d = self.bias_d = None
        else:
            self._move_to(device)
        self.layout = layout

    def select_kernels(self, table: KernelTable, device: torch.device, dtype: torch.dtype,
                       row_int8: bool = True) -> list[Route]:
        """Our panels where our kernels serve the matrix; else, on a CPU where torch's kernel takes the groups, its
        layout (in bf16 where the table says torch's int kernels are faster so); else row-major codes,
        dequantized."""
        if self.our_kernels(table, device):
            self.lay_out(device, "panels")
        elif device.type == "cpu" and self.torch_kernel_group():
            self.lay_out(device, "torch", torch.bfloat16 if table.torch_int_bf16 else dtype)
        else:
            self.lay_out(device, "codes")
        if self.layout == "panels":
            return self.panel_routes(table, row_int8)
        if self.layout == "torch":
            return [Route(ANY, "torch _weight_int4pack_mm_for_cpu", padded(self.torch_matmul))]
        return self.dequantized_routes()

    @property
    def kernel_dtype(self) -> torch.dtype | None:
        """The activation dtype torch's kernel runs in ("torch" layout only)."""
        return None if self._sz is None else self._sz.dtype

    # ---- torch's kernel, in its layout (`select_kernels`) ------------------------------------------------
    def _torch_kernel(self, x: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self._packed, self._kgroup, sz.to(x.dtype))

    def torch_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """torch's `_weight_int4pack_mm_for_cpu` ("torch"), in its kernel dtype, cast back to x's."""
        return self._torch_kernel(x.to(self._sz.dtype), self._sz).to(x.dtype)

    def tensors(self) -> list[torch.Tensor]:
        if self.layout == "torch":
            return [self._packed, self._sz]
        return [t for t in [self.codes, *self.values()] if t is not None]

    def storage_bits(self) -> int:
        return self._bits if self.layout == "torch" else super().storage_bits()
