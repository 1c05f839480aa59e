"""Schemathesis hooks for fuzzing pagedserve's OpenAPI document (tests/test_openapi.py; by hand, put tests/ on
PYTHONPATH and set SCHEMATHESIS_HOOKS=schemathesis_hooks).

The document states every rule of a request that a JSON schema can state, and schema-valid requests must be served.
The 400's description lists what no JSON schema can state; schema-valid cases that break one of those are the only
ones kept from the server, each decided by the server's own code, never by a guess:

- a grammar (format "grammar", guided_grammar) is drawn from valid Lark and GBNF grammars (a custom format's values);
- a named tool_choice is made to name one of the request's tools (the document requires tools with it);
- a case is dropped when its regex, JSON schema or tool parameters do not compile (the server's grammar compiler), a
  prompt tokenizes to nothing or does not fit the context (the bundled tokenizer, or $PAGEDSERVE_FUZZ_TOKENIZER's; the
  server's max_model_len), or it asks for more sequences (prompts x n) than may wait ($PAGEDSERVE_FUZZ_MAX_WAITING,
  default the server's default).

`STATS` counts the cases seen and dropped, by reason ($PAGEDSERVE_FUZZ_STATS: a JSON file to write it to at exit;
$PAGEDSERVE_FUZZ_DEBUG: print each dropped case).
"""

from __future__ import annotations

import collections
import functools
import json
import os

import httpx
import schemathesis
from hypothesis import strategies as st

from pagedserve.engine.async_engine import AdmissionLimits
from pagedserve.engine.errors import InvalidRequestError

STATS: collections.Counter = collections.Counter()

_LITERAL = st.text(st.characters(codec="utf-8", max_codepoint=0xFFFF, exclude_categories=["Cs"]), min_size=1,
                   max_size=8).map(json.dumps)
GRAMMARS = st.one_of(
    st.builds("start: {} | {}".format, _LITERAL, _LITERAL),
    st.builds("root ::= {} {}".format, _LITERAL, _LITERAL),  # GBNF
    st.builds("start: {} /[a-z]{{1,4}}/\n".format, _LITERAL),
    st.just('start: item ("," item)*\nitem: /[0-9]+/\n'),
    st.just('root ::= "yes" | "no"'),
)
schemathesis.openapi.format("grammar", GRAMMARS)


@functools.cache
def _tokenizer():
    from pagedserve.engine.config import bundled_model_path
    from pagedserve.engine.tokenizer import load_tokenizer

    return load_tokenizer(os.environ.get("PAGEDSERVE_FUZZ_TOKENIZER") or bundled_model_path())


@functools.cache
def _server(base_url: str):
    """The grammar compiler and input checks the server runs, over its tokenizer, with its context length."""
    from pagedserve.engine.input_processor import InputProcessor

    card = httpx.get(f"{base_url.rstrip('/')}/v1/models", timeout=30).json()["data"][0]
    tok = _tokenizer()
    return InputProcessor(tok, len(tok), card["max_model_len"])


def _positive(case) -> bool:
    return isinstance(case.body, dict) and case.meta is not None and case.meta.generation.mode.is_positive


@schemathesis.hook
def map_case(context, case):
    """A named tool_choice names one of the request's tools (which the document requires)."""
    body = case.body
    if _positive(case) and isinstance(body.get("tool_choice"), dict) and body.get("tools"):
        if "/v1/messages" in case.operation.path:  # Anthropic's shape: {"type": "tool", "name": ...}
            if body["tool_choice"].get("type") == "tool":
                body["tool_choice"]["name"] = body["tools"][0]["name"]
        else:
            body["tool_choice"]["function"]["name"] = body["tools"][0]["function"]["name"]
    return case


@schemathesis.hook
def filter_case(context, case) -> bool:
    if not _positive(case) or case.operation.method.upper() != "POST":
        return True
    map_case(context, case)  # the coverage phase filters before it maps
    STATS["cases"] += 1
    reason = _beyond_the_schema(case.operation.path, case.body, case.operation.base_url)
    if reason:
        STATS[reason] += 1
        if os.environ.get("PAGEDSERVE_FUZZ_DEBUG"):
            print(f"dropped ({reason}):", json.dumps(case.body)[:1000], flush=True)
    return reason is None


