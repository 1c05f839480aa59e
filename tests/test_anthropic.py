"""Anthropic's Messages API (server/anthropic.py) for real: uvicorn on 127.0.0.1 and the official `anthropic` SDK
(plain, streamed, tool_use -> tool_result, stop_sequences, count_tokens, its error classes), raw SSE for the event
sequence, and the front's translation without a server."""

from __future__ import annotations

import asyncio
import json
import time

import anthropic
import httpx
import jsonschema
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_server import MODEL, _wait_idle, running_server, slowed

from pagedserve.engine.async_engine import AdmissionLimits
from pagedserve.engine.input_processor import InputProcessor
from pagedserve.server.anthropic import chat_messages, prompt_ids
from pagedserve.server.anthropic_protocol import MessagesRequest

GREEDY = {"temperature": 0}  # this SDK has no sampling arguments: they go in the body as extra fields
WEATHER = {"name": "get_weather", "description": "The weather in a city", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}
HI = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(make_engine):
    engine = make_engine(num_blocks=256, max_num_seqs=16, max_step_ms=0)
    with running_server(engine) as (base, state):
        yield base, state


@pytest.fixture()
def client(server):
    return anthropic.Anthropic(base_url=server[0], api_key="none", max_retries=0, timeout=120)


def sse(base: str, body: dict, headers: dict | None = None) -> list[tuple[str, dict]]:
    """A raw stream's (event name, data) pairs."""
    events, name = [], None
    with httpx.stream("POST", f"{base}/v1/messages", json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[6:])))
    return events


def test_a_message_is_the_chat_reply_of_the_same_prompt(server, client):
    """Same prompt, same greedy tokens: the Messages reply is the chat completion's, in Anthropic's shape."""
    base, _ = server
    msg = client.messages.create(model=MODEL, max_tokens=24, messages=HI, system="Answer briefly.",
                                 extra_body=GREEDY)
    chat = httpx.post(f"{base}/v1/chat/completions", json={
        "model": MODEL, "max_tokens": 24, "temperature": 0,
        "messages": [{"role": "system", "content": "Answer briefly."}, *HI]}, timeout=120).json()
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant" and msg.model == MODEL
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text == chat["choices"][0]["message"]["content"]
    assert msg.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[chat["choices"][0]["finish_reason"]]
    assert msg.stop_sequence is None
    assert msg.usage.output_tokens == chat["usage"]["completion_tokens"]
    # input_tokens are the prompt's uncached tokens, as Anthropic counts them; with the cache reads, the prompt
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == chat["usage"]["prompt_tokens"]
    count = client.messages.count_tokens(model=MODEL, messages=HI, system="Answer briefly.")
    assert count.input_tokens == chat["usage"]["prompt_tokens"]


