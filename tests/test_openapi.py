"""The OpenAPI document tells the truth: what it allows is served, what it refuses is a 400, and every status code
is documented. Each rule the document states is checked both ways here (the document's JSON schema and the server
agree on it); a schema-driven fuzzer (schemathesis, every check) runs against a real server in the heavy tier.
The docs are served offline."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import jsonschema
import pytest
from test_server import MODEL, _wait_idle, running_server

from pagedserve.engine import LLMEngine, make_config
from pagedserve.server.protocol import below

VOCAB = 49152  # the bundled tokenizer's, which the tiny model keeps
CAP = 16  # --max-output-tokens: fuzzed requests stay cheap, and the document states it
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def tiny_long_dir(tmp_path_factory, smollm):
    """A tiny random Llama with the bundled tokenizer and a 4096-token context: fuzzed prompts fit."""
    import torch
    import transformers

    path = tmp_path_factory.mktemp("tiny-4k")
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                                   tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    smollm.tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def fuzz_server(tiny_long_dir):
    """A tiny random model behind the bundled tokenizer: every generated request is cheap to serve."""
    engine = LLMEngine(make_config(model=str(tiny_long_dir), dtype="float32", device="cpu", num_blocks=1024,
                                   max_step_ms=0))
    with running_server(engine, max_output_tokens=CAP) as (base, state):
        yield base, state


@pytest.fixture(scope="module")
def document(fuzz_server):
    return httpx.get(f"{fuzz_server[0]}/openapi.json").json()


def _schema_allows(document: dict, model: str, body: dict) -> bool:
    validator = jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{model}",
                                                  "components": document["components"]})
    return validator.is_valid(body)


MSG = [{"role": "user", "content": "hi"}]
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
# (what, route, body, allowed): the document and the server must agree on each. Bodies the server serves ask for
# 2 tokens (the tiny model is fast; the cap is 16).
RULES = [
    ("guided_choice empty", CHAT, {"guided_choice": []}, False),
    ("guided_choice", CHAT, {"guided_choice": ["a", ""]}, True),
    ("top_logprobs without logprobs", CHAT, {"top_logprobs": 2}, False),
    ("top_logprobs 0 without logprobs (as vLLM)", CHAT, {"top_logprobs": 0}, True),
    ("top_logprobs with logprobs", CHAT, {"top_logprobs": 2, "logprobs": True}, True),
    ("chat max_tokens 0", CHAT, {"max_tokens": 0}, False),
    ("max_tokens over --max-output-tokens", CHAT, {"max_tokens": CAP + 1}, False),
    ("max_completion_tokens over it", CHAT, {"max_completion_tokens": CAP + 1}, False),
    ("max_tokens over it beside max_completion_tokens", CHAT, {"max_tokens": CAP + 1, "max_completion_tokens": 2},
     False),
    ("completions max_tokens over it", COMPLETIONS, {"max_tokens": CAP + 1}, False),
    ("max_tokens 0 scoring the prompt", COMPLETIONS, {"max_tokens": 0, "echo": True, "logprobs": 1}, True),
    ("max_tokens 0 without echo", COMPLETIONS, {"max_tokens": 0, "logprobs": 1}, False),
    ("max_tokens 0 without logprobs", COMPLETIONS, {"max_tokens": 0, "echo": True}, False),
    ("stop empty", CHAT, {"stop": ""}, False),
    ("stop list with an empty one", COMPLETIONS, {"stop": ["a", ""]}, False),
    ("five stops", CHAT, {"stop": list("abcde")}, False),
    ("a stop of 257 characters", CHAT, {"stop": "x" * 257}, False),
    ("four stops", CHAT, {"stop": list("abcd")}, True),
    ("n as a string", CHAT, {"n": "2"}, False),
    ("n as 2.0 (a JSON Schema integer)", CHAT, {"n": 2.0}, True),
    ("stream as 1", CHAT, {"stream": 1}, False),
    ("temperature as true", CHAT, {"temperature": True}, False),
    ("seed 2**64 - 1", COMPLETIONS, {"seed": 2**64 - 1}, True),
    ("seed 2**64", COMPLETIONS, {"seed": 2**64}, False),
    ("logit_bias key with a leading zero", CHAT, {"logit_bias": {"01": 1}}, False),
    ("logit_bias key the last token", CHAT, {"logit_bias": {str(VOCAB - 1): 1}}, True),
    ("logit_bias key past the vocabulary", CHAT, {"logit_bias": {str(VOCAB): 1}}, False),
    ("logit_bias value over 100", CHAT, {"logit_bias": {"5": 100.5}}, False),
    ("allowed_token_ids past the vocabulary", CHAT, {"allowed_token_ids": [VOCAB]}, False),
    ("prompt token past the vocabulary", COMPLETIONS, {"prompt": [1, VOCAB]}, False),
    ("prompt tokens in it", COMPLETIONS, {"prompt": [[1, VOCAB - 1]]}, True),
    ("stop token past the vocabulary (it never stops)", COMPLETIONS, {"stop_token_ids": [10**9]}, True),
    ("an image part", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:,"}}]}]}, False),
    ("text parts", CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, True),
    ("tool_choice auto without tools", CHAT, {"tool_choice": "auto"}, False),
    ("tool_choice required with no tools", CHAT, {"tool_choice": "required", "tools": []}, False),
    ("a named tool_choice not an object of its shape", CHAT, {"tools": [TOOL], "tool_choice": {"function": "f"}},
     False),
    ("a named tool_choice", CHAT, {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}}},
     True),
    ("two tools of one name (as vLLM)", CHAT, {"tools": [TOOL, TOOL], "tool_choice": "required"}, True),
    ("two output constraints", CHAT, {"guided_regex": "a", "guided_choice": ["a"]}, False),
    ("response_format json_object and a guided one", COMPLETIONS,
     {"response_format": {"type": "json_object"}, "guided_regex": "a"}, False),
    ("response_format text and a guided one", COMPLETIONS,
     {"response_format": {"type": "text"}, "guided_choice": ["a"]}, True),
    ("json_schema without its schema", CHAT, {"response_format": {"type": "json_schema"}}, False),
    ("functions", CHAT, {"functions": [{"name": "f"}]}, False),
    ("functions empty", CHAT, {"functions": [], "function_call": "none", "suffix": ""}, True),
    ("best_of 2", COMPLETIONS, {"best_of": 2, "n": 2}, False),
    ("best_of 1", COMPLETIONS, {"best_of": 1}, True),
    ("best_of true", COMPLETIONS, {"best_of": True}, False),
    ("modalities audio", CHAT, {"modalities": ["text", "audio"]}, False),
]


@pytest.mark.parametrize("what,route,body,allowed", RULES, ids=[r[0] for r in RULES])
def test_the_document_states_what_the_server_enforces(fuzz_server, document, what, route, body, allowed):
    base, state = fuzz_server
    model = "ChatCompletionRequest" if route == CHAT else "CompletionRequest"
    full = {"messages": MSG} if route == CHAT else {"prompt": "hi"}
    full.update({"max_tokens": 2} if "max_tokens" not in body and "max_completion_tokens" not in body else {})
    full.update(body)
    assert _schema_allows(document, model, full) == allowed
    r = httpx.post(base + route, content=json.dumps(full), headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == (200 if allowed else 400), r.text
    _wait_idle(state)


MESSAGES, COUNT_TOKENS = "/v1/messages", "/v1/messages/count_tokens"
TOOL_A = {"name": "f", "input_schema": {"type": "object"}}
# Anthropic's Messages routes: (what, route, body, allowed), as RULES
MESSAGES_RULES = [
    ("max_tokens missing", MESSAGES, {"max_tokens": None}, False),
    ("max_tokens over --max-output-tokens", MESSAGES, {"max_tokens": CAP + 1}, False),
    ("temperature 1 (Anthropic's top)", MESSAGES, {"temperature": 1.0}, True),
    ("temperature over 1", MESSAGES, {"temperature": 1.5}, False),
    ("top_k", MESSAGES, {"top_k": 5, "top_p": 0.9}, True),
    ("five stop sequences", MESSAGES, {"stop_sequences": list("abcde")}, False),
    ("an empty stop sequence", MESSAGES, {"stop_sequences": [""]}, False),
    ("system blocks", MESSAGES, {"system": [{"type": "text", "text": "Be brief."}]}, True),
    ("an image block", MESSAGES, {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     False),
    ("a system role in messages", MESSAGES, {"messages": [{"role": "system", "content": "hi"}]}, False),
    ("tool_choice any without tools", MESSAGES, {"tool_choice": {"type": "any"}}, False),
    ("tool_choice auto without tools", MESSAGES, {"tool_choice": {"type": "auto"}}, True),
    ("tool_choice tool", MESSAGES, {"tools": [TOOL_A], "tool_choice": {"type": "tool", "name": "f"}}, True),
    ("a tool without input_schema", MESSAGES, {"tools": [{"name": "f"}]}, False),
    ("a tool name with a space", MESSAGES, {"tools": [{"name": "a b", "input_schema": {}}]}, False),
    ("a tool_use / tool_result turn", MESSAGES, {"messages": [
        MSG[0], {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}],
        "tools": [TOOL_A]}, True),
    ("metadata and unknown fields (cache_control, thinking)", MESSAGES,
     {"metadata": {"user_id": "u"}, "thinking": {"type": "disabled"}, "cache_control": {"type": "ephemeral"}}, True),
    ("stream as 1", MESSAGES, {"stream": 1}, False),
    ("count_tokens without max_tokens", COUNT_TOKENS, {}, True),
    ("count_tokens with no messages", COUNT_TOKENS, {"messages": []}, False),
    ("count_tokens, tool_choice tool without tools", COUNT_TOKENS, {"tool_choice": {"type": "tool", "name": "f"}},
     False),
]


@pytest.mark.parametrize("what,route,body,allowed", MESSAGES_RULES, ids=[r[0] for r in MESSAGES_RULES])
def test_the_document_states_what_the_messages_routes_enforce(fuzz_server, document, what, route, body, allowed):
    base, state = fuzz_server
    model = "MessagesRequest" if route == MESSAGES else "CountTokensRequest"
    full = {k: v for k, v in ({"messages": MSG, "max_tokens": 2} | body).items() if v is not None}
    if route == COUNT_TOKENS:
        full.pop("max_tokens")
    assert _schema_allows(document, model, full) == allowed
    r = httpx.post(base + route, content=json.dumps(full), headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == (200 if allowed else 400), r.text
    if not allowed:
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    _wait_idle(state)


@pytest.mark.parametrize("name,status", [(MODEL, 200), (None, 200), ("gpt-4o", 404)])
def test_the_document_names_the_served_model(fuzz_server, document, name, status):
    """Only the served model's name (or none) is schema-valid, so a fuzzer's positive cases are never a 404."""
    base, state = fuzz_server
    for route, model, body in ((CHAT, "ChatCompletionRequest", {"messages": MSG}),
                               (COMPLETIONS, "CompletionRequest", {"prompt": "hi"})):
        full = {**body, "max_tokens": 2} | ({} if name is None else {"model": name})
        assert _schema_allows(document, model, full) == (status == 200)
        r = httpx.post(base + route, json=full, timeout=60)
        assert r.status_code == status, r.text
        if status == 404:
            assert r.json()["error"]["code"] == "model_not_found"
    _wait_idle(state)


def test_the_document_states_the_model_and_server_limits(fuzz_server, document):
    base, _ = fuzz_server
    schemas = document["components"]["schemas"]
    chat, completions = schemas["ChatCompletionRequest"]["properties"], schemas["CompletionRequest"]["properties"]
    assert chat["max_tokens"]["anyOf"][0]["maximum"] == chat["max_completion_tokens"]["anyOf"][0]["maximum"] == CAP
    assert chat["allowed_token_ids"]["anyOf"][0]["items"]["maximum"] == VOCAB - 1
    assert completions["prompt"]["anyOf"][1]["items"]["maximum"] == VOCAB - 1
    assert chat["logit_bias"]["anyOf"][0]["propertyNames"]["pattern"] == below(VOCAB)
    assert "x-pagedserve" not in json.dumps(document)
    seed = completions["seed"]["anyOf"][0]  # exact integers: read as floats, 2**64 + 382 would pass
    assert (seed["minimum"], seed["exclusiveMaximum"]) == (-(2**63), 2**64) and type(seed["minimum"]) is int
    assert "a named tool_choice that is not among `tools`" in document["paths"][CHAT]["post"]["responses"]["400"][
        "description"]
    # unasked, a chat request gets at most the cap; the completions default (16) stays within it
    r = httpx.post(f"{base}{CHAT}", json={"messages": MSG, "ignore_eos": True}, timeout=60).json()
    assert r["usage"]["completion_tokens"] == CAP


def test_below_is_the_numbers_under_n():
    import re

    for n in (1, 9, 10, 11, 100, 101, 999, 1000, 1234, 49152):
        pattern = re.compile(below(n))
        assert all(bool(pattern.fullmatch(str(k))) == (k < n) for k in range(0, 2 * n + 20))
        assert not any(pattern.fullmatch(s) for s in ("", "00", "01", "-1", "+1", " 1", "1.0", "1\n"))


@pytest.mark.slow  # load, flood or fuzz: the heavy tier
def test_schemathesis_finds_nothing(fuzz_server, tmp_path):
    """schemathesis's CLI with every check, positive and negative cases, bounded in examples and time: no 5xx, no
    undocumented status code, no schema-valid request refused, no invalid one served, responses as documented.
    tests/schemathesis_hooks.py keeps positive cases off the rules no JSON schema can state; it may drop only a
    few of them. FUZZ_EXAMPLES searches harder by hand."""
    base, state = fuzz_server
    seen = _fuzz(base, tmp_path, seed=49)
    for route in (CHAT, COMPLETIONS, MESSAGES, COUNT_TOKENS):
        assert 200 in seen[(f"POST {route}", "positive")] and seen[(f"POST {route}", "negative")] >= {400}
    _wait_idle(state, timeout=120)


@pytest.mark.slow  # load, flood or fuzz: the heavy tier
def test_schemathesis_finds_nothing_on_the_messages_routes(fuzz_server, tmp_path):
    """As above, for Anthropic's Messages routes alone: no 5xx, every status documented, every schema-valid body
    served, every invalid one a 400 in Anthropic's shape."""
    base, state = fuzz_server
    seen = _fuzz(base, tmp_path, seed=52, path_regex="^/v1/messages")
    for route in (MESSAGES, COUNT_TOKENS):
        assert 200 in seen[(f"POST {route}", "positive")] and seen[(f"POST {route}", "negative")] >= {400}
    assert not any(code >= 500 for codes in seen.values() for code in codes), seen
    _wait_idle(state, timeout=120)


