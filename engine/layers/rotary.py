"""Rotary position embeddings (neox-style, rotate-half) with the RoPE scaling variants checkpoints use."""

from __future__ import annotations

import math

import torch

from ..config import ModelConfig
from .dispatch import CppLayer


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


class RotaryEmbedding(CppLayer):
    """A precomputed fp32 cos/sin table indexed by position; `forward` gives a step's rows, which every layer
    shares, and `rotate` applies them."""

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
        """cos, sin [T, 1, D] for this step's positions."""
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x' = x * cos + rotate_half(x) * sin; in place with the C++ op (x is a view of the step's fresh qkv)."""
        if self.cpp and cos.dtype == x.dtype:
            torch.ops.pagedserve.rope_(x, cos, sin)
            return x
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin
