"""The attention-backend interface and the per-step metadata every backend reads."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, fields

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Describes one flat, unpadded batch. Sequences are ordered decodes first.

    Token t of the batch belongs to sequence b where query_start_loc[b] <= t < query_start_loc[b+1];
    that sequence's K/V live in the blocks block_tables[b, :ceil(seq_lens[b] / block_size)].
    """

    slot_mapping: torch.Tensor  # [T] int64: cache slot (block * block_size + offset) of each new token; -1 = skip
    query_start_loc: torch.Tensor  # [B + 1] int32: cu_seqlens of the queries
    seq_lens: torch.Tensor  # [B] int32: context length after this step (cached + new tokens)
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0 (never read past seq_lens)
    max_query_len: int
    max_seq_len: int
    num_decodes: int  # the first num_decodes sequences have exactly one query token
    query_lens_cpu: list[int]  # host copies, so backends need not sync to loop over sequences
    seq_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    def for_backend(self, cls: type, *extra) -> AttentionMetadata:
        """A backend's metadata (`cls`, a subclass): these common fields, then its own `extra` ones."""
        return cls(*(getattr(self, f.name) for f in fields(AttentionMetadata)), *extra)


class AttentionBackend(ABC):
    """Stores the step's new K/V into the paged cache, then attends over each sequence's blocks.

    Shapes: q [T, Hq, D]; k, v [T, Hkv, D]; caches [num_blocks, block_size, Hkv, D]; returns [T, Hq, D].
    Attention is causal within the new tokens and full over the cached prefix.

    The runner calls `build_metadata` once per step; every layer then passes its result back to `forward`, so
    whatever a backend derives from the batch (kernel plans, masks, tile counts) is computed once and stays
    inside the backend.
    """

    name: str = "abstract"

    def build_metadata(self, meta: AttentionMetadata, num_kv_heads: int, dtype: torch.dtype) -> AttentionMetadata:
        """This step's metadata as this backend wants it (default: the common fields only)."""
        return meta

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...
