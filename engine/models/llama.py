"""The Llama-family decoder over a flat, unpadded batch: Llama/SmolLM2, Qwen2 (qkv bias), Qwen3 (q/k norm).

This file describes the network; the layers in engine/layers/ choose their kernels. Projections are fused (q|k|v
and gate|up, `PACKED_MODULES`) so each layer runs four matmuls; `load_weights` takes Hugging Face tensor names
and writes them into the fused slices, dense or quantized.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..attention.base import AttentionBackend, AttentionMetadata
from ..config import ModelConfig
from ..layers.activation import SiluAndMul
from ..layers.embedding import Embedding
from ..layers.linear import Linear
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryEmbedding
from ..quant.weight import QuantWeight

if TYPE_CHECKING:
    from ..parallel.group import TensorParallel

# each layer's projection modules -> the Hugging Face projections each holds, in row order
PROJECTION_PIECES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
                     "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
# our fused modules
PACKED_MODULES = {ours: pieces for ours, pieces in PROJECTION_PIECES.items() if len(pieces) > 1}
# Hugging Face projection name -> (our module, piece index, number of pieces)
PROJECTIONS = {hf: (ours, i, len(pieces)) for ours, pieces in PROJECTION_PIECES.items() for i, hf in enumerate(pieces)}


class Attention(nn.Module):
    """Under tensor parallelism a rank holds whole heads (its share of query heads and the KV heads they read),
    and o_proj's partial sums meet in one all-reduce."""

    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        if tp is not None:
            share = tp.shares(cfg)
            self.num_heads, self.num_kv_heads = share.q_heads, share.kv_heads
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rope = rope  # one module shared by every layer
        self.scale = cfg.head_dim ** -0.5

    def forward(self, cos_sin: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        t, hq, hkv = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(t, hq + 2 * hkv, self.head_dim)
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qkv[:, :hq]), self.k_norm(qkv[:, hq:hq + hkv])), dim=1)
        else:
            qk = qkv[:, :hq + hkv]
        qk = self.rope.rotate(qk, *cos_sin)  # q and k in one go
        o = backend.forward(qk[:, :hq], qk[:, hq:], qkv[:, hq + hkv:], k_cache, v_cache, meta, self.scale)
        out = self.o_proj(o.view(t, self.q_size))
        return out if self.tp is None else self.tp.all_reduce(out)


