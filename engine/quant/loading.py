"""Quantized weights on load: straight from the checkpoint stream into quantized storage.

The model is built on the meta device with the projections (and optionally the LM head and embeddings) marked
quantized (`prepare_modules`), so no full-precision copy of those weights is ever allocated; `quantized_stream`
turns each checkpoint tensor into its storage on the way to `LlamaModel.load_weights`.

The model says which modules are its projections and which checkpoint tensors each holds (`model.projections`:
module -> checkpoint names, in row order); nothing here knows the network.

`auto` (the default) serves a GGUF's quantized tensors at the file's own bits, each type mapped exactly
(engine/quant/gguf_blocks.py; a type with no mapping becomes int8 rows), as llama.cpp does; a float checkpoint
stays dense. A named format (`int8`, `int4`, ...) requantizes, taking GGUF blocks directly where they already are
that format (Q4_0/Q4_1 for int4 at group 32, a Q8_0 embedding for int8 rows).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from ..layers.dispatch import KernelTable
from ..layers.linear import Linear
from .formats import FORMATS, default_group_size, quantize
from .gguf_blocks import GGUFBlocks
from .int8 import Int8Weight
from .weight import QuantWeight

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class QuantSpec:
    """What to quantize and how. `group_size=None`: 32 for a GGUF of Q4 blocks, else `default_group_size`.
    `auto`: a GGUF's quantized tensors as they are (LM head and embeddings included)."""

    format: str
    group_size: int | None = None
    quantize_lm_head: bool | None = None  # None: on for int8, int8-tensor and int4; off for nf4 and int4-tensor

    def __post_init__(self) -> None:
        if self.format not in FORMATS + ("auto",):
            raise ValueError(f"unknown quantization {self.format!r}; choose from none, {', '.join(FORMATS)}")
        if self.group_size is not None and self.group_size not in (32, 64, 128, 256):
            raise ValueError(f"quant_group_size must be 32, 64, 128 or 256, got {self.group_size}")

    @property
    def lm_head(self) -> bool:
        if self.quantize_lm_head is None:
            return self.format in ("auto", "int8", "int8-tensor", "int4")
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


def quantize_tensor(t: torch.Tensor | GGUFBlocks, spec: QuantSpec, group: int, embedding: bool = False) -> QuantWeight:
    """One checkpoint tensor -> storage (`from_blocks` set where GGUF blocks were taken as they are).

    `auto`: GGUF blocks of a mapped type as they are, others int8 rows. A named format: blocks that already are
    it (Q4_0/Q4_1 for int4 at group 32; a Q8_0 embedding for int8), else quantized (embeddings: int8 rows)."""
    if isinstance(t, GGUFBlocks) and t.mapped:
        as_is = spec.format == "auto" or (
            spec.format == "int4" and group == 32 and t.kind in ("Q4_0", "Q4_1") and not embedding) or (
            embedding and t.kind == "Q8_0")
        if as_is:
            qw = t.storage()
            if spec.format != "auto":
                qw.format = "int8" if embedding else spec.format
            qw.from_blocks = True
            return qw
    if isinstance(t, GGUFBlocks):
        t = t.dequantize()
    return Int8Weight.quantize(t) if embedding or spec.format == "auto" else quantize(t, spec.format, group)


