"""SiLU(gate) * up over a fused gate|up projection's output."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.engine.layers.dispatch import KernelTable


class SiluAndMul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cpp = False  # engine/csrc/layer_ops.cpp (set by select_kernels)

    def select_kernels(self, table: KernelTable, device: torch.device) -> None:
        self.cpp = table.cpp and device.type == "cpu"

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.cpp:
            return torch.ops.pagedserve.silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
