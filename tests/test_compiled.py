"""The compiled step (engine/compiled.py): same logits and tokens as eager, and eager whenever compiling fails.

Compiling costs ~20-40 s on two cores, so the compiled engines are built once per module (and the graphs
are shared by every engine of the same shapes in the process).
"""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import greedy, record_comparison, run_to_completion

from engine import compiled
from engine.attention import TorchPagedAttention
from engine.config import ModelConfig, cpu_has_fast_bf16
from engine.model_runner import _HostBatch
from engine.models.llama import LlamaModel

# Logits of the compiled forward vs eager, same batch: fp32 differs only by reordered sums, whose size depends
# on the vector width inductor and oneDNN sum in (on SmolLM2's ~±20 logits: 3e-4 with AVX-512 on Zen 4, 1.1e-3
# with AVX2 on Zen 3); bf16 by rounding at different points, a few bf16 ulps of the logit scale.
FP32_ATOL = 2e-3
BF16_ATOL = 0.25

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


@pytest.fixture(scope="module")
def compiled_engine(make_engine):
    eng = make_engine(compile=True)
    assert eng.runner.halves is not None, "the compiled step did not build"
    return eng


def mixed_batch_logits(runner, halves) -> torch.Tensor:
    """fp32 logits of every token of one mixed step: two decodes (contexts 20, 37) then a 7-token prefill.

    The KV cache is restored afterwards, so each call sees the same cache contents."""
    gen = torch.Generator().manual_seed(0)
    saved = runner.kv_cache.clone()
    runner.kv_cache.copy_(torch.randn(runner.kv_cache.shape, generator=gen).to(runner.kv_cache.dtype) * 0.5)
    tables = [[0, 1], [2, 3, 4], [5]]
    positions = [19, 36] + list(range(7))
    meta = runner._metadata(positions, [1, 1, 7], [20, 37, 7], tables)
    ids = torch.randint(0, runner.model_config.vocab_size, (len(positions),), generator=gen)
    try:
        hidden = runner.model(ids, torch.tensor(positions), runner.kv_caches, meta, runner.backend, halves=halves)
        return runner.model.compute_logits(hidden)
    finally:
        runner.kv_cache.copy_(saved)


def test_compiled_logits_match_eager_fp32(compiled_engine):
    runner = compiled_engine.runner
    eager = mixed_batch_logits(runner, None)
    comp = mixed_batch_logits(runner, runner.halves)
    err = (comp - eager).abs().max().item()
    assert err <= FP32_ATOL, f"compiled vs eager logits differ by {err:.2e} (> {FP32_ATOL})"


def test_compiled_greedy_tokens_match_eager(compiled_engine, make_engine):
    eager = make_engine(compile=False)
    assert eager.runner.halves is None
    results = {}
    for name, eng in (("eager", eager), ("compiled", compiled_engine)):
        for i, p in enumerate(PROMPTS):
            eng.add_request(f"{name}-{i}", p, greedy(16))
        results[name] = run_to_completion(eng)
    for i in range(len(PROMPTS)):
        ours, ref = results["compiled"][f"compiled-{i}"], results["eager"][f"eager-{i}"]
        record_comparison(f"compiled prompt {i}", ours["tokens"], ref["tokens"], ours["logprobs"])


def test_compiled_bf16_tiny_model_matches_eager():
    """bf16, with oneDNN-prepacked weights where the CPU has native bf16 (the opaque packed_linear op)."""
    cfg = ModelConfig(architecture="qwen2", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=128, attention_bias=True)
    model = LlamaModel(cfg)
    model.init_random(seed=1, std=0.1)
    model = model.to(torch.bfloat16).eval().requires_grad_(False)
    model.rope.build()  # the cos/sin table stays fp32, as the loader keeps it
    if cpu_has_fast_bf16():
        model.pack_weights()
    halves = compiled.build(model, torch.bfloat16)
    assert halves is not None
    cache = torch.randn(cfg.num_layers, 2, 8, 16, cfg.num_kv_heads, cfg.head_dim).to(torch.bfloat16)
    kv = [(cache[i, 0], cache[i, 1]) for i in range(cfg.num_layers)]
    positions, q_lens, seq_lens, tables = [19, 5] + list(range(9)), [1, 1, 9], [20, 6, 9], [[0, 1], [2], [3]]
    meta = _HostBatch.build([0] * 11, positions, q_lens, seq_lens, tables, 16).metadata(torch.device("cpu"), q_lens,
                                                                                        seq_lens)
    ids = torch.randint(0, cfg.vocab_size, (11,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        snapshot = cache.clone()
        eager = model.compute_logits(model(ids, torch.tensor(positions), kv, meta, TorchPagedAttention()))
        cache.copy_(snapshot)
        comp = model.compute_logits(model(ids, torch.tensor(positions), kv, meta, TorchPagedAttention(), halves=halves))
    err = (comp - eager).abs().max().item()
    assert err <= BF16_ATOL, f"bf16 compiled vs eager logits differ by {err:.3f} (> {BF16_ATOL})"


def test_compile_failure_falls_back_to_eager(make_engine, monkeypatch, caplog):
    def broken():
        raise RuntimeError("no C++ compiler here")

    monkeypatch.setattr(compiled, "_compiled_halves", broken)
    with caplog.at_level(logging.WARNING, logger="engine.compiled"):
        eng = make_engine(compile=True)
    assert eng.runner.halves is None
    assert "compiled step unavailable (RuntimeError: no C++ compiler here); running eagerly" in caplog.text
    ref = make_engine(compile=False)
    for e in (eng, ref):
        e.add_request("a", PROMPTS[0], greedy(8))
    assert run_to_completion(eng)["a"]["tokens"] == run_to_completion(ref)["a"]["tokens"]


def test_a_failing_compiled_step_reruns_eagerly(make_engine, caplog):
    def broken(*args):
        raise RuntimeError("inductor fell over")

    eng, ref = make_engine(), make_engine()
    eng.runner.halves = (broken, broken)  # as if compiled; no compile needed for this test
    for e in (eng, ref):
        e.add_request("a", PROMPTS[1], greedy(8))
    with caplog.at_level(logging.ERROR, logger="engine.model_runner"):
        out = run_to_completion(eng)["a"]["tokens"]
    assert out == run_to_completion(ref)["a"]["tokens"]
    assert eng.runner.halves is None
    assert "compiled step failed; running eagerly from now on" in caplog.text