class MLP(nn.Module):
    """Under tensor parallelism a rank holds a share of the intermediate columns; down_proj's partial sums meet in
    one all-reduce."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.tp = tp
        inter = cfg.intermediate_size if tp is None else tp.shares(cfg).mlp_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * inter, bias=False)
        self.act = SiluAndMul()
        self.down_proj = Linear(inter, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(self.gate_up_proj.gated(x, self.act))
        return out if self.tp is None else self.tp.all_reduce(out)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, rope, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp)

    def forward(self, cos_sin, h, k_cache, v_cache, meta, backend):
        a = self.self_attn(cos_sin, self.input_layernorm(h), k_cache, v_cache, meta, backend)
        x, h = self.post_attention_layernorm.add_and_norm(a, h)
        return h + self.mlp(x)


class LlamaModel(nn.Module):
    """`tp`: this rank's place in a tensor-parallel group (None: the whole model, no collectives). A rank holds
    its shard of every projection, of the embedding and of the LM head (vocabulary rows), and `load_weights`
    takes whole checkpoint tensors and keeps only that shard."""

    # what a weight loader needs to know of the network (engine/quant/loading.py quantizes these, and a stored
    # format knows no model), as vLLM's models state their packed modules
    projections = PROJECTION_PIECES

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.share = None if tp is None else tp.shares(cfg)
        vocab = cfg.vocab_size if tp is None else self.share.vocab_size
        self.rope = RotaryEmbedding(cfg, max_positions or cfg.max_position_embeddings)
        self.embed_tokens = Embedding(vocab, cfg.hidden_size, tp, 0 if tp is None else self.share.vocab_start)
        self.layers = nn.ModuleList(DecoderLayer(cfg, self.rope, tp) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, vocab, bias=False, row_int8=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the LM head (again after `to_empty`, which unties)."""
        if self.config.tie_word_embeddings and self.lm_head.weight is not None and \
                self.embed_tokens.weight is not None:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                backend: AttentionBackend) -> torch.Tensor:
        """Hidden states [T, hidden] for every input token (before the final norm)."""
        h = self.embed_tokens(input_ids)
        cos_sin = self.rope(positions, h.dtype)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            h = layer(cos_sin, h, k_cache, v_cache, meta, backend)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits for the rows that sample (norm and LM head only where needed). Under tensor parallelism
        every rank computes its vocabulary rows and rank 0 gathers them (the others get None)."""
        logits = self.lm_head(self.norm(hidden)).float()
        return logits if self.tp is None else self.tp.gather_vocab(logits, self.config.vocab_size)

    # ---- weights ---------------------------------------------------------------------------------
    def _pieces(self, ours: str) -> list[tuple[int, int]]:
        """(first row, rows) of each Hugging Face projection inside our module `ours`."""
        cfg = self.config
        attn = self.layers[0].self_attn
        q, kv, inter = attn.q_size, attn.kv_size, self.layers[0].mlp.down_proj.in_features
        return {"qkv_proj": [(0, q), (q, kv), (q + kv, kv)], "gate_up_proj": [(0, inter), (inter, inter)]}.get(
            ours, [(0, cfg.hidden_size)])

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantWeight]]) -> None:
        """Copy tensors named as in Hugging Face checkpoints into the (fused) parameters. A projection that was
        made quantized (`Linear.quantize_to`, before materializing) takes QuantWeights, one per piece, fused
        into one storage once all its pieces are in."""
        from ..quant.formats import cat

        params = dict(self.named_parameters())
        pending: dict[str, list] = {}
        loaded: dict[str, int] = {}  # parameter -> pieces written
        for name, tensor in weights:
            name = name.removeprefix("model.")
            parts = name.split(".")
            if (name == "lm_head.weight" and self.config.tie_word_embeddings) or "rotary_emb" in name:
                continue  # tied checkpoints sometimes store a copy of the head
            tensor = self.shard(name, tensor)
            if len(parts) >= 2 and parts[-2] in PROJECTIONS:
                ours, index, count = PROJECTIONS[parts[-2]]
                key = ".".join(parts[:-2] + [ours])
                if isinstance(tensor, QuantWeight):
                    slot = pending.setdefault(key, [None] * count)
                    slot[index] = tensor
                    if all(p is not None for p in slot):
                        self.get_submodule(key).quantize_to(cat(slot))
                        del pending[key]
                    continue
                target = f"{key}.{parts[-1]}"
                start, rows = self._pieces(ours)[index]
                if target not in params or tensor.shape[0] != rows:
                    raise ValueError(f"{name}: expected {rows} rows, got {tuple(tensor.shape)}")
                params[target][start:start + rows].copy_(tensor)
                loaded[target] = loaded.get(target, 0) + 1
            elif name in params:
                if params[name].shape != tensor.shape:
                    raise ValueError(f"{name}: expected {tuple(params[name].shape)}, got {tuple(tensor.shape)}")
                params[name].copy_(tensor)
                loaded[name] = 1
            else:
                raise ValueError(f"unexpected weight {name!r} for architecture {self.config.architecture}")
        pieces = lambda n: len(PACKED_MODULES.get(n.split(".")[-2], ("",)))
        missing = list(pending) + [n for n in params if loaded.get(n, 0) != pieces(n)]
        if missing:
            raise ValueError(f"checkpoint is missing weights for {missing[:8]} ({len(missing)} parameters)")

    def shard(self, name: str, tensor: torch.Tensor | QuantWeight) -> torch.Tensor | QuantWeight:
        """This rank's part of the whole checkpoint tensor `name` (Hugging Face's, without "model."): rows of a
        column-parallel projection (whole heads for q/k/v), columns of a row-parallel one, vocabulary rows of the
        embedding and LM head; norms whole. The tensor itself without tensor parallelism."""
        if self.tp is None:
            return tensor
        parts = name.split(".")
        leaf = parts[-2] if len(parts) >= 2 else ""
        s, hd = self.share, self.config.head_dim
        if name in ("embed_tokens.weight", "lm_head.weight"):
            dim, start, length = 0, s.vocab_start, s.vocab_size
        elif leaf == "q_proj":
            dim, start, length = 0, s.q_start * hd, s.q_heads * hd
        elif leaf in ("k_proj", "v_proj"):
            dim, start, length = 0, s.kv_start * hd, s.kv_heads * hd
        elif leaf in ("gate_proj", "up_proj"):
            dim, start, length = 0, s.mlp_start, s.mlp_size
        elif leaf == "o_proj" and parts[-1] == "weight":
            dim, start, length = 1, s.q_start * hd, s.q_heads * hd
        elif leaf == "down_proj" and parts[-1] == "weight":
            dim, start, length = 1, s.mlp_start, s.mlp_size
        else:
            return tensor
        # dense: a view (load_weights copies it into the shard's parameter); quantized: along the format's groups
        return tensor.narrow(dim, start, length)

    @torch.no_grad()
    def init_random(self, seed: int = 0, std: float = 0.02) -> None:
        """Random weights from `seed`; under tensor parallelism each rank draws the whole model's tensors in the
        same order and keeps its shard, so every group size serves the same model."""
        gen = torch.Generator().manual_seed(seed)
        whole = None
        if self.tp is not None:
            with torch.device("meta"):
                whole = dict(LlamaModel(self.config, 1).named_parameters())
        for name, p in self.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            elif whole is None:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            else:
                p.copy_(self._shard_ours(name, torch.randn(whole[name].shape, generator=gen) * std))

    def _shard_ours(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """`shard` for a whole tensor of our own (fused) parameter `name`: each fused piece sharded on its own."""
        parts = name.split(".")
        if len(parts) < 2 or parts[-2] not in PACKED_MODULES:
            return self.shard(name, tensor)
        cfg = self.config
        q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
        rows = {"qkv_proj": (q, kv, kv), "gate_up_proj": (inter, inter)}[parts[-2]]
        pieces = torch.split(tensor, rows)
        return torch.cat([self.shard(".".join(parts[:-2] + [hf, parts[-1]]), t)
                          for hf, t in zip(PACKED_MODULES[parts[-2]], pieces)])