def _beyond_the_schema(path: str, body: dict, base_url: str) -> str | None:
    """Why the server refuses this schema-valid body for a rule no JSON schema can state, or None. It runs only those
    checks of the server's (as ChatEndpoint / CompletionEndpoint.build reach them), never its whole validation: a
    rule the document should state but does not must still reach the server and fail the run."""
    from pagedserve.server.protocol import ChatCompletionRequest, CompletionRequest
    from pagedserve.server.structured import structured_spec
    from pagedserve.server.tools import render_messages, resolve_tool_choice, tool_grammar

    if "/v1/messages" in path:
        return _beyond_the_messages_schema(path, body, base_url)
    chat = path.endswith("/chat/completions")
    try:
        request = (ChatCompletionRequest if chat else CompletionRequest).model_validate(body)
    except ValueError:  # the document and the models disagree: the server's 400 will show it
        return None
    waiting = int(os.environ.get("PAGEDSERVE_FUZZ_MAX_WAITING") or AdmissionLimits().max_waiting_requests)
    inputs = _server(base_url)
    try:
        if chat:
            tools = [t.model_dump(exclude_none=True) for t in request.tools or []]
            tc = request.tool_choice
            choice = resolve_tool_choice(tools, tc if isinstance(tc, str | None) else tc.model_dump())
            spec = tool_grammar(tools, choice, request.parallel_tool_calls) or structured_spec(request)
            messages = [m.model_dump(exclude_none=True, include={"role", "name", "tool_calls", "tool_call_id"})
                        | {"content": m.text()} for m in request.messages]
            messages, template_tools = render_messages(messages, tools, choice, inputs.tokenizer)
            prompts = [inputs.encode_chat(messages, template_tools)]
            need = request.max_completion_tokens or request.max_tokens or 1
        else:
            spec = structured_spec(request)
            prompts = [inputs.tokenize(p) for p in request.prompts()]
            need = 16 if request.max_tokens is None else request.max_tokens
        if spec is not None:
            inputs.structured.compile(spec)
    except InvalidRequestError as e:
        return "context" if e.code == "context_length_exceeded" else f"{e.param}: {e.message[:60]}"
    if any(not ids for ids in prompts):
        return "prompt tokenizes to nothing"
    if any(len(ids) + need > inputs.max_model_len for ids in prompts):
        return "context"
    if len(prompts) * request.n > waiting:
        return "sequences"
    return None


def _beyond_the_messages_schema(path: str, body: dict, base_url: str) -> str | None:
    """As `_beyond_the_schema`, for Anthropic's Messages routes (server/anthropic.py's checks, as its build reaches
    them): tool parameters that must compile when a tool must be called, a prompt that must fit the context."""
    from pagedserve.server.anthropic import prompt_ids
    from pagedserve.server.anthropic_protocol import CountTokensRequest, MessagesRequest
    from pagedserve.server.tools import tool_grammar

    messages = path.endswith("/v1/messages")
    try:
        request = (MessagesRequest if messages else CountTokensRequest).model_validate(body)
    except ValueError:
        return None
    inputs = _server(base_url)
    try:
        ids, tools, choice, parallel = prompt_ids(inputs, request)
        spec = tool_grammar(tools, choice, parallel) if messages else None
        if spec is not None:
            inputs.structured.compile(spec)
    except InvalidRequestError as e:
        return "context" if e.code == "context_length_exceeded" else f"{e.param}: {e.message[:60]}"
    if messages and len(ids) + request.max_tokens > inputs.max_model_len:
        return "context"
    return None


if os.environ.get("PAGEDSERVE_FUZZ_STATS"):  # where to write STATS when the run ends (JSON)
    import atexit

    atexit.register(lambda: open(os.environ["PAGEDSERVE_FUZZ_STATS"], "w").write(json.dumps(STATS)))
