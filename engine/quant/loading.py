"""Quantize on load: projection weights go straight from the checkpoint stream into quantized storage.

The model is built on the meta device with the projections (and optionally the LM head and embeddings) marked
quantized (`prepare_modules`), so no full-precision copy of those weights is ever allocated; `quantized_stream`
turns each checkpoint tensor into its storage on the way to `LlamaModel.load_weights`. GGUF Q4_0/Q4_1 tensors
become `int4` (group 32) storage and Q8_0 embeddings int8 (group 32) storage without a dense round trip.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.engine.layers.dispatch import KernelTable
from pagedserve.engine.layers.linear import Linear
from pagedserve.engine.models.llama import PROJECTIONS
from pagedserve.engine.quant.formats import FORMATS, default_group_size, quantize
from pagedserve.engine.quant.int4 import Int4Weight
from pagedserve.engine.quant.int8 import Int8Weight
from pagedserve.engine.quant.layouts import pack_nibbles
from pagedserve.engine.quant.weight import QuantWeight

logger = logging.getLogger(__name__)

GGUF_DIRECT = ("Q8_0", "Q4_0", "Q4_1")
TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


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
            return Int4Weight(pack_nibbles(codes), d, zero, "int4", group=32)
        return None


def quantize_tensor(t: torch.Tensor | GGUFBlocks, spec: QuantSpec, group: int, embedding: bool = False) -> QuantWeight:
    """One checkpoint tensor -> storage: GGUF blocks directly where the layout allows (`from_blocks` set), else
    quantized (embeddings: int8 rows)."""
    if isinstance(t, GGUFBlocks):
        qw = t.direct(spec.format, group, embedding)
        if qw is not None:
            qw.from_blocks = True
            return qw
        t = t.dequantize()
    return Int8Weight.quantize(t) if embedding else quantize(t, spec.format, group)


def resolve_group_size(spec: QuantSpec, model, gguf_q4: bool) -> int:
    if spec.group_size is not None:
        return spec.group_size
    if gguf_q4 and spec.format == "int4":
        return 32  # llama.cpp's Q4 blocks map onto int4 storage directly
    cfg = model.config
    return default_group_size([cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.intermediate_size])


def prepare_modules(model, spec: QuantSpec) -> None:
    """On the meta model: the projections (and LM head, embeddings) will hold quantized storage, so the dense
    weights are never allocated."""
    targets = TARGETS + (("lm_head",) if spec.lm_head else ())
    for name, module in model.named_modules():
        if isinstance(module, Linear) and name.split(".")[-1] in targets:
            module.weight = None
    if spec.lm_head:  # embeddings too: an int8 row lookup
        model.embed_tokens.weight = None


def quantized_stream(model, weights: Iterable[tuple[str, torch.Tensor | GGUFBlocks]], spec: QuantSpec, group: int,
                     dtype: torch.dtype, device: torch.device, table: KernelTable) -> Iterator[tuple[str, object]]:
    """The checkpoint stream for `model.load_weights`, projections as their quantized storage (GGUF blocks mapped
    directly where the layout allows); embeddings and the LM head are set here."""
    tied = model.config.tie_word_embeddings
    head_spec = QuantSpec(spec.head_format, spec.group_size)
    stats = {"direct": 0, "quantized": 0}

    def to_quant(t, embedding: bool = False, head: bool = False) -> QuantWeight:
        qw = quantize_tensor(t, head_spec if head else spec, group, embedding)
        stats["direct" if getattr(qw, "from_blocks", False) else "quantized"] += 1
        return qw

    for name, t in weights:
        short = name.removeprefix("model.")
        parts = short.split(".")
        if spec.lm_head and short == "embed_tokens.weight":
            emb = to_quant(t, embedding=True)
            model.embed_tokens.quantize_to(emb, dtype)
            if tied:  # one int8 copy serves both where the formats agree (per row, or Q8_0 where our kernels run)
                ours = table.cpp and device.type == "cpu" and emb.panels_fit()
                same = spec.head_format == "int8" and (emb.group == emb.shape[1] or ours)
                model.lm_head.quantize_to(emb if same else to_quant(t, head=True))
            continue
        if short == "lm_head.weight" and spec.lm_head:
            if not tied:
                model.lm_head.quantize_to(to_quant(t, head=True))
            continue
        if len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in PROJECTIONS:
            yield name, to_quant(t)
            continue
        yield name, (t.dequantize() if isinstance(t, GGUFBlocks) else t)
    logger.info("quantized to %s (group %d): %d tensors mapped directly from GGUF blocks, %d quantized on load",
                spec.format, group, stats["direct"], stats["quantized"])


def quantize_model(model, spec: QuantSpec, group: int | None = None) -> None:
    """Quantize an already-built dense model in place (random weights; tests)."""
    group = group or resolve_group_size(spec, model, False)
    dtype = next(model.parameters()).dtype
    for name, m in model.named_modules():
        if isinstance(m, Linear) and name.split(".")[-1] in TARGETS:
            m.quantize_to(quantize(m.weight.detach().float(), spec.format, group))
    if spec.lm_head:
        emb = model.embed_tokens.weight.detach().float()
        head = None if model.config.tie_word_embeddings else model.lm_head.weight.detach().float()
        e = Int8Weight.quantize(emb)
        model.embed_tokens.quantize_to(e, dtype)
        source = emb if head is None else head
        model.lm_head.quantize_to(e if head is None and spec.head_format == "int8" else
                                  quantize(source, spec.head_format, group))