def test_a_streamed_message_is_the_whole_one(server, client):
    base, _ = server
    whole = client.messages.create(model=MODEL, max_tokens=16, messages=HI, extra_body=GREEDY)
    with client.messages.stream(model=MODEL, max_tokens=16, messages=HI, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert (final.id.startswith("msg_"), final.stop_reason, final.usage.output_tokens) == \
        (True, whole.stop_reason, whole.usage.output_tokens)
    events = sse(base, {"model": MODEL, "max_tokens": 16, "messages": HI, "stream": True, **GREEDY})
    names = [n for n, _ in events]
    assert all(n == data["type"] for n, data in events)  # each event is named by its type
    deltas = names.count("content_block_delta")
    assert names == ["message_start", "content_block_start", "ping", *["content_block_delta"] * deltas,
                     "content_block_stop", "message_delta", "message_stop"] and deltas >= 1
    start, delta = events[0][1]["message"], events[-2][1]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    assert events[1][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert {d["index"] for n, d in events if n == "content_block_delta"} == {0}
    assert "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta") == text
    assert delta["delta"] == {"stop_reason": whole.stop_reason, "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == whole.usage.output_tokens


COUNT = [{"role": "user", "content": "Count from one to ten."}]


def test_stop_sequences(client):
    base = client.messages.create(model=MODEL, max_tokens=12, messages=COUNT, extra_body=GREEDY)
    text = base.content[0].text
    assert base.stop_reason == "max_tokens" and len(text) > 8
    stop = text[4:7]
    stopped = client.messages.create(model=MODEL, max_tokens=12, messages=COUNT, stop_sequences=["zzzz", stop],
                                     extra_body=GREEDY)
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
    assert stopped.content[0].text == text[:text.index(stop)]
    with client.messages.stream(model=MODEL, max_tokens=12, messages=COUNT, stop_sequences=[stop],
                                extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence, final.content[0].text) == \
        ("stop_sequence", stop, stopped.content[0].text)


def test_a_tool_use_and_its_result_round_trip(server, client):
    """A forced tool call (the grammar makes the bundled model write a valid one), streamed and whole alike; its
    result goes back as a tool_result block, and the reply to that is served."""
    base, _ = server
    kw = dict(model=MODEL, max_tokens=60, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"},
              messages=[{"role": "user", "content": "What is the weather in Paris?"}], extra_body=GREEDY)
    msg = client.messages.create(**kw)
    assert msg.stop_reason == "tool_use" and [b.type for b in msg.content] == ["tool_use"]
    call = msg.content[0]
    assert call.id.startswith("toolu_") and call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER["input_schema"])
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and [(b.type, b.name, b.input) for b in final.content] == \
        [("tool_use", "get_weather", call.input)]
    events = sse(base, {**{k: v for k, v in kw.items() if k != "extra_body"}, **GREEDY, "stream": True})
    starts = [d["content_block"] for n, d in events if n == "content_block_start"]
    assert len(starts) == 1 and starts[0]["type"] == "tool_use" and starts[0]["input"] == {}
    partial = "".join(d["delta"]["partial_json"] for n, d in events if n == "content_block_delta")
    assert json.loads(partial) == call.input
    # any: some tool, as Anthropic's "any" (several calls allowed unless disable_parallel_tool_use)
    anyone = client.messages.create(**{**kw, "tool_choice": {"type": "any", "disable_parallel_tool_use": True}})
    assert anyone.stop_reason == "tool_use" and [b.type for b in anyone.content] == ["tool_use"]

    history = [*kw["messages"], {"role": "assistant", "content": msg.content},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                             "content": [{"type": "text", "text": "Sunny, 21 degrees"}]}]}]
    answer = client.messages.create(model=MODEL, max_tokens=16, tools=[WEATHER], messages=history,
                                    extra_body=GREEDY)
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use") and answer.content
    counted = client.messages.count_tokens(model=MODEL, messages=history, tools=[WEATHER]).input_tokens
    assert counted == answer.usage.input_tokens + answer.usage.cache_read_input_tokens
    assert counted > msg.usage.input_tokens + msg.usage.cache_read_input_tokens
    none = client.messages.create(model=MODEL, max_tokens=8, tools=[WEATHER], tool_choice={"type": "none"},
                                  messages=kw["messages"], extra_body=GREEDY)
    assert [b.type for b in none.content] == ["text"] and none.stop_reason != "tool_use"


def test_the_front_translates_blocks_into_chat_turns(smollm):
    """tool_use blocks become an assistant's tool calls, tool_result blocks tool turns, system blocks the system
    message; thinking blocks stay out; a final assistant message is a prefill the prompt ends with."""
    body = MessagesRequest.model_validate({"max_tokens": 4, "system": [{"type": "text", "text": "Be brief."}],
                                           "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "s"},
                                          {"type": "text", "text": "Checking."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Rain",
                                      "is_error": True}, {"type": "text", "text": "And tomorrow?"}]}]})
    messages, prefill = chat_messages(body)
    assert not prefill
    assert messages == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather",
                                                               "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Error: Rain"},
        {"role": "user", "content": "And tomorrow?"}]
    inputs = InputProcessor(smollm.tokenizer, len(smollm.tokenizer), 4096)
    prefilled = MessagesRequest.model_validate({"max_tokens": 4, "messages": [
        {"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My favourite colour is"}]})
    assert chat_messages(prefilled)[1]
    ids = prompt_ids(inputs, prefilled)[0]
    assert smollm.tokenizer.decode(ids).endswith("My favourite colour is")  # continued, no new turn after it
    asked = prompt_ids(inputs, MessagesRequest.model_validate({"max_tokens": 4, "messages": prefilled.messages[:1]}))[0]
    assert not smollm.tokenizer.decode(asked).endswith("My favourite colour is")


def test_errors_are_anthropics_and_the_sdk_raises_its_classes(server, client):
    base, _ = server
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=8, messages=HI, extra_body={"temperature": 1.5})
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "temperature" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):  # any needs tools
        client.messages.create(model=MODEL, max_tokens=8, messages=HI, tool_choice={"type": "any"})
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=MODEL, max_tokens=8, messages=HI, tools=[WEATHER],
                               tool_choice={"type": "tool", "name": "nope"})
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-opus-9", max_tokens=8, messages=HI)
    assert e.value.body["error"]["type"] == "not_found_error"
    for body, status in (("{not json", 400), ({"messages": HI}, 400), ({"max_tokens": 5, "messages": []}, 400),
                         ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]}, 400),
                         ({"max_tokens": 5, "messages": [{"role": "user", "content": "word " * 5000}]}, 400)):
        kw = {"content": body} if isinstance(body, str) else {"json": body}
        r = httpx.post(f"{base}/v1/messages", headers={"content-type": "application/json"}, timeout=60, **kw)
        assert r.status_code == status, r.text
        assert set(r.json()) == {"type", "error"} and r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["message"]
    r = httpx.post(f"{base}/v1/messages/count_tokens", json={"messages": []})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    # the OpenAI routes keep OpenAI's shape
    r = httpx.post(f"{base}/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400 and set(r.json()) == {"error"} and r.json()["error"]["param"] == "messages"


def test_keys_x_api_key_and_an_authentication_error(make_engine):
    engine = make_engine(num_blocks=64, max_step_ms=0)
    with running_server(engine, api_key="sk-test") as (base, _):
        bad = anthropic.Anthropic(base_url=base, api_key="sk-wrong", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as e:
            bad.messages.create(model=MODEL, max_tokens=2, messages=HI)
        assert e.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                           "message": "Incorrect API key provided."}}
        good = anthropic.Anthropic(base_url=base, api_key="sk-test", max_retries=0)
        assert good.messages.create(model=MODEL, max_tokens=2, messages=HI).usage.output_tokens <= 2
        # Claude Code sends its key as x-api-key, with anthropic-version
        headers = {"x-api-key": "sk-test", "anthropic-version": "2023-06-01"}
        r = httpx.post(f"{base}/v1/messages/count_tokens", json={"messages": HI}, headers=headers)
        assert r.status_code == 200 and r.json()["input_tokens"] > 0
        r = httpx.post(f"{base}/v1/messages", json={"max_tokens": 2, "messages": HI}, headers={"x-api-key": "nope"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = httpx.post(f"{base}/v1/messages", json={"max_tokens": 2, "messages": HI})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "hi"})  # OpenAI's route, OpenAI's shape
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_a_full_queue_is_a_rate_limit_error_with_retry_after(make_engine):
    """One seat and one place to wait, both taken by long streams (chat completions that ignore EOS: one queue
    for every dialect): the SDK's next request gets a 429, which it raises as RateLimitError, in Anthropic's shape
    with Retry-After."""
    engine = make_engine(num_blocks=128, max_num_seqs=1, max_step_ms=0)
    slowed(engine, 0.05)
    with running_server(engine, AdmissionLimits(max_waiting_requests=1)) as (base, state):
        async def scenario():
            async def long(c: httpx.AsyncClient) -> None:
                body = {"max_tokens": 400, "messages": HI, "stream": True, "ignore_eos": True}
                async with c.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
                    async for _ in r.aiter_lines():
                        pass

            async def until(cond) -> None:
                deadline = time.monotonic() + 60
                while not cond():
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.02)

            async with httpx.AsyncClient(timeout=300) as c:
                tasks = [asyncio.create_task(long(c))]
                await until(lambda: state.client.num_running == 1)
                tasks.append(asyncio.create_task(long(c)))
                await until(lambda: state.client.num_waiting == 1)
                sdk = anthropic.AsyncAnthropic(base_url=base, api_key="none", max_retries=0)
                with pytest.raises(anthropic.RateLimitError) as e:
                    await sdk.messages.create(model=MODEL, max_tokens=2, messages=HI)
                for t in tasks:  # their clients leave: aborted, blocks freed
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                return e.value

        err = asyncio.run(scenario())
        assert err.body["type"] == "error" and err.body["error"]["type"] == "rate_limit_error"
        retry = int(err.response.headers["retry-after"])
        assert 1 <= retry <= 60 and int(err.response.headers["retry-after-ms"]) == retry * 1000
        _wait_idle(state)


