"""Drop-in modules over quantized storage: the model calls them like nn.Linear / nn.Embedding."""

from __future__ import annotations

import torch
from torch import nn

from engine.quant.formats import Int8Weight, QuantWeight


class QuantLinear(nn.Module):
    """y = x W^T (+ b) with W held quantized; the storage picks its kernel from x's row count."""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.qweight: QuantWeight | None = None
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def set_weight(self, qweight: QuantWeight, device: torch.device, dtype: torch.dtype) -> None:
        if qweight.shape != (self.out_features, self.in_features):
            raise ValueError(f"quantized weight {qweight.shape} for a {self.out_features}x{self.in_features} linear")
        qweight.prepare(device, dtype)
        self.qweight = qweight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.qweight.matmul(x.reshape(-1, self.in_features)).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def fused_operands(self) -> tuple[list[torch.Tensor], int] | None:
        """This projection's operands for the fused decode layer (engine/csrc/decode_layer.cpp) and the most rows
        it serves there, or None where the storage has no GEMV of ours."""
        ops = self.qweight.gemv_operands() if self.qweight is not None else None
        if ops is None:
            return None
        return ops[0] + ([self.bias] if self.bias is not None else []), ops[1]

    def extra_repr(self) -> str:
        fmt = self.qweight.format if self.qweight is not None else "?"
        return f"in={self.in_features}, out={self.out_features}, format={fmt}"


class QuantEmbedding(nn.Module):
    """Token embedding from int8 rows (per-row or llama.cpp Q8_0's per-32 scales), dequantized on lookup."""

    def __init__(self, qweight: Int8Weight, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        qweight.prepare(device, dtype)
        self.qweight = qweight
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.qweight.rows(ids, self.dtype)


def weight_bytes_by_format(model: nn.Module) -> dict[str, int]:
    """Resident weight bytes per storage format ("bf16", "float32", "int8", ...), shared tensors once."""
    out: dict[str, int] = {}
    seen: set[int] = set()
    for m in model.modules():
        qw = getattr(m, "qweight", None)
        if isinstance(qw, QuantWeight) and id(qw) not in seen:
            seen.add(id(qw))
            out[qw.format] = out.get(qw.format, 0) + qw.nbytes
    for p in list(model.parameters()) + [getattr(m, "packed", None) for m in model.modules()]:
        if p is None or id(p) in seen or p.numel() == 0:
            continue
        seen.add(id(p))
        key = str(p.dtype).removeprefix("torch.")
        out[key] = out.get(key, 0) + p.numel() * p.element_size()
    return out