def resolve_group_size(spec: QuantSpec, model, gguf_q4: bool, tp_size: int = 1) -> int:
    """int4's group: 32 on a GGUF of Q4 blocks (they map directly), else `default_group_size` (of the in-features
    a tensor-parallel rank holds too: row-parallel shards cut along whole groups). (auto: unused.)"""
    if spec.group_size is not None:
        return spec.group_size
    if gguf_q4 and spec.format == "int4":
        return 32  # llama.cpp's Q4 blocks map onto int4 storage directly
    cfg = model.config
    sizes = [cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.intermediate_size]
    return default_group_size(sizes + ([sizes[1] // tp_size, sizes[2] // tp_size] if tp_size > 1 else []))


def prepare_modules(model, spec: QuantSpec, quantized: set[str] | None = None) -> None:
    """On the meta model: the projections (and LM head, embeddings) will hold quantized storage, so the dense
    weights are never allocated. `quantized`: with auto, the HF names of the checkpoint's quantized tensors (only
    those modules are marked; a tied LM head follows the embedding)."""
    targets = tuple(model.projections) + (("lm_head",) if spec.lm_head else ())

    def marked(module_name: str) -> bool:
        if quantized is None:
            return True
        if module_name == "lm_head" and model.config.tie_word_embeddings:
            return "embed_tokens.weight" in quantized
        prefix, _, leaf = module_name.removeprefix("model.").rpartition(".")
        # the checkpoint names the module is made of (a fused projection: its pieces)
        names = [f"{prefix}.{hf}" if prefix else hf for hf in model.projections.get(leaf, (leaf,))]
        return any(n + ".weight" in quantized for n in names)

    for name, module in model.named_modules():
        if isinstance(module, Linear) and name.split(".")[-1] in targets and marked(name):
            module.weight = None
    if spec.lm_head and marked("embed_tokens"):  # embeddings too: a row lookup
        model.embed_tokens.weight = None


def quantized_stream(model, weights: Iterable[tuple[str, torch.Tensor | GGUFBlocks]], spec: QuantSpec, group: int,
                     dtype: torch.dtype, device: torch.device, table: KernelTable) -> Iterator[tuple[str, object]]:
    """The checkpoint stream for `model.load_weights`, projections as their quantized storage (GGUF blocks mapped
    directly where the layout allows); embeddings and the LM head are set here."""
    tied = model.config.tie_word_embeddings
    auto = spec.format == "auto"
    projections = {hf for pieces in model.projections.values() for hf in pieces}  # the checkpoint's names
    head_spec = QuantSpec(spec.head_format, spec.group_size)
    stats: Counter[str] = Counter()  # tensors taken from GGUF blocks as they are ("direct"), and quantized
    types: Counter[str] = Counter()

    def to_quant(t, embedding: bool = False, head: bool = False) -> QuantWeight:
        qw = quantize_tensor(t, head_spec if head else spec, group, embedding)
        stats["direct" if getattr(qw, "from_blocks", False) else "quantized"] += 1
        types[qw.format] += 1
        return qw

    for name, t in weights:
        short = name.removeprefix("model.")
        parts = short.split(".")
        if auto and not isinstance(t, GGUFBlocks):  # a float tensor stays dense
            yield name, t
            continue
        if spec.lm_head and short == "embed_tokens.weight":
            emb = model.shard("embed_tokens.weight", to_quant(t, embedding=True))  # a TP rank's vocabulary rows
            model.embed_tokens.quantize_to(emb, dtype)
            if tied:  # one copy serves both where the formats agree (per row, or panels where our kernels run)
                same = (auto or spec.head_format == "int8") and (emb.our_kernels(table, device) or (
                    isinstance(emb, Int8Weight) and emb.plain and emb.group == emb.shape[1]))
                model.lm_head.quantize_to(emb if same else model.shard("lm_head.weight", to_quant(t, head=True)))
            continue
        if short == "lm_head.weight" and spec.lm_head:
            if not tied:
                model.lm_head.quantize_to(model.shard("lm_head.weight", to_quant(t, head=True)))
            continue
        if len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in projections:
            yield name, to_quant(t)
            continue
        yield name, (t.dequantize() if isinstance(t, GGUFBlocks) else t)
    kinds = ", ".join(f"{n} {k}" for k, n in sorted(types.items()))
    if auto:
        logger.info("GGUF weights at their own bits: %s (%d tensors as the file holds them, %d as int8 rows)",
                    kinds, stats["direct"], stats["quantized"])
    else:
        logger.info("quantized to %s (group %d): %d tensors mapped directly from GGUF blocks, %d quantized on load "
                    "(%s)", spec.format, group, stats["direct"], stats["quantized"], kinds)


def quantize_model(model, spec: QuantSpec, group: int | None = None) -> None:
    """Quantize an already-built dense model in place (random weights; tests)."""
    group = group or resolve_group_size(spec, model, False)
    dtype = next(model.parameters()).dtype
    for name, m in model.named_modules():
        if isinstance(m, Linear) and name.split(".")[-1] in model.projections:
            m.quantize_to(quantize(m.weight.detach().float(), spec.format, group))
    if spec.lm_head:
        emb = model.embed_tokens.weight.detach().float()
        head = None if model.config.tie_word_embeddings else model.lm_head.weight.detach().float()
        e = Int8Weight.quantize(emb)
        model.embed_tokens.quantize_to(e, dtype)
        source = emb if head is None else head
        model.lm_head.quantize_to(e if head is None and spec.head_format == "int8" else
                                  quantize(source, spec.head_format, group))
