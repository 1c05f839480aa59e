"""The compiled step: torch.compile (inductor) of every decoder layer minus its attention, on the CPU.

Why: at batch 1 a bf16 SmolLM2 decode step spends ~6.5 of its ~24 ms in ~1,500 small ops between the
projections (RMSNorm and its fp32 casts, RoPE's chunk/cat/mul, silu * mul, residual adds); inductor fuses
them into a few C++ loops. The attention (KV store + paged kernel, planned per step in Python from host
lists) stays eager, between two compiled halves of each layer:

    pre  = DecoderLayer.pre_attention:  input norm, q|k|v projection, q/k norms, RoPE -> q, k, v
    post = DecoderLayer.post_attention: o projection, residual, norm, gate|up, silu * up, down, residual

Each half is one compiled function of (layer, tensors): dynamo lifts the layer's parameters to graph
inputs, so one graph serves every layer (and every engine of the process with the same shapes). The token
count is dynamic: one graph for T = 1 (dynamo specializes size 1) and one for every T >= 2, traced at a T
equal to no model dimension (duck sizing would otherwise tie T to, say, head_dim = 64 and specialize it).
Projections stay calls of their eager kernels: prepacked oneDNN bf16 weights go through the opaque
`packed_linear` op below, since inductor lowers mkldnn._linear_pointwise only for frozen (constant) weights.

Measured (benchmarks/compiled_step.py, 2-core Zen 4, torch 2.13) it does not win yet: each compiled call
costs ~20 us in dynamo's guards plus ~20 us in the AOT/inductor wrappers, 60 calls a step, about what the
fused small ops save at batch 1; so it is off by default (`--compile` turns it on).

Inductor's FX-graph and AOT caches live under the project's cache dir, so a restart skips codegen and the
C++ compiles. Any failure (no compiler, an inductor error, a mismatch with eager at warm-up) logs a warning
and the engine runs eagerly; `ModelRunner` also drops to eager if a compiled step ever raises.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import time
from pathlib import Path

import torch

from engine.cpu_kernels import cache_dir

logger = logging.getLogger(__name__)

# Compiled vs eager at warm-up, one layer on random activations: |diff| <= TOL * (1 + |eager|)
WARMUP_TOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 5e-2}


@torch.library.custom_op("pagedserve_step::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W^T (+ b) with W prepacked by mkldnn._reorder_linear_weight; opaque to inductor (~8 us a call)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@packed_linear.register_fake
def _(x, packed, bias):
    return x.new_empty(*x.shape[:-1], packed.shape[0])


def compile_cache_dir() -> Path:
    return cache_dir().parent / "inductor"


def use_project_cache_dir() -> None:
    """Point inductor's on-disk caches at ours, unless the user chose a directory. (Importing torch._dynamo
    already writes inductor's default into the environment; its caches read the variable on each use.)"""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(compile_cache_dir())


@functools.cache
def _compiled_halves():
    from engine.models.llama import DecoderLayer

    # fullgraph: a graph break would quietly split the half into pieces; better an error, then eager
    return (torch.compile(DecoderLayer.pre_attention, fullgraph=True),
            torch.compile(DecoderLayer.post_attention, fullgraph=True))


def trace_token_count(model) -> int:
    """A token count >= 2 equal to no dimension of the model's tensors (see the module docstring)."""
    cfg = model.config
    dims = {cfg.hidden_size, cfg.intermediate_size, 2 * cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
            cfg.head_dim, cfg.head_dim // 2, cfg.num_heads + cfg.num_kv_heads, cfg.num_heads + 2 * cfg.num_kv_heads,
            cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim}
    return next(t for t in itertools.count(3) if t not in dims)


@torch.inference_mode()
def build(model, dtype: torch.dtype) -> tuple | None:
    """Compiled (pre, post) for `LlamaModel.forward(halves=...)`, warmed up for every layer at T = 1 and T >= 2
    and checked against eager; None (with a warning) where that fails."""
    use_project_cache_dir()
    t0 = time.perf_counter()
    try:
        halves = _compiled_halves()
        for t in (1, trace_token_count(model)):
            _warm_up(model, halves, t, dtype)
    except Exception as e:  # slower, never wrong
        msg = str(e).strip().splitlines()
        logger.warning("compiled step unavailable (%s: %s); running eagerly", type(e).__name__, msg[0] if msg else "")
        return None
    logger.info("compiled step ready in %.1fs (decoder layers minus attention, T = 1 and T >= 2; cache %s)",
                time.perf_counter() - t0, os.environ["TORCHINDUCTOR_CACHE_DIR"])
    return halves


def _warm_up(model, halves, t: int, dtype: torch.dtype) -> None:
    """Run both halves over every layer (compiling once, then hitting the graph) and compare layer 0 with eager."""
    gen = torch.Generator().manual_seed(t)
    device = next(model.parameters()).device
    h = torch.randn(t, model.config.hidden_size, generator=gen).to(device, dtype)
    rope = model.rope(torch.arange(t, device=device), dtype)
    pre, post = halves
    for i, layer in enumerate(model.layers):
        q, k, v = pre(layer, *_dynamic_tokens(rope, h))
        o = q.contiguous()  # stands in for the attention output ([T, Hq, D], contiguous)
        out = post(layer, *_dynamic_tokens(o, h))
        if i == 0:
            eager = layer.pre_attention(rope, h)
            eager = (*eager, layer.post_attention(eager[0].contiguous(), h))
            tol = WARMUP_TOL.get(dtype, 5e-2)
            for got, want in zip((q, k, v, out), eager):
                err = (got.float() - want.float()).abs().max().item()
                bound = tol * (1 + want.float().abs().max().item())
                if not err <= bound:
                    raise ValueError(f"compiled layer differs from eager by {err:.3g} (> {bound:.3g}) at T={t}")


def _dynamic_tokens(*args):
    """Mark the token dim of every tensor dynamic (T >= 2): the weights' sizes stay constants in the kernels."""
    for a in args:
        for x in a if isinstance(a, tuple) else (a,):
            if x.shape[0] > 1:
                torch._dynamo.mark_dynamic(x, 0)
    return args
