"""Llama-family decoder over a flat, unpadded batch: Llama/SmolLM2, Qwen2 (qkv bias), Qwen3 (q/k norm).

Projections are fused (q|k|v and gate|up) so each layer runs four matmuls; `load_weights` takes
Hugging Face tensor names and writes them into the fused slices.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine import cpu_kernels
from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.attention.cpu_paged import QUERY_TILE, CpuPagedAttention
from engine.compiled import packed_linear
from engine.config import ModelConfig


def fused_ops(x: torch.Tensor) -> bool:
    """Whether the C++ layer ops (engine/csrc/layer_ops.cpp) serve x: on the CPU, built, and not under
    torch.compile (which traces the PyTorch ops instead)."""
    return x.device.type == "cpu" and not torch.compiler.is_compiling() and cpu_kernels.load()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.dtype == self.weight.dtype and fused_ops(x):
            return torch.ops.pagedserve.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # normalise in fp32 then scale in the model dtype, as the reference does (and on CPUs the
        # fp32 kernel is ~3x faster than the bf16 one)
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)


# Up to this many rows our GEMV (engine/csrc/dense_linear.cpp) beats both oneDNN paths, in fp32 and bf16
# (benchmarks/kernels/bench_dense_linear.py: 0.45-0.72x at M = 1-2 on Zen 4; 0.65-1.25x at M = 4)
DENSE_GEMV_MAX_M = 2
# The fused decode layer takes our GEMV further: at 3-8 rows it is up to ~1.5x slower than oneDNN's, but one
# C++ call a layer saves the ~7 ms a step that the per-op path spends in Python and the dispatcher
# (SmolLM2 bf16 on Zen 4, benchmarks/kernels/bench_fused_decode.py: B = 3-4 decode steps 20.8 -> 13.5 ms,
# B = 8 25.9 -> 23.5 ms; B = 12 is slower fused)
FUSED_DENSE_MAX_M = 8


class Linear(nn.Linear):
    """nn.Linear with two CPU fast paths: our GEMV for a row or two (it reads the plain row-major weight) and a
    oneDNN-prepacked copy for more rows (bf16 on CPU: ~1.4x faster than the plain weight)."""

    packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= DENSE_GEMV_MAX_M and self.weight.numel() and fused_ops(x):
            return torch.ops.pagedserve.dense_linear(x, self.weight, self.bias)
        if self.packed is not None:
            if torch.compiler.is_compiling():  # an opaque op: inductor cannot lower it with the weight as an input
                return packed_linear(x, self.packed, self.bias)
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def fused_operands(self) -> tuple[list[torch.Tensor], int] | None:
        """What torch.ops.pagedserve.decode_layer takes for this projection (engine/csrc/decode_layer.cpp) and
        the most rows it serves there, or None where only the packed weight is left."""
        if not self.weight.numel():
            return None
        return [self.weight] + ([self.bias] if self.bias is not None else []), FUSED_DENSE_MAX_M

    def pack(self, keep_weight: bool = False) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)
        if not keep_weight:  # without the plain copy every row count takes the packed path
            self.weight.data = self.weight.data.new_empty(0)


def rope_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the attention scaling factor for the config's RoPE variant."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq, 1.0
    if kind == "freq_factors":  # llama.cpp's form of llama3 scaling: a divisor per frequency (rope_freqs.weight)
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32), 1.0
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "llama3":
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        old_len = float(scaling.get("original_max_position_embeddings", cfg.max_position_embeddings))
        beta_fast, beta_slow = float(scaling.get("beta_fast", 32)), float(scaling.get("beta_slow", 1))

        def correction_dim(rotations: float) -> float:
            return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))

        low = max(math.floor(correction_dim(beta_fast)), 0)
        high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
        ramp = (torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)
        extrapolation = 1 - ramp.clamp(0, 1)
        inv = inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation
        mscale = float(scaling.get("attention_factor") or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0))
        return inv, mscale
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3, yarn)")


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) RoPE with a precomputed fp32 cos/sin table indexed by position."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.cfg, self.max_positions = cfg, max_positions
        self.register_buffer("cos", torch.empty(max_positions, cfg.head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, cfg.head_dim), persistent=False)
        self.build()

    def build(self) -> None:
        """(Re)compute the table in place, e.g. after the module was created on the meta device."""
        if self.cos.is_meta:
            return
        inv_freq, mscale = rope_inv_freq(self.cfg)
        freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float32), inv_freq).to(self.cos.device)
        freqs = torch.cat((freqs, freqs), dim=-1)
        self.cos = freqs.cos() * mscale
        self.sin = freqs.sin() * mscale

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, D] for this step's positions, shared by every layer."""
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x' = x * cos + rotate_half(x) * sin; in place on the CPU (x is a view of the step's fresh qkv)."""
    if cos.dtype == x.dtype and fused_ops(x):
        torch.ops.pagedserve.rope_(x, cos, sin)
        return x
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.head_dim ** -0.5

    def project(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor):
        """q [T, Hq, D], k and v [T, Hkv, D]: the projection, q/k norms and RoPE."""
        t, hq, hkv = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(t, hq + 2 * hkv, self.head_dim)
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qkv[:, :hq]), self.k_norm(qkv[:, hq:hq + hkv])), dim=1)
        else:
            qk = qkv[:, :hq + hkv]
        qk = apply_rope(qk, *rope)  # q and k in one go
        return qk[:, :hq], qk[:, hq:], qkv[:, hq + hkv:]

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x, k_cache, v_cache, meta: AttentionMetadata,
                backend: AttentionBackend):
        o = backend.forward(*self.project(rope, x), k_cache, v_cache, meta, self.scale)
        return self.o_proj(o.view(x.shape[0], self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if fused_ops(x):
            return self.down_proj(torch.ops.pagedserve.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, rope, h, k_cache, v_cache, meta, backend):
        a = self.self_attn(rope, self.input_layernorm(h), k_cache, v_cache, meta, backend)
        norm = self.post_attention_layernorm
        if h.dtype == norm.weight.dtype and h.is_contiguous() and fused_ops(h):
            # h += a in place (h is this step's own tensor) and the norm of the sum, in one pass
            return h + self.mlp(torch.ops.pagedserve.add_rms_norm(a, h, norm.weight, norm.eps))
        h = h + a
        return h + self.mlp(norm(h))

    # The layer without its attention, in two halves (what engine/compiled.py compiles)
    def pre_attention(self, rope: tuple[torch.Tensor, torch.Tensor], h: torch.Tensor):
        return self.self_attn.project(rope, self.input_layernorm(h))

    def post_attention(self, o: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn.o_proj(o.view(o.shape[0], -1))
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.rope = RotaryEmbedding(cfg, max_positions or cfg.max_position_embeddings)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the LM head (again after `to_empty`, which unties)."""
        if self.config.tie_word_embeddings and isinstance(self.lm_head, Linear):  # not when quantized
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                backend: AttentionBackend, halves: tuple | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] for every input token (before the final norm).

        `halves`: (pre, post) callables standing for DecoderLayer.pre_attention / post_attention (compiled
        ones, engine/compiled.py); the attention between them always runs eagerly."""
        h = self.embed_tokens(input_ids)
        rope = self.rope(positions, h.dtype)
        if halves is None and self._fused_step(h, meta, backend, kv_caches):
            # a small decode on the CPU: each layer in one C++ call, the same kernels in the same order
            plan = backend.plan(meta, kv_caches[0][0].shape[2], h.dtype)
            attn = self.layers[0].self_attn
            cos, sin = rope
            step = (*plan.kernel_args, attn.num_heads, attn.scale, QUERY_TILE, plan.splits)
            op = torch.ops.pagedserve.decode_layer
            for (k_cache, v_cache), layer in zip(kv_caches, self._fused):
                op(h, *layer, cos, sin, k_cache, v_cache, plan.slots, *step)
            return h
        if halves is None:
            for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
                h = layer(rope, h, k_cache, v_cache, meta, backend)
            return h
        pre, post = halves
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            o = backend.forward(*pre(layer, rope, h), k_cache, v_cache, meta, layer.self_attn.scale)
            h = post(layer, o, h)
        return h

    # ---- the fused decode layer (engine/csrc/decode_layer.cpp) ---------------------------------------
    # per layer: the norms' weights, eps and the four projections' operands, once built (module attribute lookups
    # cost ~5 us a layer each step)
    _fused: list | None = None
    _fused_max_tokens = 0

    def reset_fused(self) -> None:
        """Forget the fused layer's operands (after the projections' weights were replaced or repacked)."""
        self._fused, self._fused_max_tokens = None, 0

    def _build_fused(self) -> None:
        self._fused, self._fused_max_tokens = [], 0
        if self.config.qk_norm:  # Qwen3's per-head q/k norms are not in the fused layer
            return
        layers, limit = [], 1 << 30
        for layer in self.layers:
            ops = [m.fused_operands() if hasattr(m, "fused_operands") else None
                   for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                             layer.mlp.down_proj)]
            if any(op is None for op in ops):
                return
            layers.append((layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                           layer.input_layernorm.eps, *(op[0] for op in ops)))
            limit = min([limit] + [op[1] for op in ops])
        self._fused, self._fused_max_tokens = layers, limit

    def _fused_step(self, h: torch.Tensor, meta: AttentionMetadata, backend: AttentionBackend, kv_caches) -> bool:
        """Whether this step runs through the fused layer: a few tokens on the CPU, every sequence in the paged
        kernel, no padding rows, contiguous caches in h's dtype."""
        if not isinstance(backend, CpuPagedAttention) or h.dtype != self.norm.weight.dtype or not fused_ops(h):
            return False
        if self._fused is None:
            self._build_fused()
        if not self._fused or h.shape[0] > self._fused_max_tokens:
            return False
        k_cache = kv_caches[0][0]
        if k_cache.dtype != h.dtype or not k_cache.is_contiguous():
            return False
        plan = backend.plan(meta, k_cache.shape[2], h.dtype)
        return plan.keep is None and plan.num_kernel_seqs == meta.num_seqs

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits for the rows that sample (norm and LM head only where needed)."""
        return self.lm_head(self.norm(hidden)).float()

    def pack_weights(self, keep_plain: bool = False) -> None:
        """Prepack every projection for oneDNN where that is faster (engine.config.cpu_prepacks says where).
        keep_plain: keep the row-major weights too, for our GEMV at a few rows (twice the bytes); the tied
        LM head keeps its plain weight anyway, since it is the embedding's."""
        for m in self.modules():
            if isinstance(m, Linear):
                m.pack(keep_weight=keep_plain or (m is self.lm_head and self.config.tie_word_embeddings))
        self.reset_fused()

    # ---- weights ---------------------------------------------------------------------------------
    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy tensors named as in Hugging Face checkpoints into the (fused) parameters."""
        self.reset_fused()
        params = dict(self.named_parameters())
        q, kv = self.layers[0].self_attn.q_size, self.layers[0].self_attn.kv_size
        inter = self.config.intermediate_size
        fused = {  # HF suffix -> (our suffix, start, length)
            "q_proj": ("qkv_proj", 0, q), "k_proj": ("qkv_proj", q, kv), "v_proj": ("qkv_proj", q + kv, kv),
            "gate_proj": ("gate_up_proj", 0, inter), "up_proj": ("gate_up_proj", inter, inter),
        }
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            parts = name.split(".")
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # tied checkpoints sometimes store a copy
            if len(parts) >= 2 and parts[-2] in fused:
                ours, start, length = fused[parts[-2]]
                target = ".".join(parts[:-2] + [ours, parts[-1]])
                param = params[target]
                if tensor.shape[0] != length:
                    raise ValueError(f"{name}: expected {length} rows, got {tuple(tensor.shape)}")
                param[start:start + length].copy_(tensor)
                loaded.add(f"{target}[{start}]")
            elif name in params:
                if params[name].shape != tensor.shape:
                    raise ValueError(f"{name}: expected {tuple(params[name].shape)}, got {tuple(tensor.shape)}")
                params[name].copy_(tensor)
                loaded.add(name)
            elif "rotary_emb" in name:
                continue
            else:
                raise ValueError(f"unexpected weight {name!r} for architecture {self.config.architecture}")
        pieces = {n: 3 if ".qkv_proj." in n else 2 if ".gate_up_proj." in n else 1 for n in params}
        missing = [n for n, k in pieces.items()
                   if sum(1 for x in loaded if x == n or x.startswith(n + "[")) != k]
        if missing:
            raise ValueError(f"checkpoint is missing weights for {missing[:8]} ({len(missing)} parameters)")

    @torch.no_grad()
    def init_random(self, seed: int = 0, std: float = 0.02) -> None:
        self.reset_fused()
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