def test_metrics_count_each_endpoint_and_a_dropped_stream_is_aborted(server, client):
    base, state = server

    def counts() -> dict[tuple[str, str], float]:
        out = {}
        for family in text_string_to_metric_families(httpx.get(f"{base}/metrics").text):
            for s in family.samples:
                if s.name == "pagedserve:http_requests_total":
                    out[(s.labels["endpoint"], s.labels["status"])] = s.value
        return out

    before = counts()
    client.messages.create(model=MODEL, max_tokens=2, messages=HI)
    client.messages.count_tokens(model=MODEL, messages=HI)
    httpx.post(f"{base}/v1/messages", json={"messages": HI})  # no max_tokens: 400
    httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    after = counts()
    for key, n in ((("/v1/messages", "200"), 1), (("/v1/messages/count_tokens", "200"), 1),
                   (("/v1/messages", "400"), 1), (("/v1/completions", "200"), 1)):
        assert after.get(key, 0) - before.get(key, 0) == n, key
    assert not any(endpoint == "/nope" for endpoint, _ in after)
    essay = [{"role": "user", "content": "Write a long essay about the history of the sea."}]
    with httpx.stream("POST", f"{base}/v1/messages", json={"max_tokens": 300, "messages": essay, "stream": True},
                      timeout=120) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i == 8:
                break  # the client leaves mid-stream
    _wait_idle(state)


def test_the_stream_is_framed_as_anthropics_and_a_failure_is_an_error_event(smollm):
    """Over server/serving.py's fake engine client: named events and no `[DONE]`; an engine that dies mid-stream
    ends it with an `error` event (api_error), a server shutting down with overloaded_error (retry)."""
    from test_serving import FakeClient, Raw, Stream

    from pagedserve.engine.async_engine import EngineDeadError, ShuttingDownError
    from pagedserve.server.anthropic import MessagesEndpoint
    from pagedserve.server.serving import Serving

    class Failing(Stream):
        error: BaseException | None = None

        async def __anext__(self):
            if self.error is not None and len(self._outs) == 1:  # after the first output
                raise self.error
            return await super().__anext__()

    class Client(FakeClient):
        def submit(self, request, places, tenant=None):
            super().submit(request, places, tenant)
            return Failing(self, request)

    def events(error: BaseException | None) -> list:
        Failing.error = error
        client = Client(InputProcessor(smollm.tokenizer, len(smollm.tokenizer), 4096))
        body = MessagesRequest.model_validate({"max_tokens": 2, "messages": HI, "stream": True})

        async def run():
            stream = await Serving(lambda: client, "m", False, 0.05).generate(MessagesEndpoint, body, Raw())
            return [e async for e in stream]

        out = asyncio.run(run())
        assert client.places.reserved == 0 and not client.live
        assert all(isinstance(e, dict) and json.loads(e["data"])["type"] == e["event"] for e in out)  # no [DONE]
        return [(e["event"], json.loads(e["data"])) for e in out]

    ok = events(None)
    assert [n for n, _ in ok] == ["message_start", "content_block_start", "ping", "content_block_delta",
                                  "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert "".join(d["delta"]["text"] for n, d in ok if n == "content_block_delta") == "t1t2"
    assert ok[-2][1]["delta"]["stop_reason"] == "max_tokens" and ok[-2][1]["usage"]["output_tokens"] == 2
    for error, kind in ((EngineDeadError(), "api_error"), (ShuttingDownError(), "overloaded_error")):
        failed = events(error)
        assert [n for n, _ in failed][0] == "message_start" and failed[-1][0] == "error"
        assert failed[-1][1]["type"] == "error" and failed[-1][1]["error"]["type"] == kind
        assert "message_stop" not in [n for n, _ in failed]
