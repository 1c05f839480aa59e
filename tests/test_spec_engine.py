"""Speculative decoding in the whole engine on the real SmolLM2 weights (fp32, CPU): greedy output is the
target's, token for token (near-tie rule as in the parity tests), whatever the proposer, batch, cache
pressure or aborts; blocks return to baseline after every scenario."""

import pytest
from conftest import greedy, record_comparison, run_to_completion

from pagedserve.benchmarks.workloads import load_words
from pagedserve.engine.tokenizer import apply_chat_template

PASSAGE = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in "
           "want of a wife. However little known the feelings or views of such a man may be on his first entering "
           "a neighbourhood, this truth is so well fixed in the minds of the surrounding families.")
TEXT_PROMPTS = [
    f"Repeat the following text exactly.\n\n{PASSAGE}\n\nRepeated text:\n{PASSAGE[:40]}",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "The capital of France is",
    "Once upon a time, in a land far away,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):",
    "Water boils at",
    "A B C D E F G A B C D E F G A B C",
]
CHAT = [[{"role": "user", "content": f"Quote this sentence back to me word for word: {PASSAGE[:160]}"}],
        [{"role": "user", "content": "Give me three tips for staying healthy."}]]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def prompts(smollm):
    tok = smollm.tokenizer
    return [tok.encode(p) for p in TEXT_PROMPTS] + [apply_chat_template(tok, m) for m in CHAT]


@pytest.fixture(scope="module")
def reference(make_engine, prompts):
    """Plain decoding, with logprobs for the near-tie rule."""
    engine = make_engine()
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, greedy(MAX_TOKENS))
    return run_to_completion(engine)


def spec_engine(make_engine, method, **kw):
    extra = dict(draft_dtype="bfloat16") if method == "draft" else {}
    engine = make_engine(speculative_method=method, num_speculative_tokens=5, **extra, **kw)
    engine.speculator.adaptive = False  # always draft: every scenario exercises acceptance and rejection
    return engine


def integrity(engine):
    s = engine.scheduler
    engine.block_manager.check_integrity(s.running + list(s.waiting))
    proposer = engine.speculator.proposer
    if hasattr(proposer, "block_manager"):
        proposer.block_manager.check_integrity([st.proxy for st in proposer._states.values()])


def assert_back_to_baseline(engine):
    bm = engine.block_manager
    assert bm.num_used_blocks == 0
    bm.check_integrity([])
    proposer = engine.speculator.proposer
    if hasattr(proposer, "block_manager"):
        assert proposer.block_manager.num_used_blocks == 0 and not proposer._states
        proposer.block_manager.check_integrity([])


def compare(results, reference, where, ids=None):
    for rid in ids or reference:
        ours, ref = results[rid], reference[rid]
        assert ours["finish_reason"] == ref["finish_reason"] or len(ours["tokens"]) != len(ref["tokens"])
        record_comparison(f"{where} request {rid}", ref["tokens"], ours["tokens"], ref["logprobs"])


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_identical_in_a_mixed_batch_with_chunked_prefill(make_engine, prompts, reference, method):
    """All prompts at once with a small token budget (prompts prefill in chunks while others verify drafts);
    two requests ask for logprobs and so do not speculate."""
    engine = spec_engine(make_engine, method, max_num_batched_tokens=48)
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, greedy(MAX_TOKENS, logprobs=5 if i in (2, 5) else None))
    results = run_to_completion(engine, integrity)
    compare(results, reference, method)
    stats = engine.speculator.stats
    assert stats.num_accepted_tokens > 20 and stats.num_accepted_tokens < stats.num_draft_tokens
    for i in (2, 5):
        assert len(results[str(i)]["logprobs"]) == len(results[str(i)]["tokens"])
    assert_back_to_baseline(engine)


def test_greedy_identical_one_by_one_with_adaptive_gamma(make_engine, prompts, reference):
    engine = make_engine(speculative_method="ngram", num_speculative_tokens=5)
    for i in (0, 4, 7):
        engine.add_request(str(i), prompts[i], greedy(MAX_TOKENS, logprobs=None))
        results = run_to_completion(engine, integrity)
        compare(results, reference, "ngram alone", [str(i)])
        assert results[str(i)]["tokens"] and engine.block_manager.num_used_blocks == 0
    assert engine.speculator.stats.num_accepted_tokens > 0
    assert_back_to_baseline(engine)


def test_greedy_identical_under_preemption(make_engine, smollm, prompts, reference):
    engine = spec_engine(make_engine, "ngram", num_blocks=20, block_size=16)  # 320 tokens for 9 requests
    words = load_words()
    extra = [smollm.tokenizer.encode(" ".join(words[200 * k: 200 * k + 30])) for k in range(6)]
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, greedy(MAX_TOKENS, logprobs=None))
    for k, ids in enumerate(extra):
        engine.add_request(f"x{k}", ids, greedy(MAX_TOKENS, logprobs=None))
    results = run_to_completion(engine, integrity)
    assert engine.scheduler.stats.num_preemptions > 0
    assert engine.speculator.stats.num_accepted_tokens > 0
    compare(results, reference, "preemption")
    assert_back_to_baseline(engine)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_aborts_mid_speculation(make_engine, prompts, reference, method):
    engine = spec_engine(make_engine, method)
    for i, ids in enumerate(prompts[:6]):
        engine.add_request(str(i), ids, greedy(MAX_TOKENS, logprobs=None))
    aborted = {"0", "4"}
    results: dict[str, dict] = {}
    steps = 0
    while engine.has_unfinished():
        if steps == 4:
            for rid in aborted:
                engine.abort(rid)
        for out in engine.step():
            r = results.setdefault(out.request_id, {"tokens": []})
            r["tokens"] += out.new_token_ids
            if out.finished:
                r["finish_reason"] = out.finish_reason
        integrity(engine)
        steps += 1
    for rid in aborted:
        assert results[rid]["finish_reason"] == "abort"
        assert results[rid]["tokens"] == reference[rid]["tokens"][:len(results[rid]["tokens"])]
    compare(results, reference, f"{method} aborts", [str(i) for i in range(6) if str(i) not in aborted])
    assert_back_to_baseline(engine)


def test_stop_string_inside_accepted_drafts(make_engine, prompts):
    """A stop string completed by an accepted draft ends the request there, as plain decoding does."""
    from pagedserve.engine import SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop=["possession"])
    runs = []
    for method in ("none", "ngram"):
        engine = make_engine(speculative_method=method)
        if engine.speculator is not None:
            engine.speculator.adaptive = False
        engine.add_request("s", prompts[0], params)
        runs.append(run_to_completion(engine)["s"])
        assert engine.block_manager.num_used_blocks == 0
    plain, spec = runs
    assert plain["finish_reason"] == "stop" and "possession" not in plain["text"]
    assert spec["text"] == plain["text"] and spec["tokens"] == plain["tokens"]
    assert spec["finish_reason"] == "stop"
