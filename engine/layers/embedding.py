"""Token embedding: a dense table, or quantized rows (int8 or int4 storage: our per-row int8, or a GGUF's blocks
as the file holds them) dequantized on lookup. Under tensor parallelism each rank holds a range of the vocabulary
(vocab-parallel, as Megatron): ids outside it look up zeros, and one all-reduce sums the ranks' rows."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from .dispatch import KernelTable

if TYPE_CHECKING:
    from ..parallel.group import TensorParallel
    from ..quant.int4 import Int4Weight
    from ..quant.int8 import Int8Weight


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int, tp: TensorParallel | None = None, vocab_start: int = 0) -> None:
        """`num_embeddings`: the rows held (a rank's share of the vocabulary, from `vocab_start`, under `tp`)."""
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, dim
        self.tp, self.vocab_start = tp, vocab_start
        self.weight: nn.Parameter | None = nn.Parameter(torch.empty(num_embeddings, dim))
        self.qweight: Int8Weight | Int4Weight | None = None
        self.dtype: torch.dtype | None = None  # what quantized rows dequantize to

    def quantize_to(self, qweight: Int8Weight | Int4Weight, dtype: torch.dtype) -> None:
        self.weight, self.qweight, self.dtype = None, qweight, dtype

    def select_kernels(self, table: KernelTable, device: torch.device) -> None:
        """The layout the LM head picks where it shares this storage (a shared one is laid out once)."""
        if self.qweight is not None:
            self.qweight.lay_out_rows(table, device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return self._lookup(ids)
        # vocab-parallel: ids outside this rank's rows look up zeros; the all-reduce sums the ranks' rows
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        rows = self._lookup(local.masked_fill(outside, 0))
        return self.tp.all_reduce(rows.masked_fill(outside[:, None], 0))

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the table held: dense, or quantized rows dequantized to the model dtype."""
        return F.embedding(ids, self.weight) if self.qweight is None else self.qweight.rows(ids, self.dtype)
