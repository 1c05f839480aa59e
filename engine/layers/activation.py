"""SiLU(gate) * up over a fused gate|up projection's output."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .dispatch import CppLayer


class SiluAndMul(CppLayer):
    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.cpp:
            return torch.ops.pagedserve.silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
