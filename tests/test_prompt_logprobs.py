"""Prompt log-probabilities: equal to a fresh full forward pass, unchanged by chunked prefill, preemption and
prefix-cache hits; `echo + logprobs + max_tokens=0` through the real server and the openai client."""

from __future__ import annotations

import math

import openai
import pytest
import torch
from conftest import run_to_completion
from test_server import MODEL, running_server

from pagedserve.engine import SamplingParams
from pagedserve.engine.errors import InvalidRequestError

PROMPT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in "
          "want of a wife. However little known the feelings or views of such a man may be")


@pytest.fixture(scope="module")
def reference(smollm):
    """log p(token t+1 | tokens <= t) from one fresh forward pass of the engine's model over the whole prompt."""
    from pagedserve.engine.attention import get_backend
    from pagedserve.engine.model_runner import HostBatch

    ids = smollm.tokenizer.encode(PROMPT)
    model = smollm.model
    cfg = smollm.config
    n, bs = len(ids), 16
    blocks = math.ceil(n / bs)
    kv = torch.zeros(cfg.num_layers, 2, blocks, bs, cfg.num_kv_heads, cfg.head_dim)
    host = HostBatch.build(ids, list(range(n)), [n], [n], [list(range(blocks))], bs)
    with torch.inference_mode():
        hidden = model(host.input_ids, host.positions, [(kv[i, 0], kv[i, 1]) for i in range(cfg.num_layers)],
                       host.metadata(torch.device("cpu"), [n], [n]), get_backend("torch", torch.device("cpu")))
        lp = model.compute_logits(hidden).log_softmax(-1)
    return ids, [lp[p, ids[p + 1]].item() for p in range(n - 1)], lp


def _score(engine, ids, k=2, max_tokens=0, rid="p"):
    engine.add_request(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0, prompt_logprobs=k,
                                                ignore_eos=True))
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    firsts = [o.prompt_logprobs for o in outs if o.prompt_logprobs is not None]
    assert len(firsts) == 1  # sent once, with the first output
    return firsts[0], outs


def test_prompt_logprobs_equal_a_fresh_forward_pass(make_engine, reference):
    ids, ref, lp = reference
    engine = make_engine()
    plp, outs = _score(engine, ids, k=3)
    assert outs[-1].finished and outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 0
    assert plp[0] is None and len(plp) == len(ids)
    for p, entry in enumerate(plp[1:]):
        assert entry.token_id == ids[p + 1]
        assert entry.logprob == pytest.approx(ref[p], abs=1e-4)
        top_ids = lp[p].topk(3).indices.tolist()
        assert [t for t, _ in entry.top] == top_ids and entry.top[0][1] >= entry.logprob - 1e-6
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks  # nothing leaked


@pytest.mark.parametrize("budget", [7, 16])
def test_chunked_prefill_and_prefix_hits_do_not_change_them(make_engine, reference, budget):
    ids, ref, _ = reference
    engine = make_engine(max_num_batched_tokens=budget, enable_prefix_caching=True)
    # warm the prefix cache with the same prompt, then score it while it is still cached
    engine.add_request("warm", ids, SamplingParams(max_tokens=2, temperature=0))
    run_to_completion(engine)
    plp, outs = _score(engine, ids, k=0, max_tokens=3)
    assert outs[-1].num_cached_tokens == 0  # the cache is bypassed for prompt logprobs (as vLLM)
    assert len([t for o in outs for t in o.new_token_ids]) == 3
    assert [e.logprob for e in plp[1:]] == pytest.approx(ref, abs=1e-4)
    # an ordinary request still hits the cache afterwards
    engine.add_request("again", ids, SamplingParams(max_tokens=1))
    assert run_to_completion(engine)["again"]["num_cached_tokens"] > 0


def test_batched_with_other_requests_and_generation(make_engine, reference):
    ids, ref, _ = reference
    engine = make_engine(max_num_batched_tokens=20)
    engine.add_request("other", "Once upon a time", SamplingParams(max_tokens=8, temperature=0))
    plp, outs = _score(engine, ids, k=1, max_tokens=4)
    assert [e.logprob for e in plp[1:]] == pytest.approx(ref, abs=1e-4)
    assert sum(len(o.new_token_ids) for o in outs) == 4


def test_max_tokens_zero_needs_prompt_logprobs():
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)


def test_echo_logprobs_max_tokens_zero_through_the_server(make_engine, reference, smollm):
    ids, ref, _ = reference
    engine = make_engine(max_num_batched_tokens=16, max_step_ms=0)
    with running_server(engine) as (base, _):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)
        r = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0)
        c = r.choices[0]
        assert c.text == PROMPT and c.finish_reason == "length" and r.usage.completion_tokens == 0
        lp = c.logprobs
        assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:] == pytest.approx(ref, abs=1e-4)
        assert all(len(t) == 1 for t in lp.top_logprobs[1:])
        assert "".join(lp.tokens) == smollm.tokenizer.decode(ids)
        # lm-evaluation-harness's loglikelihood request: echo, logprobs=1, max_tokens=1, token-id prompt
        r = client.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=1, max_tokens=1, temperature=0)
        lp = r.choices[0].logprobs
        assert len(lp.token_logprobs) == len(ids) + 1 and lp.token_logprobs[1:len(ids)] == pytest.approx(ref, abs=1e-4)
        # streaming: the prompt's entries arrive with the first engine chunk
        chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=0, max_tokens=0,
                                                stream=True))
        scored = [x for ch in chunks for x in (ch.choices[0].logprobs.token_logprobs if ch.choices and
                                                ch.choices[0].logprobs else [])]
        assert scored[0] is None and scored[1:] == pytest.approx(ref, abs=1e-4)
        # max_tokens=0 without echo + logprobs is still a bad request
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0)
