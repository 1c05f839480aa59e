"""The fused decode layer (engine/csrc/decode_layer.cpp) against the per-op path it replaces: the same kernels in
the same order, so hidden states and the KV cache must be bit-identical, for dense, int8 and int4 projections
(dense ones past DENSE_GEMV_MAX_M rows only close: the per-op path hands those to oneDNN);
and the steps it must leave to the per-op path (prefill chunks, padding rows, more rows than the GEMVs take)."""

from __future__ import annotations

import pytest
import torch

import engine.models.llama as llama
from engine import cpu_kernels
from engine.attention.cpu_paged import CpuPagedAttention
from engine.config import ModelConfig
from engine.model_runner import _HostBatch
from engine.quant.formats import INT8_PACKED_MAX_M
from engine.quant.loading import QuantSpec, quantize_model

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="the C++ CPU kernels did not build")

BLOCK = 16


def _model(dtype: torch.dtype, fmt: str, bias: bool) -> llama.LlamaModel:
    cfg = ModelConfig(architecture="qwen2" if bias else "llama", vocab_size=256, hidden_size=128,
                      intermediate_size=320, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                      max_position_embeddings=256, attention_bias=bias)
    model = llama.LlamaModel(cfg)
    model.init_random(seed=1, std=0.1)
    model = model.to(dtype).eval().requires_grad_(False)
    model.rope.build()
    if fmt != "none":
        quantize_model(model, QuantSpec(fmt, 32))
    elif dtype == torch.bfloat16:
        model.pack_weights(keep_plain=True)  # as the loader does where the row-major copies fit
    return model


def _run(model, dtype, positions, q_lens, seq_lens, tables, slots_override=None, fused=True, monkeypatch=None):
    cfg = model.config
    gen = torch.Generator().manual_seed(7)
    cache = torch.randn(cfg.num_layers, 2, 8, BLOCK, cfg.num_kv_heads, cfg.head_dim, generator=gen).to(dtype)
    kv = [(cache[i, 0], cache[i, 1]) for i in range(cfg.num_layers)]
    host = _HostBatch.build([0] * len(positions), positions, q_lens, seq_lens, tables, BLOCK)
    meta = host.metadata(torch.device("cpu"), q_lens, seq_lens)
    if slots_override is not None:
        meta.slot_mapping = slots_override
    ids = torch.randint(0, cfg.vocab_size, (len(positions),), generator=gen)
    calls = []
    real = torch.ops.pagedserve.decode_layer
    monkeypatch.setattr(llama.torch.ops.pagedserve, "decode_layer", lambda *a: calls.append(1) or real(*a),
                        raising=False)
    if not fused:
        monkeypatch.setattr(model, "_fused_step", lambda *a: False)
    with torch.inference_mode():
        h = model(ids, torch.tensor(positions), kv, meta, CpuPagedAttention())
    monkeypatch.undo()
    return h, cache, len(calls)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["none", "int8", "int4"])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_layer_is_bit_identical(dtype, fmt, bias, monkeypatch):
    model = _model(dtype, fmt, bias)
    for positions, q_lens, seq_lens, tables in (
        ([19], [1], [20], [[3, 5]]),  # one decode whose context crosses a block boundary
        ([19, 5], [1, 1], [20, 6], [[0, 1], [2]]),  # two decodes
        ([19, 5, 7, 15, 2, 9], [1] * 6, [20, 6, 8, 16, 3, 10], [[0, 1], [2], [3], [4], [5], [6]]),  # six
    ):
        h, cache, n = _run(model, dtype, positions, q_lens, seq_lens, tables, monkeypatch=monkeypatch)
        ref_h, ref_cache, n_ref = _run(model, dtype, positions, q_lens, seq_lens, tables, fused=False,
                                       monkeypatch=monkeypatch)
        assert n == model.config.num_layers and n_ref == 0
        if fmt != "none" or len(positions) <= llama.DENSE_GEMV_MAX_M:  # the per-op path runs our GEMV too
            assert torch.equal(h, ref_h), (h - ref_h).abs().max()
            assert torch.equal(cache, ref_cache)
        else:  # there it runs oneDNN's GEMM: other roundings (bf16: an output ulp, 2^-8, now and then)
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            for got, want in ((h, ref_h), (cache, ref_cache)):
                rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
                assert rel < tol, rel


def test_fused_layer_leaves_other_steps_to_the_per_op_path(monkeypatch):
    dense, quant = _model(torch.float32, "none", False), _model(torch.float32, "int8", False)
    many = llama.FUSED_DENSE_MAX_M + 1
    decodes = ([3] * many, [1] * many, [4] * many, [[i % 8] for i in range(many)])
    assert _run(dense, torch.float32, *decodes, monkeypatch=monkeypatch)[2] == 0  # dense: <= FUSED_DENSE_MAX_M
    assert _run(quant, torch.float32, *decodes, monkeypatch=monkeypatch)[2] == 2  # int8: <= INT8_PACKED_MAX_M
    n = INT8_PACKED_MAX_M + 1
    prefill = (list(range(n)), [n], [n], [list(range(-(-n // BLOCK)))])
    assert _run(quant, torch.float32, *prefill, monkeypatch=monkeypatch)[2] == 0
    padded = ([19, 5], [1, 1], [20, 6], [[0, 1], [2]])
    slots = torch.tensor([BLOCK + 3, -1])  # a padding row (slot -1) is the per-op path's to skip
    assert _run(quant, torch.float32, *padded, slots_override=slots, monkeypatch=monkeypatch)[2] == 0
    # projections without a GEMV of ours (bf16 that kept only the prepacked weights) keep the per-op path
    packed = _model(torch.bfloat16, "none", False)
    packed.pack_weights(keep_plain=False)
    assert _run(packed, torch.bfloat16, [19], [1], [20], [[3, 5]], monkeypatch=monkeypatch)[2] == 0
