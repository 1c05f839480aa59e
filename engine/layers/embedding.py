"""Token embedding: a dense table, or int8 rows (per-row scales, or llama.cpp Q8_0's per-32) dequantized on lookup."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.engine.layers.dispatch import KernelTable
from pagedserve.engine.layers.linear import lay_out_int8
from pagedserve.engine.quant.int8 import Int8Weight


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, dim
        self.weight: nn.Parameter | None = nn.Parameter(torch.empty(num_embeddings, dim))
        self.qweight: Int8Weight | None = None
        self.dtype: torch.dtype | None = None  # what int8 rows dequantize to

    def quantize_to(self, qweight: Int8Weight, dtype: torch.dtype) -> None:
        self.weight, self.qweight, self.dtype = None, qweight, dtype

    def select_kernels(self, table: KernelTable, device: torch.device) -> None:
        if self.qweight is not None:  # the same layout the LM head picks where it shares this storage
            lay_out_int8(self.qweight, table, device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.qweight is None:
            return F.embedding(ids, self.weight)
        return self.qweight.rows(ids, self.dtype)
