"""GGUF quant types at their own bits: every block type's storage equals gguf's own dequantization (tensors
written by gguf's writer and read back by its reader), our kernels compute with those values, fused projections
of mixed types stay exact, and whole models written as Q4_K_M / Q5_K_M / Q6_K / Q8_0 load with the file's types
and decode greedily as transformers does on the same file."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import quant_reference, quant_tolerance, record_comparison, run_to_completion

from pagedserve.benchmarks.gguf_quants import SHAPES, llama_cpp_type, random_blocks, write_gguf
from pagedserve.engine import LLMEngine, SamplingParams, cpu_kernels, make_config
from pagedserve.engine.layers.dispatch import KernelTable
from pagedserve.engine.layers.linear import Linear
from pagedserve.engine.quant.formats import cat
from pagedserve.engine.quant.gguf_blocks import BLOCK_WEIGHTS, MAPPED, GGUFBlocks

gguf = pytest.importorskip("gguf")


def _written(tmp_path, kinds, rows: int = 48, cols: int = 512, seed: int = 0) -> list[GGUFBlocks]:
    """One tensor per kind, through gguf's writer and reader."""
    rng = np.random.default_rng(seed)
    path = str(tmp_path / "t.gguf")
    w = gguf.GGUFWriter(path, "llama")
    for i, kind in enumerate(kinds):
        w.add_tensor(f"t{i}", random_blocks(kind, rows, cols, rng), raw_dtype=gguf.GGMLQuantizationType[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out = []
    for t in gguf.GGUFReader(path).tensors:
        assert t.tensor_type.name in kinds
        out.append(GGUFBlocks(t.tensor_type.name, np.asarray(t.data), (int(t.shape[1]), int(t.shape[0]))))
    return out


@pytest.mark.parametrize("kind", MAPPED)
def test_storage_equals_gguf_dequantize(tmp_path, kind):
    (blocks,) = _written(tmp_path, [kind])
    ref = torch.from_numpy(np.asarray(gguf.quants.dequantize(blocks.data, gguf.GGMLQuantizationType[kind]),
                                      dtype=np.float32).reshape(blocks.shape))
    qw = blocks.storage()
    assert qw.format == kind and torch.equal(qw.dequantize(), ref)
    file_bits = 8 * blocks.data.nbytes / ref.numel()
    assert qw.bits_per_weight >= file_bits  # never fewer bits than the file: nothing was rounded away
    # laid out for our kernels (panels) and back: the same values, and row lookups (an embedding) agree
    qw.lay_out(torch.device("cpu"), "panels")
    assert qw.layout == "panels" and torch.equal(qw.dequantize(), ref)
    ids = torch.tensor([0, 17, 47])
    assert torch.equal(qw.rows(ids, torch.float32), ref[ids])


def _linear(qw, dtype) -> Linear:
    assert cpu_kernels.load()  # a failed build fails, never skips
    lin = Linear(qw.shape[1], qw.shape[0])
    lin.quantize_to(qw)
    lin.select_kernels(KernelTable(cpp=True), torch.device("cpu"), dtype)
    return lin


MIXES = [(k,) for k in MAPPED] + [("Q4_K", "Q4_K", "Q6_K"), ("Q5_K", "Q6_K"), ("Q4_0", "Q6_K"), ("Q4_K", "Q8_0"),
                                  ("Q5_0", "Q5_1")]


@pytest.mark.parametrize("kinds", MIXES, ids=["+".join(m) for m in MIXES])
def test_kernels_compute_with_the_files_values(tmp_path, kinds):
    """The GEMV (on int8 codes of the activations) and the tiled GEMM (the dequantized tile) against the dense
    product of what each multiplies, for each type alone and for fused projections mixing types (held exactly as
    int8)."""
    parts = _written(tmp_path, list(kinds), rows=48, cols=1024)
    ref = torch.cat([b.dequantize() for b in parts])
    qw = cat([b.storage() for b in parts])
    assert torch.equal(qw.dequantize(), ref)
    if len(set(kinds)) > 1:
        assert type(qw).__name__ == "Int8Weight" and qw.format == "+".join(dict.fromkeys(kinds))
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        lin = _linear(qw, dtype)
        assert qw.layout == "panels"
        for m in (1, 3, 8, KernelTable(cpp=True).quant_gemv_max_rows + 1):
            x = torch.randn(m, ref.shape[1]).to(dtype)
            want = quant_reference(lin, x, ref)
            rel = ((lin(x).float() - want).norm() / want.norm()).item()
            assert rel < quant_tolerance(lin, x, 2e-2 if dtype == torch.bfloat16 else 1e-5), (dtype, m, rel)


@pytest.mark.parametrize("kinds", [("Q4_K",), ("Q6_K",), ("Q8_0",), ("Q4_K", "Q4_K", "Q6_K")],
                         ids=["Q4_K", "Q6_K", "Q8_0", "Q4_K+Q6_K"])
def test_int8_gemm_computes_with_the_files_values(tmp_path, kinds):
    """The many-row GEMM on int8 codes of both sides (VNNI registers here; the AMX tiles take the same codes)
    against the dense product of the file's values: K-quants' coded sub-block scales and 6-bit codes included."""
    if not cpu_kernels.vnni_int8():
        pytest.skip("this CPU or build has no AVX512-VNNI")
    parts = _written(tmp_path, list(kinds), rows=48, cols=1024)
    ref = torch.cat([b.dequantize() for b in parts])
    lin = Linear(ref.shape[1], ref.shape[0])
    lin.quantize_to(cat([b.storage() for b in parts]))
    lin.select_kernels(KernelTable(cpp=True, quant_gemm_vnni=True, quant_gemm_int8_min_weights=0),
                       torch.device("cpu"), torch.float32)
    assert "VNNI int8 GEMM" in lin.describe_routes()
    torch.manual_seed(0)
    x = torch.randn(70, ref.shape[1])
    want = x @ ref.t()
    assert ((lin(x) - want).norm() / want.norm()).item() < 3e-2


def test_llama_cpp_type_mix():
    """Q4_K_M as llama.cpp lays it out: the LM head and about half the layers' attn_v / ffn_down in Q6_K."""
    n = 22
    more = [i for i in range(n) if llama_cpp_type(f"blk.{i}.ffn_down.weight", "Q4_K_M", i, n) == "Q6_K"]
    assert more == [0, 1, 4, 7, 10, 13, 16, 19, 20, 21]
    assert llama_cpp_type("output.weight", "Q4_K_M", 0, n) == "Q6_K"
    assert llama_cpp_type("blk.3.attn_q.weight", "Q4_K_M", 3, n) == "Q4_K"
    assert llama_cpp_type("blk.3.attn_q.weight", "Q8_0", 3, n) == "Q8_0"


FILE_TYPES = ["Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("kquants")
    (d / "no-tokenizer").mkdir()
    out = {}
    for ftype in FILE_TYPES:
        path = str(d / f"tiny-{ftype}.gguf")
        out[ftype] = (path, write_gguf(path, SHAPES["tiny"], ftype, seed=FILE_TYPES.index(ftype)))
    return d, out


@pytest.mark.parametrize("ftype", FILE_TYPES)
def test_model_files_load_at_their_bits_and_match_transformers(files, ftype):
    from transformers import AutoModelForCausalLM

    d, out = files
    path, mix = out[ftype]
    # the tiled GEMM (dequantized tiles) at every row count: the file's values exactly, so only summation order
    # differs from transformers; the GEMV's int8 activations (~0.5 %) would flip this random model's near-flat
    # logits, and are held to the dense product above instead
    engine = LLMEngine(make_config(model=path, tokenizer=str(d / "no-tokenizer"), dtype="float32", device="cpu",
                                   num_blocks=64, block_size=16, kernel_policy="quant_gemv_max_rows=0"))
    model = engine.runner.model
    formats = {m.qweight.format for m in model.modules() if getattr(m, "qweight", None) is not None}
    assert set(mix) <= {f for fmt in formats for f in fmt.split("+")}, (formats, mix)
    assert all(not fmt.startswith("int") for fmt in formats)  # nothing requantized
    hf = AutoModelForCausalLM.from_pretrained(str(d), gguf_file=path.rsplit("/", 1)[1], dtype=torch.float32)
    # the same weights as transformers' own GGUF loading (q/k rows un-permuted alike)
    sd = hf.state_dict()
    layer = model.layers[0]
    q = layer.self_attn.qkv_proj.qweight.dequantize()[:SHAPES["tiny"]["hidden"]]
    assert torch.equal(q, sd["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(layer.mlp.down_proj.qweight.dequantize(), sd["model.layers.0.mlp.down_proj.weight"])
    assert torch.equal(model.lm_head.qweight.dequantize(), sd["lm_head.weight"])
    ids = [(7 * i + 3) % 500 for i in range(40)]
    engine.add_request("g", ids, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=5))
    got = run_to_completion(engine)["g"]
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, 40:].tolist()
    record_comparison(f"{ftype} tiny model", got["tokens"], want, got["logprobs"])


def test_named_format_requantizes(files):
    d, out = files
    path, _ = out["Q4_K_M"]
    engine = LLMEngine(make_config(model=path, tokenizer=str(d / "no-tokenizer"), dtype="float32", device="cpu",
                                   num_blocks=64, block_size=16, quantization="int8"))
    formats = {m.qweight.format for m in engine.runner.model.modules() if getattr(m, "qweight", None) is not None}
    assert formats == {"int8"}
    dense = LLMEngine(make_config(model=path, tokenizer=str(d / "no-tokenizer"), dtype="float32", device="cpu",
                                  num_blocks=64, block_size=16, quantization="none"))
    assert not any(getattr(m, "qweight", None) is not None for m in dense.runner.model.modules())


def test_bundled_model_serves_its_own_bits(smollm):
    """The default (auto) on the bundled SmolLM2: its Q4_1 projections and Q8_0 embedding as the file holds them,
    the tied LM head sharing the embedding's storage."""
    engine = LLMEngine(make_config(model=smollm.path, dtype="float32", device="cpu", num_blocks=32))
    model = engine.runner.model
    assert model.layers[0].self_attn.qkv_proj.qweight.format == "Q4_1"
    assert model.embed_tokens.qweight.format == "Q8_0" and model.lm_head.qweight is model.embed_tokens.qweight


def test_block_sizes_match_gguf():
    for kind in MAPPED:
        assert BLOCK_WEIGHTS[kind] == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][0]