def _fuzz(base: str, tmp_path, seed: int, path_regex: str | None = None) -> dict:
    """schemathesis's CLI with every check (over the operations whose path matches `path_regex`, else all), bounded
    in examples and time; what it dropped is checked. Returns (operation, generation mode) -> status codes seen."""
    stats = tmp_path / "stats.json"
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "schemathesis_hooks", "PAGEDSERVE_FUZZ_STATS": str(stats),
           "PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", f"{base}/openapi.json", "--checks", "all",
           *(["--include-path-regex", path_regex] if path_regex else []),
           "--max-examples", os.environ.get("FUZZ_EXAMPLES", "40"), "--max-time", "240", "--request-timeout", "120",
           # `--checks all` times every response against 10 s by default: a loaded machine's n=8 x 9-prompt case
           # takes longer. Tests assert no wall time: a response within the request timeout passes.
           "--max-response-time", "120",
           "--workers", "1", "--seed", str(seed), "--continue-on-failure", "--no-color", "--report", "ndjson",
           "--report-dir", str(tmp_path), "--generation-database", "none"]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path)  # its caches too
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert "No issues found" in run.stdout
    seen: dict = {}
    for line in next(tmp_path.glob("*.ndjson")).read_text().splitlines():
        recorder = json.loads(line).get("ScenarioFinished", {}).get("recorder") or {}
        for case_id, case in recorder.get("cases", {}).items():
            response = (recorder.get("interactions", {}).get(case_id) or {}).get("response")
            meta = case["value"].get("meta") or {}
            if response is not None and meta:
                seen.setdefault((recorder["label"], meta["generation"]["mode"]), set()).add(response["status_code"])
    dropped = json.loads(stats.read_text())
    assert sum(v for k, v in dropped.items() if k != "cases") <= dropped["cases"] // 5, dropped
    return seen


