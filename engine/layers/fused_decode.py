"""A decode step on the CPU with each decoder layer in one C++ call (engine/csrc/decode_layer.cpp).

The same kernels as the per-op path, in the same order, so the result is bit-identical wherever the per-op path
would also run our GEMV; called from C++ they cost what they compute, where each op called from Python pays the
interpreter, the dispatcher and a fresh output tensor. It serves decode steps of up to the dispatch table's
`fused_decode_max_rows` rows (dense projections; quantized ones up to `quant_gemv_max_rows`), when the attention
backend can hand every sequence to its paged kernel (`fused_decode_args`): no padding rows, no long chunks.
"""

from __future__ import annotations

import torch
from torch import nn


class FusedDecoder:
    """Built over a loaded model (its tensors, not copies); `None` from `build` where a layer has no fused form."""

    def __init__(self, model: nn.Module, layers: list[tuple], max_rows: int) -> None:
        self.model = model
        self.layers = layers
        self.max_rows = max_rows
        attn = model.layers[0].self_attn
        self.num_heads, self.scale = attn.num_heads, attn.scale

    @classmethod
    def build(cls, model: nn.Module) -> FusedDecoder | None:
        cfg = model.config
        if cfg.qk_norm or not model.norm.cpp:  # Qwen3's per-head q/k norms are not in the fused layer
            return None
        layers, limit = [], 1 << 30
        for layer in model.layers:
            ops = [m.fused_operands for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                layer.mlp.gate_up_proj, layer.mlp.down_proj)]
            if any(op is None for op in ops):
                return None
            layers.append((layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                           layer.input_layernorm.eps, *(op[0] for op in ops)))
            limit = min([limit] + [op[1] for op in ops])
        return cls(model, layers, limit)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta,
                 backend) -> torch.Tensor | None:
        """Hidden states [T, hidden] (before the final norm), or None: this step is the per-op path's."""
        if input_ids.shape[0] > self.max_rows:
            return None
        k_cache = kv_caches[0][0]
        attention = backend.fused_decode_args(meta, k_cache) if hasattr(backend, "fused_decode_args") else None
        if attention is None:
            return None
        model = self.model
        if k_cache.dtype != model.norm.weight.dtype:
            return None
        h = model.embed_tokens(input_ids)
        cos, sin = model.rope(positions, h.dtype)
        slots, *kernel_args, query_tile, splits = attention
        op = torch.ops.pagedserve.decode_layer
        for (k, v), layer in zip(kv_caches, self.layers):
            op(h, *layer, cos, sin, k, v, slots, *kernel_args, self.num_heads, self.scale, query_tile, splits)
        return h
