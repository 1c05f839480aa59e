"""Our Llama over the paged cache vs transformers on the real SmolLM2 weights, fp32."""

import torch
from conftest import greedy, record_comparison

from pagedserve.engine.tokenizer import apply_chat_template

LOGIT_PROMPTS = [
    "The quick brown fox jumps over the lazy dog because",
    "In a hole in the ground there lived a hobbit. Not a nasty, dirty, wet hole, filled with the ends of worms",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
]

GEN_PROMPTS = [
    "It is a truth universally acknowledged, that a single man in possession of a good fortune,",
    "The capital of France is",
    "Once upon a time",
    "1, 2, 3, 4, 5,",
    "Q: What is the boiling point of water in Celsius?\nA:",
    "import numpy as np\n\ndef softmax(x):",
]
CHAT_PROMPTS = [
    [{"role": "user", "content": "Give me three tips for staying healthy."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Why is the sky blue?"}],
]


def test_logits_match_transformers(make_engine, hf_model, smollm):
    engine = make_engine()
    for prompt in LOGIT_PROMPTS:
        ids = smollm.tokenizer.encode(prompt)
        with torch.no_grad():
            ref = hf_model(torch.tensor([ids])).logits[0]
        # prefill through the engine's own runner path, then every position's logits
        from pagedserve.engine.sequence import Sequence

        seq = Sequence(0, "p", ids, greedy(1), 1)
        engine.block_manager.allocate(seq, len(ids))
        runner = engine.runner
        meta = runner._metadata(list(range(len(ids))), [len(ids)], [len(ids)], [seq.block_table])
        with torch.inference_mode():
            hidden = runner.model(torch.tensor(ids), torch.arange(len(ids)), runner.kv_caches, meta, runner.backend)
            ours = runner.model.compute_logits(hidden)
        engine.block_manager.free(seq)
        diff = (ours - ref).abs().max().item()
        assert diff <= 1e-3, f"{prompt[:30]!r}: max abs logit diff {diff:.2e}"


def _hf_greedy(hf, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuations, generated as one left-padded batch (one by one took most of this
    module's time), each ending at its first EOS as ours do."""
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    eos = hf.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    return [row[:next((j + 1 for j, t in enumerate(row) if t in eos), len(row))] for row in out[:, width:].tolist()]


def test_greedy_64_tokens_match_transformers_generate(make_engine, hf_model, smollm):
    tok = smollm.tokenizer
    prompts = [tok.encode(p) for p in GEN_PROMPTS] + [apply_chat_template(tok, m) for m in CHAT_PROMPTS]
    assert len(prompts) == 8
    engine = make_engine()
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, greedy(64, ignore_eos=False))
    from conftest import run_to_completion

    ours = run_to_completion(engine)
    for i, ref in enumerate(_hf_greedy(hf_model, prompts, 64)):
        record_comparison(f"hf-generate prompt {i}", ours[str(i)]["tokens"], ref, ours[str(i)]["logprobs"])


BF16_NEAR_TIE = 0.3  # logprob gap: about two bf16 steps of a logit in SmolLM2's range (|logit| < 32: step 0.125)


def test_bf16_greedy_matches_transformers_bf16(smollm, hf_model):
    """bf16 (what `--dtype auto` picks on CPUs with native bf16) against transformers in bf16, same file. The two
    round differently (fused kernels, other summation orders), so a greedy continuation may leave the reference
    only at a near-tie of ours: the two tokens within BF16_NEAR_TIE in our logprobs. Every continuation must
    agree up to its first divergence, and at least two throughout. How many leave at a tie depends on the CPU's
    GEMM: 1-2 of 5 on AVX512-BF16 without AMX, 3 on AMX (oneDNN's tiles accumulate in another order), while
    transformers computes a bf16 GGUF model's matmuls in fp32."""
    import copy

    from conftest import NEAR_TIES, compare_greedy, run_to_completion

    from pagedserve.engine import LLMEngine, make_config
    from pagedserve.engine.models.loader import build_model

    # from_pretrained(dtype=bfloat16) on the file, without parsing the GGUF again (transformers takes seconds): it
    # makes the fp32 parameters cast to bf16 and keeps the rotary frequencies (the only buffers) in fp32, which
    # this copy does too; the two gave equal parameters, buffers, logits and generate() outputs, bit for bit.
    hf = copy.deepcopy(hf_model)
    assert all(name.startswith("model.rotary_emb.") for name, _ in hf.named_buffers())
    for p in hf.parameters():  # the tied LM head is the embedding's Parameter: cast once
        p.data = p.data.to(torch.bfloat16)
    hf.config.dtype = torch.bfloat16
    model = build_model(smollm.path, smollm.config, torch.bfloat16, torch.device("cpu"), 2048)
    engine = LLMEngine(make_config(model=smollm.path, dtype="bfloat16", device="cpu", num_blocks=64,
                                   max_model_len=2048), model=model, tokenizer=smollm.tokenizer)
    tok = smollm.tokenizer
    prompts = [tok.encode(p) for p in GEN_PROMPTS[:4]] + [apply_chat_template(tok, CHAT_PROMPTS[0])]
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, greedy(32))
    ours = run_to_completion(engine)
    results = []
    for i, ids in enumerate(prompts):  # one by one: a padded bf16 batch rounds differently again
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0)
        ref = out[0, len(ids):].tolist()
        results.append(compare_greedy(ours[str(i)]["tokens"], ref, ours[str(i)]["logprobs"], tol=BF16_NEAR_TIE))
        if results[-1] == "tie":
            NEAR_TIES.append(f"bf16 prompt {i} (tol {BF16_NEAR_TIE})")
    assert results.count("equal") >= 2, results
