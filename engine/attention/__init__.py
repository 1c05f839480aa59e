"""Attention backends over the paged KV cache."""

from __future__ import annotations

import torch

from ..layers.dispatch import KernelTable, kernel_table
from .base import AttentionBackend, AttentionMetadata
from .torch_paged import TorchPagedAttention

__all__ = ["AttentionBackend", "AttentionMetadata", "TorchPagedAttention", "get_backend"]


def get_backend(name: str, device: torch.device, table: KernelTable | None = None,
                block_size: int = 16) -> AttentionBackend:
    """`auto` picks the Triton kernels on CUDA when Triton is importable, the C++ kernel on a CPU where the
    dispatch table says our kernels are built (else the PyTorch reference)."""
    table = table or kernel_table(device)
    if name == "auto":
        if device.type == "cuda":
            name = "triton" if _triton_available() else "torch"
        else:
            name = "cpu" if table.cpp else "torch"
    if name == "cpu":  # EngineConfig refuses a backend for another device than the engine's
        from .cpu_paged import CpuPagedAttention

        return CpuPagedAttention(table)
    if name == "torch":
        return TorchPagedAttention(block_size)
    if name == "triton":
        from .triton_paged import TritonPagedAttention

        return TritonPagedAttention()
    raise ValueError(f"attention_backend must be auto, cpu, torch or triton; got {name!r}")


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
