"""Attention backends over the paged KV cache."""

from __future__ import annotations

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.attention.torch_paged import TorchPagedAttention

__all__ = ["AttentionBackend", "AttentionMetadata", "TorchPagedAttention", "get_backend"]


def get_backend(name: str, device: torch.device) -> AttentionBackend:
    """`auto` picks the Triton kernels on CUDA when Triton is importable, else the PyTorch reference."""
    if name == "auto":
        name = "triton" if device.type == "cuda" and _triton_available() else "torch"
    if name == "torch":
        return TorchPagedAttention()
    if name == "triton":
        from engine.attention.triton_paged import TritonPagedAttention

        return TritonPagedAttention()
    raise ValueError(f"attention_backend must be auto, torch or triton; got {name!r}")


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
