"""The fused decode layer (engine/csrc/decode_layer.cpp, engine/layers/fused_decode.py) against the per-op path it
replaces: the same kernels in the same order, so hidden states and the KV cache must be bit-identical, for dense,
int8 and int4 projections (dense ones past `dense_gemv_max_rows` only close: the per-op path hands those to
oneDNN); and the steps it leaves to the per-op path (prefill chunks, padding rows, more rows than it takes)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.engine.attention.cpu_paged import CpuPagedAttention
from pagedserve.engine.config import ModelConfig
from pagedserve.engine.layers.dispatch import kernel_table
from pagedserve.engine.layers.fused_decode import FusedDecoder
from pagedserve.engine.layers.linear import select_kernels
from pagedserve.engine.model_runner import HostBatch
from pagedserve.engine.models.llama import LlamaModel
from pagedserve.engine.quant.loading import QuantSpec, quantize_model

BLOCK = 16
CPU = torch.device("cpu")


def _model(dtype: torch.dtype, fmt: str, bias: bool, keep_plain: bool = True) -> LlamaModel:
    cfg = ModelConfig(architecture="qwen2" if bias else "llama", vocab_size=256, hidden_size=128,
                      intermediate_size=320, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                      max_position_embeddings=256, attention_bias=bias)
    model = LlamaModel(cfg)
    model.init_random(seed=1, std=0.1)
    model = model.to(dtype).eval().requires_grad_(False)
    model.rope.build()
    if fmt != "none":
        quantize_model(model, QuantSpec(fmt, 32))
    # bf16 dense: prepacked for oneDNN, the row-major copies kept (as the loader does where they fit) or not
    table = kernel_table(CPU, dtype, None if keep_plain else "plain_copy_max_fraction=0")
    select_kernels(model, table, CPU, dtype)
    return model


def _run(model, dtype, positions, q_lens, seq_lens, tables, slots_override=None, fused=True):
    """(hidden states, KV cache, whether the fused layer ran) for one step."""
    cfg = model.config
    gen = torch.Generator().manual_seed(7)
    cache = torch.randn(cfg.num_layers, 2, 8, BLOCK, cfg.num_kv_heads, cfg.head_dim, generator=gen).to(dtype)
    kv = [(cache[i, 0], cache[i, 1]) for i in range(cfg.num_layers)]
    host = HostBatch.build([0] * len(positions), positions, q_lens, seq_lens, tables, BLOCK)
    meta = host.metadata(CPU, q_lens, seq_lens)
    if slots_override is not None:
        meta.slot_mapping = slots_override
    backend = CpuPagedAttention(kernel_table(CPU, dtype))
    meta = backend.build_metadata(meta, cfg.num_kv_heads, dtype)
    ids = torch.randint(0, cfg.vocab_size, (len(positions),), generator=gen)
    with torch.inference_mode():
        decoder = FusedDecoder.build(model) if fused else None
        h = decoder(ids, torch.tensor(positions), kv, meta, backend) if decoder is not None else None
        ran = h is not None
        if h is None:
            h = model(ids, torch.tensor(positions), kv, meta, backend)
    return h, cache, ran


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["none", "int8", "int4"])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_layer_is_bit_identical(dtype, fmt, bias):
    model = _model(dtype, fmt, bias)
    gemv_rows = kernel_table(CPU, dtype).dense_gemv_max_rows
    for positions, q_lens, seq_lens, tables in (
        ([19], [1], [20], [[3, 5]]),  # one decode whose context crosses a block boundary
        ([19, 5], [1, 1], [20, 6], [[0, 1], [2]]),  # two decodes
        ([19, 5, 7, 15, 2, 9], [1] * 6, [20, 6, 8, 16, 3, 10], [[0, 1], [2], [3], [4], [5], [6]]),  # six
    ):
        h, cache, ran = _run(model, dtype, positions, q_lens, seq_lens, tables)
        ref_h, ref_cache, ref_ran = _run(model, dtype, positions, q_lens, seq_lens, tables, fused=False)
        assert ran and not ref_ran
        if fmt != "none" or len(positions) <= gemv_rows:  # the per-op path runs our GEMV too
            assert torch.equal(h, ref_h), (h - ref_h).abs().max()
            assert torch.equal(cache, ref_cache)
        else:  # there it runs oneDNN's GEMM: other roundings (bf16: an output ulp, 2^-8, now and then)
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            # the step's own slots, held to the bound on their own: over the whole cache their error would be
            # diluted by the slots this step did not write, which must not change at all
            blocks, offsets = zip(*((t[p // BLOCK], p % BLOCK) for p, t in zip(positions, tables)))
            written = (slice(None), slice(None), list(blocks), list(offsets))
            for got, want in ((h, ref_h), (cache[written], ref_cache[written])):
                rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
                assert rel < tol, rel
            cache[written], ref_cache[written] = 0, 0
            assert torch.equal(cache, ref_cache)


def test_fused_layer_leaves_other_steps_to_the_per_op_path():
    table = kernel_table(CPU, torch.float32)
    dense, quant = _model(torch.float32, "none", False), _model(torch.float32, "int8", False)
    many = table.fused_decode_max_rows + 1
    decodes = ([3] * many, [1] * many, [4] * many, [[i % 8] for i in range(many)])
    assert not _run(dense, torch.float32, *decodes)[2]  # dense: up to fused_decode_max_rows
    assert _run(quant, torch.float32, *decodes)[2]  # int8: up to quant_gemv_max_rows
    n = table.quant_gemv_max_rows + 1
    prefill = (list(range(n)), [n], [n], [list(range(-(-n // BLOCK)))])
    assert not _run(quant, torch.float32, *prefill)[2]
    padded = ([19, 5], [1, 1], [20, 6], [[0, 1], [2]])
    slots = torch.tensor([BLOCK + 3, -1])  # a padding row (slot -1) is the per-op path's to skip
    assert not _run(quant, torch.float32, *padded, slots_override=slots)[2]
    # projections without a GEMV of ours (bf16 that kept only the prepacked weights) have no fused layer
    if table.prepack_bf16:
        assert FusedDecoder.build(_model(torch.bfloat16, "none", False, keep_plain=False)) is None
