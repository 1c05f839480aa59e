"""The weight formats by name: quantize a dense matrix into one, fuse several, measure the error.

| format        | storage                                 | bits/weight        | module |
|---------------|-----------------------------------------|--------------------|--------|
| `int8`        | int8 [N, K], fp16 scale per row         | 8 + 16/K           | int8.py |
| `int8-tensor` | int8 [N, K], one scale                  | 8                  | int8.py |
| `int4`        | 4-bit codes, fp16 scale per group of g  | 4 + 16/g           | int4.py |
| `int4-tensor` | 4-bit codes, one scale                  | 4                  | int4.py |
| `nf4`         | 4-bit NF4 level index, fp16 absmax / 64 | 4.25               | nf4.py |

GGUF files' own block types (Q4_0 ... Q6_K) load as int4 or int8 storage named by their type, exactly
(engine/quant/gguf_blocks.py); a fused projection whose parts differ in type (Q4_K_M's q and k in Q4_K with v in
Q6_K) is held as int8 over the smallest group, still exact. Each format chooses its kernels from the dispatch
table (`QuantWeight.select_kernels`, engine/quant/weight.py).
"""

from __future__ import annotations

import torch

from .int4 import Int4Weight
from .int8 import Int8Weight
from .layouts import unpack_nibbles
from .nf4 import NF4Weight
from .weight import QuantWeight, group_values

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
    """Row-concatenate. Parts of one format fuse as they are; GGUF types that differ fuse as int8 storage
    (exact; 6 bits a code where they fit)."""
    if len(parts) == 1:
        return parts[0]
    kinds = {(type(p), p.format) for p in parts}
    if len(kinds) == 1:
        return type(parts[0]).cat(parts)
    if all(isinstance(p, (Int4Weight, Int8Weight)) and not p.format.startswith(("int", "nf")) for p in parts):
        return _cat_as_int8(parts)
    raise ValueError(f"cannot fuse weights of different formats {sorted(f for _, f in kinds)}")


def _cat_as_int8(parts: list[Int4Weight | Int8Weight]) -> Int8Weight:
    """Parts of different GGUF types as one int8 storage: int4 codes are int8 codes 0..15, and every part's
    group values are spelled out over the smallest group. 8-bit value codes stay codes where every part has them
    under the same super-block, else they become fp32 values (exact either way)."""
    group = min(p.group for p in parts)
    q = [p.codes if isinstance(p, Int8Weight) else unpack_nibbles(p.codes).to(torch.int8) for p in parts]

    def spelled(p, name: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        v, d = getattr(p, name), getattr(p, name + "_d")
        if name == "bias" and v is None and isinstance(p, Int4Weight):  # symmetric int4: -8 * scale
            v, d = -8 * group_values(p.scale, p.scale_d), None
        return (None if v is None else v.repeat_interleave(p.group // group, dim=1)), d

    def values(name: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        vs = [spelled(p, name) for p in parts]
        if all(v is None for v, _ in vs):
            return None, None
        per = {p.shape[1] // d.shape[1] for p, (_, d) in zip(parts, vs) if d is not None}  # weights per factor
        coded = len(per) == 1 and all(d is not None or v is None for v, d in vs)
        out, factors = [], []
        for p, (v, d) in zip(parts, vs):
            n, g = p.shape[0], p.shape[1] // group
            if coded:  # int8 value codes (K-quants' 6-bit ones fit), a zero factor where a part has none
                out.append(torch.zeros(n, g, dtype=torch.int8) if v is None else v.to(torch.int8))
                factors.append(torch.zeros(n, p.shape[1] // min(per), dtype=torch.float16) if d is None else d)
            else:
                out.append(torch.zeros(n, g) if v is None else group_values(v, d))
        return torch.cat(out), (torch.cat(factors) if coded else None)

    (scale, scale_d), (bias, bias_d) = values("scale"), values("bias")
    fmt = "+".join(dict.fromkeys(p.format for p in parts))
    return Int8Weight(torch.cat(q), scale, fmt, bias, scale_d, bias_d)
