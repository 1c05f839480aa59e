"""Each supported architecture and RoPE variant vs transformers, on tiny random HF checkpoints (fp32)."""

import math

import numpy as np
import pytest
import torch
from conftest import run_to_completion

from pagedserve.engine import LLMEngine, SamplingParams, make_config
from pagedserve.engine.models.loader import load_config

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)


def _hf_checkpoint(tmp_path, kind: str, **extra):
    import transformers

    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[kind]
    torch.manual_seed(0)
    cfg = cls[0](**{**TINY, **extra})
    model = cls[1](cfg).eval()
    with torch.no_grad():  # random norms too, so a wrong norm placement would show
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(tmp_path, safe_serialization=True)
    return model


CASES = {
    "llama": ("llama", {}),
    "llama-untied-mha": ("llama", dict(tie_word_embeddings=False, num_key_value_heads=4)),
    "llama3-rope": ("llama", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                                  rope_theta=50000.0)),
    "linear-rope": ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "qwen2-bias-mqa": ("qwen2", dict(num_key_value_heads=1, tie_word_embeddings=True)),
    "qwen3-qknorm": ("qwen3", dict(head_dim=32)),
    "yarn-rope": ("qwen2", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                              "original_max_position_embeddings": 128})),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_greedy_match_transformers(tmp_path, case):
    kind, extra = CASES[case]
    hf = _hf_checkpoint(tmp_path, kind, **extra)
    cfg = load_config(str(tmp_path))
    assert cfg.architecture == kind
    engine = LLMEngine(make_config(model=str(tmp_path), dtype="float32", device="cpu",
                                   num_blocks=64, block_size=16))
    ids = [(7 * i + 3) % 256 for i in range(150)]  # long enough for the scaled RoPE ranges to matter
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    runner = engine.runner
    from pagedserve.engine.sequence import Sequence

    seq = Sequence(0, "x", ids, SamplingParams(max_tokens=1), 1)
    engine.block_manager.allocate(seq, len(ids))
    meta = runner._metadata(list(range(len(ids))), [len(ids)], [len(ids)], [seq.block_table])
    with torch.inference_mode():
        ours = runner.model.compute_logits(
            runner.model(torch.tensor(ids), torch.arange(len(ids)), runner.kv_caches, meta, runner.backend))
    engine.block_manager.free(seq)
    assert (ours - ref).abs().max().item() < 1e-4

    # decode through the paged cache == HF's own cached generate
    engine.add_request("g", ids[:40], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    got = run_to_completion(engine)["g"]["tokens"]
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids[:40]]), max_new_tokens=20, min_new_tokens=20, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, 40:].tolist()
    assert got == want


# ---- GGUF: tiny files written here with gguf's own writer, as llama.cpp's converter lays them out ----------
_TO_GGUF = [("model.embed_tokens.weight", "token_embd.weight"), ("model.norm.weight", "output_norm.weight"),
            ("lm_head.weight", "output.weight")]
_LAYER_TO_GGUF = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
                  "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
                  "self_attn.v_proj.weight": "attn_v.weight", "self_attn.q_proj.bias": "attn_q.bias",
                  "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
                  "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_norm.weight": "attn_q_norm.weight",
                  "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
                  "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}


def _llama3_rope_freqs(cfg) -> np.ndarray:
    """llama.cpp's converter: llama3 scaling as one divisor per rotary frequency."""
    s, dim = cfg.rope_scaling, cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    old, low, high, factor = (s["original_max_position_embeddings"], s["low_freq_factor"], s["high_freq_factor"],
                              s["factor"])
    out = []
    for f in inv:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _write_gguf(path: str, hf, cfg, arch: str) -> None:
    """`cfg`: our ModelConfig of the HF checkpoint (it reads every transformers version's config)."""
    import gguf

    w = gguf.GGUFWriter(path, arch)
    heads, kv, head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_vocab_size(cfg.vocab_size)
    if (cfg.rope_scaling or {}).get("rope_type") == "llama3":
        assert cfg.rope_theta == 50000.0
        w.add_tensor("rope_freqs.weight", _llama3_rope_freqs(cfg))
    for name, p in hf.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = p.detach().float().numpy()
        gname = dict(_TO_GGUF).get(name)
        if gname is None:
            _, _, i, rest = name.split(".", 3)
            gname = f"blk.{i}.{_LAYER_TO_GGUF[rest]}"
        if arch == "llama" and (".attn_q." in gname or ".attn_k." in gname):  # llama.cpp's interleaved RoPE rows
            n = heads if ".attn_q." in gname else kv
            data = data.reshape(n, 2, data.shape[0] // n // 2, *data.shape[1:]).swapaxes(1, 2).reshape(data.shape)
        w.add_tensor(gname, np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


GGUF_CASES = {
    "llama3-rope_freqs": ("llama", CASES["llama3-rope"][1]),
    "qwen2-bias": ("qwen2", dict(num_key_value_heads=1, tie_word_embeddings=True)),
    "qwen3-qknorm": ("qwen3", dict(head_dim=32, tie_word_embeddings=False)),
}


@pytest.mark.parametrize("case", list(GGUF_CASES))
def test_gguf_naming_and_llama3_rope_freqs_match_transformers(tmp_path, case):
    kind, extra = GGUF_CASES[case]
    hf = _hf_checkpoint(tmp_path / "hf", kind, **extra)
    path = str(tmp_path / f"{case}.gguf")
    _write_gguf(path, hf, load_config(str(tmp_path / "hf")), kind)
    cfg = load_config(path)
    assert cfg.architecture == kind and cfg.qk_norm == (kind == "qwen3") and cfg.attention_bias == (kind == "qwen2")
    engine = LLMEngine(make_config(model=path, tokenizer=str(tmp_path / "hf"), dtype="float32", device="cpu",
                                   num_blocks=64, block_size=16))
    ids = [(7 * i + 3) % 256 for i in range(150)]
    engine.add_request("g", ids, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    got = run_to_completion(engine)["g"]["tokens"]
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, 150:].tolist()
    assert got == want
