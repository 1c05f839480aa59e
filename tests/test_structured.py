"""Constrained decoding in the engine: grammar masks, logit_bias / allowed_token_ids, and their interplay
with batching, n > 1, chunked prefill, preemption, stop strings and aborts (real SmolLM2 weights)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from conftest import run_to_completion

from pagedserve.engine import SamplingParams
from pagedserve.engine.errors import InvalidRequestError
from pagedserve.engine.structured import StructuredOutputs, StructuredSpec, TokenConstraint, apply_constraints

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}


def chat(tokenizer, text: str) -> list[int]:
    from pagedserve.engine.tokenizer import apply_chat_template

    return apply_chat_template(tokenizer, [{"role": "user", "content": text}])


def json_params(**kw) -> SamplingParams:
    kw.setdefault("max_tokens", 48)
    kw.setdefault("temperature", 0.0)
    return SamplingParams(structured=StructuredSpec("json_schema", PERSON), **kw)


def check_person(r: dict) -> None:
    assert r["finish_reason"] == "stop", r
    jsonschema.validate(json.loads(r["text"]), PERSON)


def test_json_schema_greedy_and_sampled(make_engine, smollm):
    engine = make_engine()
    prompt = chat(smollm.tokenizer, "Describe a person as JSON.")
    for i, t in enumerate([0.0, 1.0, 1.0, 1.0]):
        engine.add_request(f"r{i}", prompt, json_params(temperature=t, seed=i))
    for r in run_to_completion(engine).values():
        check_person(r)
    assert engine.block_manager.num_used_blocks == 0


def test_regex_choice_grammar_hold(make_engine, smollm):
    engine = make_engine()
    prompt = chat(smollm.tokenizer, "Give me a code.")
    engine.add_request("re", prompt, SamplingParams(max_tokens=16, temperature=1.0, seed=3,
                                                    structured=StructuredSpec("regex", r"[0-9]{3}-[a-z]{2,4}")))
    engine.add_request("ch", prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=4,
                                                    structured=StructuredSpec("choice", ["yes", "no", "maybe"])))
    lark = 'start: "(" num ("+" num)* ")"\nnum: /[1-9][0-9]?/'
    engine.add_request("gr", prompt, SamplingParams(max_tokens=24, temperature=1.0, seed=5,
                                                    structured=StructuredSpec("grammar", lark)))
    out = run_to_completion(engine)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", out["re"]["text"]) and out["re"]["finish_reason"] == "stop"
    assert out["ch"]["text"] in ("yes", "no", "maybe") and out["ch"]["finish_reason"] == "stop"
    gr = out["gr"]
    assert (re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", gr["text"]) if gr["finish_reason"] == "stop"
            else re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\+?", gr["text"])), gr


def test_constrained_requests_leave_unconstrained_greedy_unchanged(make_engine, smollm):
    prompts = [chat(smollm.tokenizer, q) for q in ("What is 2+2?", "Name a colour.", "Tell me a joke.")]
    alone = make_engine()
    for i, p in enumerate(prompts):
        alone.add_request(f"u{i}", p, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    ref = run_to_completion(alone)
    mixed = make_engine()
    for i, p in enumerate(prompts):
        mixed.add_request(f"c{i}", p, json_params(temperature=1.0, seed=i))
        mixed.add_request(f"u{i}", p, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    out = run_to_completion(mixed)
    for i in range(len(prompts)):
        assert out[f"u{i}"]["tokens"] == ref[f"u{i}"]["tokens"]
        check_person(out[f"c{i}"])


def test_chunked_prefill_preemption_and_n_copies(make_engine, smollm):
    """Tiny token budget (chunked prompts) and a tiny KV cache (preemption): grammars stay in step."""
    engine = make_engine(num_blocks=12, max_num_batched_tokens=32)
    params = json_params(temperature=1.0, max_tokens=40)
    for i in range(5):  # one SamplingParams object shared by all: each request still gets its own matcher
        engine.add_request(f"r{i}", chat(smollm.tokenizer, f"{i}: describe person {i} as JSON. " * 3), params)
    out = run_to_completion(engine, check=lambda e: e.block_manager.check_integrity())
    assert engine.scheduler.stats.num_preemptions > 0
    for r in out.values():
        check_person(r)
    assert engine.block_manager.num_used_blocks == 0


def test_length_mid_object_and_stop_string(make_engine, smollm):
    engine = make_engine()
    prompt = chat(smollm.tokenizer, "Describe a person as JSON.")
    engine.add_request("len", prompt, json_params(max_tokens=4))
    engine.add_request("stop", prompt, json_params(stop=['"age"']))
    out = run_to_completion(engine)
    assert out["len"]["finish_reason"] == "length" and len(out["len"]["tokens"]) == 4
    with pytest.raises(json.JSONDecodeError):
        json.loads(out["len"]["text"])
    assert out["stop"]["finish_reason"] == "stop" and '"age"' not in out["stop"]["text"]


def test_abort_mid_object_frees_blocks(make_engine, smollm):
    engine = make_engine()
    prompt = chat(smollm.tokenizer, "Describe a person as JSON.")
    engine.add_request("a", prompt, json_params(max_tokens=40))
    engine.add_request("b", prompt, json_params(max_tokens=40))
    steps = []

    def abort_after_4(e):
        steps.append(1)
        if len(steps) == 4:
            e.abort("a")

    out = run_to_completion(engine, check=abort_after_4)
    assert out["a"]["finish_reason"] == "abort"
    check_person(out["b"])
    assert engine.block_manager.num_used_blocks == 0


def test_invalid_grammars_rejected_with_the_reason(make_engine, smollm):
    engine = make_engine()
    ids = chat(smollm.tokenizer, "hi")
    bad = [StructuredSpec("json_schema", {"type": "strin"}), StructuredSpec("regex", "[a-z"),
           StructuredSpec("choice", []), StructuredSpec("grammar", "start: undefined_rule"),
           StructuredSpec("json_schema", "{not json")]
    for spec in bad:
        with pytest.raises(InvalidRequestError) as e:
            engine.add_request("x", ids, SamplingParams(structured=spec))
        assert e.value.param in ("response_format", "guided_choice") and e.value.message
    assert "strin" in _reason(engine, bad[0]) and "unclosed" in _reason(engine, bad[1])
    assert not engine.has_unfinished()


def _reason(engine, spec) -> str:
    with pytest.raises(InvalidRequestError) as e:
        engine.structured.compile(spec)
    return e.value.message


def test_logit_bias_and_allowed_token_ids(make_engine, smollm):
    tok = smollm.tokenizer
    engine = make_engine()
    prompt = tok.encode("The capital of France is")
    paris, london = tok.encode(" Paris")[0], tok.encode(" London")[0]
    engine.add_request("free", prompt, SamplingParams(max_tokens=1, temperature=0.0))
    engine.add_request("bias", prompt, SamplingParams(max_tokens=1, temperature=0.0, logit_bias={london: 100}))
    engine.add_request("ban", prompt, SamplingParams(max_tokens=1, temperature=0.0, logit_bias={paris: -100}))
    engine.add_request("allow", prompt, SamplingParams(max_tokens=3, temperature=1.0, seed=1,
                                                       allowed_token_ids=[london, 11]))
    out = run_to_completion(engine)
    assert out["free"]["tokens"] == [paris]
    assert out["bias"]["tokens"] == [london]
    assert out["ban"]["tokens"] != [paris]
    assert set(out["allow"]["tokens"]) <= {london, 11}
    with pytest.raises(InvalidRequestError):
        SamplingParams(logit_bias={1: 101})
    with pytest.raises(InvalidRequestError):
        engine.add_request("x", prompt, SamplingParams(allowed_token_ids=[10**7]))


def test_mask_application_unit(smollm):
    """Bias before mask; an empty row falls back to EOS; a grammar row and an allowed-list row AND."""
    so = StructuredOutputs(smollm.tokenizer, 49152)
    params = SamplingParams(structured=StructuredSpec("choice", ["yes", "no"]), allowed_token_ids=[
        smollm.tokenizer.encode("yes")[0], 7])
    c = so.constraint_for(params)

    class Seq:
        num_output_tokens = 0
        output_token_ids: list[int] = []

    so.begin_step([(c, Seq())])
    logits = torch.zeros(2, 49152)
    apply_constraints(logits, [c, None])
    allowed = (logits[0] > float("-inf")).nonzero().flatten().tolist()
    assert allowed == [smollm.tokenizer.encode("yes")[0]]
    assert torch.all(logits[1] == 0)
    empty = TokenConstraint(matcher=c.matcher, blocked=torch.ones(49152, dtype=torch.bool))
    logits = torch.zeros(1, 49152)
    apply_constraints(logits, [empty])
    assert (logits[0] > float("-inf")).nonzero().flatten().tolist() == [c.matcher.eos_token_id]


def test_matcher_draft_rollback(smollm):
    """The API speculative decoding uses: accept a draft, roll back the rejected tail."""
    so = StructuredOutputs(smollm.tokenizer, 49152)
    c = so.constraint_for(SamplingParams(structured=StructuredSpec("json_schema", PERSON)))
    m = c.matcher
    good = smollm.tokenizer.encode('{"name": "Al", "age": 3}')
    for t in good[:5]:
        assert m.accept(t)
    m.rollback(2)
    assert m.num_consumed == 3
    m.sync(good)  # replay to the sequence's tokens
    assert m.num_consumed == len(good) and m.is_terminated
    m.sync(good[:2])
    assert m.num_consumed == 2 and not m.is_terminated
