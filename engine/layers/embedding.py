"""Token embedding: a dense table, or quantized rows (int8 or int4 storage: our per-row int8, or a GGUF's blocks
as the file holds them) dequantized on lookup."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.engine.layers.dispatch import KernelTable
from pagedserve.engine.layers.linear import lay_out_int8
from pagedserve.engine.quant.int4 import Int4Weight
from pagedserve.engine.quant.int8 import Int8Weight


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, dim
        self.weight: nn.Parameter | None = nn.Parameter(torch.empty(num_embeddings, dim))
        self.qweight: Int8Weight | Int4Weight | None = None
        self.dtype: torch.dtype | None = None  # what quantized rows dequantize to

    def quantize_to(self, qweight: Int8Weight | Int4Weight, dtype: torch.dtype) -> None:
        self.weight, self.qweight, self.dtype = None, qweight, dtype

    def select_kernels(self, table: KernelTable, device: torch.device) -> None:
        """The layout the LM head picks where it shares this storage (a shared one is laid out once)."""
        w = self.qweight
        if isinstance(w, Int8Weight):
            lay_out_int8(w, table, device)
        elif w is not None:
            w.lay_out(device, "panels" if table.cpp and device.type == "cpu" and w.panels_fit() else "codes")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.qweight is None:
            return F.embedding(ids, self.weight)
        return self.qweight.rows(ids, self.dtype)
