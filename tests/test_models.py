"""Each supported architecture and RoPE variant vs transformers, on tiny random HF checkpoints (fp32)."""

import pytest
import torch
from conftest import run_to_completion

from engine import LLMEngine, SamplingParams, make_config
from engine.models.loader import load_config

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
    from engine.sequence import Sequence

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