def test_the_document_and_docs_work_offline(fuzz_server, document):
    base, state = fuzz_server
    chat = document["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert "422" not in chat and {"400", "429", "503"} <= set(chat)
    assert "Retry-After" in chat["429"]["headers"]
    metrics = document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain"]
    page = httpx.get(f"{base}/docs").text
    assert "/docs/assets/swagger-ui-bundle.js" in page and "cdn" not in page.lower()
    assert httpx.get(f"{base}/docs/assets/swagger-ui-bundle.js").status_code == 200
    assert state.client.engine.block_manager.num_used_blocks == 0 or state.client.num_running


def test_the_document_accepts_only_priority_0_without_priority_scheduling():
    """Under fcfs a non-zero priority is a 400 (as in vLLM), so the document says 0 only; under priority scheduling
    (and before the model has loaded, when it is not known yet) any integer."""
    from pagedserve.engine.async_engine import AdmissionLimits
    from pagedserve.server.app import ServerConfig, create_app, openapi_document

    app = create_app(lambda: None, ServerConfig("m", AdmissionLimits()))
    for priorities, enum in ((False, [0]), (True, None), (None, None)):
        schemas = openapi_document(app, priorities=priorities)["components"]["schemas"]
        for model in ("ChatCompletionRequest", "CompletionRequest"):
            prop = schemas[model]["properties"]["priority"]
            assert prop["type"] == "integer" and prop.get("enum") == enum, (priorities, model, prop)
