"""Quantize on load: projection weights go straight from the checkpoint stream into quantized storage.

The model is built on the meta device with `QuantLinear`s where projections (and optionally the LM head
and embeddings) will be, so no full-precision copy of those weights is ever allocated; at most one
fused module's pieces are dense at a time. GGUF Q4_0/Q4_1 tensors become `int4` (group 32) storage and
Q8_0 embeddings become int8 (group 32) storage without a dense round trip.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from engine.quant.formats import FORMATS, Int4Weight, Int8Weight, QuantWeight, cat, default_group_size, quantize
from engine.quant.modules import QuantEmbedding, QuantLinear

logger = logging.getLogger(__name__)

GGUF_DIRECT = ("Q8_0", "Q4_0", "Q4_1")


@dataclass(frozen=True)
class QuantSpec:
    """What to quantize and how. `group_size=None`: 32 for a GGUF of Q4 blocks, else `default_group_size`."""

    format: str
    group_size: int | None = None
    quantize_lm_head: bool | None = None  # None: on for int8, int8-tensor and int4; off for nf4 and int4-tensor

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"unknown quantization {self.format!r}; choose from none, {', '.join(FORMATS)}")
        if self.group_size is not None and self.group_size not in (32, 64, 128, 256):
            raise ValueError(f"quant_group_size must be 32, 64, 128 or 256, got {self.group_size}")

    @property
    def lm_head(self) -> bool:
        if self.quantize_lm_head is None:
            return self.format in ("int8", "int8-tensor", "int4")
        return self.quantize_lm_head

    @property
    def head_format(self) -> str:
        """The LM head's format: int4 keeps it in int8 rows (as llama.cpp keeps its output matrix at 8 bits or
        more), because the head is where 4-bit error hurts the chosen token most and it is a fifth of the bytes."""
        return "int8" if self.format == "int4" else self.format

    @classmethod
    def from_options(cls, quantization: str | None, group_size: int | None = None,
                     quantize_lm_head: bool | None = None) -> QuantSpec | None:
        if quantization in (None, "none", ""):
            return None
        return cls(quantization, group_size, quantize_lm_head)


class GGUFBlocks:
    """A llama.cpp block-quantized tensor, kept as its raw bytes [rows, bytes per row]."""

    def __init__(self, kind: str, data: np.ndarray, shape: tuple[int, int]) -> None:
        self.kind, self.data, self.shape = kind, data, shape

    def dequantize(self) -> torch.Tensor:
        import gguf

        dense = gguf.quants.dequantize(self.data, gguf.GGMLQuantizationType[self.kind])
        return torch.from_numpy(np.asarray(dense, dtype=np.float32).reshape(self.shape))

    def direct(self, fmt: str, group: int, embedding: bool = False) -> QuantWeight | None:
        """Our storage holding exactly these values, where the layout allows; else None."""
        n, k = self.shape
        raw = torch.from_numpy(np.array(self.data)).view(n, k // 32, -1)
        if self.kind == "Q8_0" and embedding:  # [d: fp16][32 x int8]
            d = raw[:, :, :2].contiguous().view(torch.float16).view(n, k // 32)
            q = raw[:, :, 2:].contiguous().view(torch.int8).reshape(n, k)
            return Int8Weight(q, d, "int8")
        if self.kind in ("Q4_0", "Q4_1") and fmt == "int4" and group == 32:
            head = 2 if self.kind == "Q4_0" else 4  # [d][m (Q4_1)][16 bytes: x_j low, x_{j+16} high]
            d = raw[:, :, :2].contiguous().view(torch.float16).view(n, k // 32)
            b = raw[:, :, head:]
            codes = torch.cat((b & 15, b >> 4), dim=-1).reshape(n, k)  # element order within the block
            zero = None
            if self.kind == "Q4_1":  # d*c + m = (c - 8) d + (m + 8 d)
                m = raw[:, :, 2:4].contiguous().view(torch.float16).float().view(n, k // 32)
                zero = m + 8 * d.float()
            from engine.quant.formats import pack_nibbles

            return Int4Weight(pack_nibbles(codes), d, zero, "int4", group=32)
        return None


def quantize_tensor(t: torch.Tensor | GGUFBlocks, spec: QuantSpec, group: int, embedding: bool = False) -> QuantWeight:
    """One checkpoint tensor -> storage: GGUF blocks directly where the layout allows, else quantized
    (embeddings: int8 rows)."""
    if isinstance(t, GGUFBlocks):
        qw = t.direct(spec.format, group, embedding)
        if qw is not None:
            qw.from_blocks = True
            return qw
        t = t.dequantize()
    return Int8Weight.quantize(t) if embedding else quantize(t, spec.format, group)


def _fused_table(model) -> dict[str, tuple[str, int, int]]:
    """HF projection name -> (our fused module suffix, piece index, number of pieces)."""
    return {"q_proj": ("qkv_proj", 0, 3), "k_proj": ("qkv_proj", 1, 3), "v_proj": ("qkv_proj", 2, 3),
            "gate_proj": ("gate_up_proj", 0, 2), "up_proj": ("gate_up_proj", 1, 2),
            "o_proj": ("o_proj", 0, 1), "down_proj": ("down_proj", 0, 1)}


def resolve_group_size(spec: QuantSpec, model, gguf_q4: bool) -> int:
    if spec.group_size is not None:
        return spec.group_size
    if gguf_q4 and spec.format == "int4":
        return 32  # llama.cpp's Q4 blocks map onto int4 storage directly
    cfg = model.config
    return default_group_size([cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.intermediate_size])


def prepare_modules(model, spec: QuantSpec) -> None:
    """On the meta model: swap the projections (and LM head) for QuantLinears, before any allocation."""
    from engine.models.llama import Linear

    targets = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj") + (("lm_head",) if spec.lm_head else ())
    model.reset_fused()  # the fused decode layer's operands are rebuilt from the new modules
    for name, module in list(model.named_modules()):
        if isinstance(module, Linear) and name.split(".")[-1] in targets:
            parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
            bias = None if module.bias is None else module.bias
            setattr(parent, name.split(".")[-1], QuantLinear(module.in_features, module.out_features, bias))
    if spec.lm_head:  # embeddings too: an int8 row lookup
        model.embed_tokens = nn.Module()  # placeholder; filled by `load`


def load(model, weights: Iterable[tuple[str, torch.Tensor | GGUFBlocks]], spec: QuantSpec,
         dtype: torch.dtype, device: torch.device, group: int) -> None:
    """Feed the checkpoint stream: projections are quantized per fused module, the rest goes to
    `model.load_weights` as before."""
    table = _fused_table(model)
    tied = model.config.tie_word_embeddings
    pending: dict[str, list] = {}
    stats = {"direct": 0, "quantized": 0}

    head_spec = QuantSpec(spec.head_format, spec.group_size)

    def to_quant(t, embedding: bool = False, head: bool = False) -> QuantWeight:
        qw = quantize_tensor(t, head_spec if head else spec, group, embedding)
        stats["direct" if isinstance(t, GGUFBlocks) and getattr(qw, "from_blocks", False) else "quantized"] += 1
        return qw

    def rest() -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in weights:
            short = name.removeprefix("model.")
            parts = short.split(".")
            if spec.lm_head and short == "embed_tokens.weight":
                emb = to_quant(t, embedding=True)
                model.embed_tokens = QuantEmbedding(emb, dtype, device)
                if tied:  # one int8 copy serves both where the formats agree (per row, or Q8_0 where our kernels run)
                    same = spec.head_format == "int8" and (emb.group == emb.shape[1] or emb.kernels_take(device))
                    head = emb if same else to_quant(t, head=True)
                    model.lm_head.set_weight(head, device, dtype)
                continue
            if short == "lm_head.weight" and spec.lm_head:
                if not tied:
                    model.lm_head.set_weight(to_quant(t, head=True), device, dtype)
                continue
            if len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in table:
                ours, idx, count = table[parts[-2]]
                key = ".".join(parts[:-2] + [ours])
                slot = pending.setdefault(key, [None] * count)
                slot[idx] = to_quant(t)
                if all(p is not None for p in slot):
                    model.get_submodule(key).set_weight(cat(slot), device, dtype)
                    del pending[key]
                continue
            yield name, (t.dequantize() if isinstance(t, GGUFBlocks) else t)

    model.load_weights(rest())
    missing = [n for n, m in model.named_modules() if isinstance(m, QuantLinear) and m.qweight is None]
    if missing or pending or not isinstance(model.embed_tokens, (nn.Embedding, QuantEmbedding)):
        raise ValueError(f"checkpoint is missing quantized weights for {(missing or list(pending) or ['embed'])[:8]}")
    logger.info("quantized to %s (group %d): %d tensors mapped directly from GGUF blocks, %d quantized on load",
                spec.format, group, stats["direct"], stats["quantized"])


def quantize_model(model, spec: QuantSpec, group: int | None = None) -> None:
    """Quantize an already-built dense model in place (random weights; tests)."""
    from engine.models.llama import Linear

    group = group or resolve_group_size(spec, model, False)
    p = next(model.parameters())
    dtype, device = p.dtype, p.device
    weights = []
    for name, m in model.named_modules():
        if isinstance(m, Linear) and name.split(".")[-1] in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            weights.append((name, m.weight.detach().float()))
    emb = model.embed_tokens.weight.detach().float()
    head = None if model.config.tie_word_embeddings else model.lm_head.weight.detach().float()
    prepare_modules(model, spec)
    for name, w in weights:
        model.get_submodule(name).set_weight(quantize(w, spec.format, group), device, dtype)
    if spec.lm_head:
        e = Int8Weight.quantize(emb)
        model.embed_tokens = QuantEmbedding(e, dtype, device)
        source = emb if head is None else head
        qh = e if head is None and spec.head_format == "int8" else quantize(source, spec.head_format, group)
        model.lm_head.set_weight(qh, device, dtype)
