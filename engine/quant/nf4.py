"""QLoRA's NF4: 16 normal-quantile levels times an fp16 absmax per block of 64 along K.

No packed kernel exists for it on CPU or CUDA in torch: every product dequantizes, then runs a GEMM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .layouts import pack_nibbles, unpack_nibbles
from .weight import QuantWeight, grouped

if TYPE_CHECKING:
    from ..layers.dispatch import KernelTable
    from ..layers.linear import Route

NF4_BLOCK = 64
# quantiles of N(0, 1) scaled to [-1, 1], with an exact zero (a tuple: no tensor is made on import, which would
# fix torch's huge-page setting before an engine sets it, engine/allocator.py)
NF4_LEVELS = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0)


class NF4Weight(QuantWeight):
    format = "nf4"

    def __init__(self, codes: torch.Tensor, absmax: torch.Tensor) -> None:
        self.codes = codes  # uint8 [N, K/2]
        self.absmax = absmax  # fp16 [N, K/block]
        self.shape = (codes.shape[0], codes.shape[1] * 2)
        self.block = self.shape[1] // absmax.shape[1]
        self._levels = torch.tensor(NF4_LEVELS)

    @classmethod
    def quantize(cls, w: torch.Tensor) -> NF4Weight:
        n, k = w.shape
        # QLoRA's block of 64; 32 where the in-features are not a multiple of 64
        wg = grouped(w, NF4_BLOCK if k % NF4_BLOCK == 0 else NF4_BLOCK // 2)
        absmax = wg.abs().amax(dim=-1).clamp(min=1e-8).half()
        normed = wg / absmax.float()[:, :, None]
        # nearest level: midpoints between sorted levels are the decision boundaries
        levels = torch.tensor(NF4_LEVELS)
        mids = (levels[1:] + levels[:-1]) / 2
        codes = torch.bucketize(normed.reshape(-1), mids).view(n, k)
        return cls(pack_nibbles(codes), absmax)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.shape
        vals = self._levels.to(dtype)[unpack_nibbles(self.codes).long()].view(n, -1, self.block)
        return (vals * self.absmax.to(dtype)[:, :, None]).view(n, k)

    def lay_out(self, device: torch.device) -> None:
        self.codes, self.absmax = self.codes.to(device), self.absmax.to(device)
        self._levels = torch.tensor(NF4_LEVELS, device=device)
        self.layout = "codes"

    def select_kernels(self, table: KernelTable, device: torch.device, dtype: torch.dtype,
                       row_int8: bool = True) -> list[Route]:
        self.lay_out(device)
        return self.dequantized_routes()

    def tensors(self) -> list[torch.Tensor]:
        return [self.codes, self.absmax]

    def storage_bits(self) -> int:
        n, k = self.shape
        return 4 * n * k + 16 * self.absmax.numel()

    @classmethod
    def cat(cls, parts: list[QuantWeight]) -> NF4Weight:
        return cls(torch.cat([p.codes for p in parts]), torch.cat([p.absmax for p in parts]))
