"""The interface every quantized weight format implements: storage, its reference, and its kernels' layouts.

A format stores rows (output features) independently, so fused projections are row concatenations and
llama.cpp's q/k row permutation applies to codes and scales alike. Which kernel computes a product is not the
format's choice: engine/layers/linear.py picks one of the kernels a format offers from the dispatch table.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F


class QuantWeight(ABC):
    """One quantized [N, K] weight."""

    format: str
    shape: tuple[int, int]
    layout: str | None = None  # set by `lay_out`: which kernels' layout the codes are in

    @abstractmethod
    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The reference: the dense [N, K] matrix this storage represents."""

    @abstractmethod
    def tensors(self) -> list[torch.Tensor]:
        """Every tensor held (what resident memory is made of)."""

    @abstractmethod
    def storage_bits(self) -> int:
        """Bits a file would need: codes plus scales at the width the format defines."""

    @classmethod
    @abstractmethod
    def cat(cls, parts: list[QuantWeight]) -> QuantWeight:
        """Row-concatenate (fused q|k|v, gate|up) before it is laid out."""

    def narrow(self, dim: int, start: int, length: int) -> QuantWeight:
        """Rows (dim 0) or columns (dim 1) start..start+length as storage of the same format: a tensor-parallel
        rank's shard, taken before `lay_out`. Columns are cut along the format's groups, so the shard holds
        exactly the values the whole matrix does."""
        raise ValueError(f"{self.format} weights cannot be split for tensor parallelism")

    def panel_operands(self) -> list[torch.Tensor] | None:
        """What our C++ GEMV (and the fused decode layer) takes, where the format is laid out for it."""
        return None

    def dequantized_gemm(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T through the dense matrix: the kernel every format has."""
        return F.linear(x, self.dequantize(x.dtype))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    @property
    def bits_per_weight(self) -> float:
        return self.storage_bits() / (self.shape[0] * self.shape[1])


def group_values(v: torch.Tensor, d: torch.Tensor | None) -> torch.Tensor:
    """fp32 [N, G] per-group values (scales or biases): `v` as it is, or 8-bit codes `v` times an fp16 factor
    `d` [N, G / per] shared by `per` consecutive groups (a K-quant's super-block; the product is exact in fp32)."""
    if d is None:
        return v.float()
    return v.float() * d.float().repeat_interleave(v.shape[1] // d.shape[1], dim=1)


def grouped(w: torch.Tensor, group: int) -> torch.Tensor:
    """[N, K] -> fp32 [N, K / group, group]."""
    n, k = w.shape
    if k % group:
        raise ValueError(f"in-features {k} is not a multiple of the group size {group}")
    return w.float().reshape(n, k // group, group)


def narrow_values(v: torch.Tensor | None, dim: int, start: int, length: int, k: int) -> torch.Tensor | None:
    """The slice of per-group values v [N, G] (or [1, 1] per tensor) for `narrow`: rows as they are; along K,
    whole groups only (a value per row or per tensor applies to every column, so it is kept whole)."""
    if v is None or v.shape[dim] == 1:
        return v
    if dim == 0:
        return v[start:start + length].clone()
    unit = k // v.shape[1]  # weights per value along K
    if start % unit or length % unit:
        raise ValueError(f"columns {start}..{start + length} of a {k}-wide weight do not cut along its groups of "
                         f"{unit}: choose a tensor-parallel size (or group size) that splits whole groups")
    return v[:, start // unit:(start + length) // unit].clone()
