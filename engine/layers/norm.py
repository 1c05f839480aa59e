"""RMSNorm, and the residual add fused with the norm that follows it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .dispatch import CppLayer


class RMSNorm(CppLayer):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpp and x.dim() == 2 and x.dtype == self.weight.dtype:
            return torch.ops.pagedserve.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # normalise in fp32 then scale in the model dtype, as the reference does (and on CPUs the
        # fp32 kernel is faster than the bf16 one)
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x). The C++ op updates `residual` in place (the step's own tensor)
        and normalizes the sum in the same pass."""
        if self.cpp and residual.dtype == self.weight.dtype and residual.is_contiguous():
            return torch.ops.pagedserve.add_rms_norm(x, residual, self.weight, self.eps), residual
        residual = residual + x
        return self(residual), residual
