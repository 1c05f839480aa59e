"""The weight formats by name: quantize a dense matrix into one, fuse several, measure the error.

| format        | storage                                 | bits/weight        | module |
|---------------|-----------------------------------------|--------------------|--------|
| `int8`        | int8 [N, K], fp16 scale per row         | 8 + 16/K           | int8.py |
| `int8-tensor` | int8 [N, K], one scale                  | 8                  | int8.py |
| `int4`        | 4-bit codes, fp16 scale per group of g  | 4 + 16/g           | int4.py |
| `int4-tensor` | 4-bit codes, one scale                  | 4                  | int4.py |
| `nf4`         | 4-bit NF4 level index, fp16 absmax / 64 | 4.25               | nf4.py |

Which kernel multiplies by each one is engine/layers/linear.py's choice.
"""

from __future__ import annotations

import math

import torch

from pagedserve.engine.quant.int4 import Int4Weight
from pagedserve.engine.quant.int8 import Int8Weight
from pagedserve.engine.quant.nf4 import NF4Weight
from pagedserve.engine.quant.weight import QuantWeight

FORMATS = ("int8", "int8-tensor", "int4", "int4-tensor", "nf4")


def default_group_size(in_features: list[int]) -> int:
    """The largest of 128/64/32 dividing every matrix's in-features (SmolLM2's 576 -> 64)."""
    for g in (128, 64, 32):
        if all(k % g == 0 for k in in_features):
            return g
    raise ValueError(f"no int4 group size in (128, 64, 32) divides every in-feature size {sorted(set(in_features))}")


def quantize(w: torch.Tensor, fmt: str, group_size: int = 64) -> QuantWeight:
    """Dense [N, K] -> the format's storage (on w's device, not yet laid out for a kernel)."""
    if fmt == "int8":
        return Int8Weight.quantize(w)
    if fmt == "int8-tensor":
        return Int8Weight.quantize(w, per_tensor=True)
    if fmt == "int4":
        return Int4Weight.quantize(w, group_size)
    if fmt == "int4-tensor":
        return Int4Weight.quantize(w, group_size, per_tensor=True)
    if fmt == "nf4":
        return NF4Weight.quantize(w)
    raise ValueError(f"unknown quantization {fmt!r}; choose from none, {', '.join(FORMATS)}")


def cat(parts: list[QuantWeight]) -> QuantWeight:
    if len(parts) == 1:
        return parts[0]
    kinds = {(type(p), p.format) for p in parts}
    if len(kinds) != 1:
        raise ValueError(f"cannot fuse weights of different formats {sorted(f for _, f in kinds)}")
    return type(parts[0]).cat(parts)


def relative_error(w: torch.Tensor, qw: QuantWeight) -> float:
    """‖W − Ŵ‖ / ‖W‖ (Frobenius), in fp32."""
    w = w.float()
    return (math.sqrt(((w - qw.dequantize()) ** 2).sum().item()) / max(w.norm().item(), 1e-30))
