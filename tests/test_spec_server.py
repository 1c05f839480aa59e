"""Speculative decoding through the server: usage reports drafted/accepted tokens, /metrics uses vLLM's
spec_decode names, and `pagedserve bench` reads acceptance from them."""

from __future__ import annotations

import asyncio

import httpx
import openai
from conftest import greedy, run_to_completion
from prometheus_client.parser import text_string_to_metric_families
from test_server import MODEL, running_server

from pagedserve.benchmarks.serve import scrape_spec_decode, spec_decode_delta
from pagedserve.engine.tokenizer import apply_chat_template

PASSAGE = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in "
           "want of a wife.")
MESSAGES = [{"role": "user", "content": f"Repeat this sentence exactly: {PASSAGE}"}]


def test_usage_metrics_and_bench_report_acceptance(make_engine, smollm):
    plain = make_engine()
    plain.add_request("ref", apply_chat_template(smollm.tokenizer, MESSAGES), greedy(24, logprobs=None))
    ref = run_to_completion(plain)["ref"]
    engine = make_engine(speculative_method="ngram", num_speculative_tokens=4, max_step_ms=0)
    engine.speculator.adaptive = False
    with running_server(engine) as (base, _):
        async def scrape():
            async with httpx.AsyncClient() as c:
                return await scrape_spec_decode(c, base)

        before = asyncio.run(scrape())
        assert before is not None and before["vllm:spec_decode_num_drafts"] == 0
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)
        resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0)
        assert resp.choices[0].message.content == smollm.tokenizer.decode(ref["tokens"], skip_special_tokens=True)
        details = resp.usage.completion_tokens_details
        assert details is not None and details.accepted_prediction_tokens > 0
        drafted = details.accepted_prediction_tokens + details.rejected_prediction_tokens

        stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0,
                                                stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
            resp.choices[0].message.content
        assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens == \
            details.accepted_prediction_tokens

        families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{base}/metrics").text)}
        drafts = families["vllm:spec_decode_num_drafts"].samples[0].value
        draft_tokens = families["vllm:spec_decode_num_draft_tokens"].samples[0].value
        accepted = families["vllm:spec_decode_num_accepted_tokens"].samples[0].value
        per_pos = families["vllm:spec_decode_num_accepted_tokens_per_pos"].samples
        assert drafts > 0 and draft_tokens == 2 * drafted and accepted == 2 * details.accepted_prediction_tokens
        assert sum(s.value for s in per_pos) == accepted and {s.labels["position"] for s in per_pos} == set("0123")

        report = spec_decode_delta(before, asyncio.run(scrape()))
        assert report["num_drafts"] == drafts and report["acceptance_rate"] == accepted / draft_tokens
        assert report["mean_acceptance_length"] == 1 + accepted / drafts
        assert len(report["acceptance_per_position"]) == 4
