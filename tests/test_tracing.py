"""Request ids and traces: X-Request-Id through a real server (echoed, sanitized, generated, on errors and streams,
in the log line and /v1/engine/state), ids that must not clash in the engine, and the OpenTelemetry spans with the
SDK's in-memory exporter (the `otel` extra, which the test extra installs)."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import subprocess
import sys
import time

import httpx
import pytest
from test_server import MODEL, running_server

from pagedserve.engine.async_engine import AdmissionLimits, AsyncEngine
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.server.config import ServerConfig
from pagedserve.server.tracing import safe_id, traces_url

KEY = {"Authorization": "Bearer key-a"}
FRESH = re.compile(r"req-[0-9a-f]{32}")
LOGGER = "pagedserve.server.tracing"


def chat(max_tokens: int = 3, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, **extra}


def wait_for(cond, what: str):
    """The spans and the log line come once the response has been sent: after the client has its last byte."""
    deadline = time.monotonic() + 30
    while not (value := cond()):
        assert time.monotonic() < deadline, what
        time.sleep(0.02)
    return value


def log_line(caplog, request_id: str) -> str:
    return wait_for(lambda: next((m for m in caplog.messages if m.startswith(f"request_id={request_id} ")), None),
                    f"no log line for {request_id}")


# ---- without a server ----------------------------------------------------------------------------------------
def test_safe_ids_and_the_collector_url():
    assert safe_id(b"lb.7f3a_01:x-9") == "lb.7f3a_01:x-9" and safe_id(b"a" * 128) == "a" * 128
    for bad in (None, b"", b"a" * 129, b"has space", b"<script>", b"caf\xc3\xa9", b"a\r\nb", b"x#2"):
        assert safe_id(bad) is None, bad
    assert traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert traces_url("http://collector:4318/") == "http://collector:4318/v1/traces"
    assert traces_url("https://collector/custom/path") == "https://collector/custom/path"
    assert ServerConfig(MODEL, otlp_traces_endpoint="http://collector:4318").otlp_traces_endpoint
    for bad in ("localhost:4318", "grpc://collector:4317", "http://", ""):
        with pytest.raises(ValueError, match="otlp_traces_endpoint"):
            ServerConfig(MODEL, otlp_traces_endpoint=bad)


def test_without_the_extra_the_flag_is_one_line_before_the_port_is_bound():
    with socket.socket() as held:  # were the port bound first, the error would be "cannot listen"
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        code = ("import sys\nsys.modules['opentelemetry.sdk'] = None  # the extra, not installed\n"
                "from pagedserve.server.cli import main\n"
                f"main(['serve', '--otlp-traces-endpoint', 'http://127.0.0.1:4318', '--port', '{port}'])")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("pagedserve: error: --otlp-traces-endpoint needs OpenTelemetry: pip install "
                           "'pagedserve[otel]'"), line


def test_an_id_the_engine_still_holds_is_suffixed(make_engine):
    """A client's retry can arrive before its first attempt's abort reached the engine: the retry runs under a
    suffixed id instead of being refused as a duplicate. The engine thread is not started: this test steps it."""
    engine = make_engine(num_blocks=32, max_num_seqs=4, max_step_ms=0)
    aeng = AsyncEngine(engine)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)

    async def main():
        def submit():
            return aeng.submit(aeng.input_processor.process("retry-0", [1, 2, 3, 4], params), aeng.reserve())

        first = submit()
        assert first.request_id == "retry-0"
        first.close()  # the client left: the abort waits for the engine's next step
        again = submit()
        assert again.request_id == "retry-0#2" and engine.has_request("retry-0")
        engine.step()  # the abort lands, the retry starts
        assert not engine.has_request("retry-0") and engine.has_request("retry-0#2")
        third = submit()  # the id is free again
        assert third.request_id == "retry-0"
        while engine.has_unfinished():
            engine.step()
        again.close()
        third.close()
        assert not aeng.in_use("retry-0") and not aeng.in_use("retry-0#2")

    asyncio.run(main())


# ---- X-Request-Id through a real server ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(make_engine):
    engine = make_engine(num_blocks=96, max_num_seqs=8, max_step_ms=0)
    with running_server(engine, AdmissionLimits(max_waiting_requests=4), api_key="key-a",
                        max_body_bytes=16384) as (base, state):
        yield base, state


def test_a_safe_id_is_echoed_and_names_the_log_line(server, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    base, _ = server
    r = httpx.post(f"{base}/v1/chat/completions", json=chat(), headers={**KEY, "X-Request-Id": "lb.7f3a_01:x-9"},
                   timeout=60)
    assert r.status_code == 200 and r.headers["x-request-id"] == "lb.7f3a_01:x-9"
    u = r.json()["usage"]
    line = log_line(caplog, "lb.7f3a_01:x-9")
    assert (f"POST /v1/chat/completions status=200 prompt_tokens={u['prompt_tokens']} completion_tokens=3 "
            f"cached_tokens={u['prompt_tokens_details']['cached_tokens']} finish_reason=length seconds=") in line


def test_an_id_is_generated_when_absent_on_every_route(server):
    base, _ = server
    ids = []
    for method, path in (("POST", "/v1/chat/completions"), ("GET", "/health"), ("GET", "/v1/models"),
                         ("GET", "/metrics"), ("GET", "/")):
        r = httpx.request(method, f"{base}{path}", json=chat() if method == "POST" else None, headers=KEY,
                          timeout=60)
        assert r.status_code == 200 and FRESH.fullmatch(r.headers["x-request-id"]), (path, r.headers)
        assert r.headers.get_list("x-request-id") == [r.headers["x-request-id"]]  # one, never two
        ids.append(r.headers["x-request-id"])
    assert len(set(ids)) == len(ids)


@pytest.mark.parametrize("bad", [b"has space", b"a" * 129, b"<script>", b"caf\xc3\xa9", b"x#2", b""])
def test_an_unsafe_id_is_replaced_and_logged_never_refused(server, caplog, bad):
    caplog.set_level(logging.INFO, logger=LOGGER)
    base, _ = server
    r = httpx.post(f"{base}/v1/chat/completions", json=chat(), timeout=60,
                   headers=[(b"Authorization", KEY["Authorization"].encode()), (b"X-Request-Id", bad)])
    assert r.status_code == 200
    fresh = r.headers["x-request-id"]
    assert FRESH.fullmatch(fresh)
    assert any(m.startswith(f"request {fresh}: ignored an X-Request-Id") and repr(bad[:128]) in m
               for m in caplog.messages)
    assert "status=200" in log_line(caplog, fresh)


def test_errors_carry_the_id(server, caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger=LOGGER)
    base, state = server

    def post(rid: str, body=None, headers=KEY, path="/v1/chat/completions", **kw) -> httpx.Response:
        r = httpx.post(f"{base}{path}", json=body, headers={**headers, "X-Request-Id": rid}, timeout=60, **kw)
        assert r.headers["x-request-id"] == rid and "error" in r.json(), r.text
        return r

    assert post("e-401", chat(), headers={}).status_code == 401
    assert post("e-400", {"messages": []}).status_code == 400
    assert post("e-404", chat(model="gpt-9")).status_code == 404
    assert post("e-route", chat(), path="/v1/nowhere").status_code == 404
    assert post("e-413", chat(messages=[{"role": "user", "content": "y" * 20000}])).status_code == 413
    seats = state.client.reserve(4)  # the queue, full: the next request is refused before it is tokenized
    try:
        r = post("e-429", chat())
        assert r.status_code == 429 and r.headers["retry-after"]
    finally:
        seats.release()
    assert "status=429 prompt_tokens=- completion_tokens=-" in log_line(caplog, "e-429")
    assert "status=401" in log_line(caplog, "e-401") and "status=413" in log_line(caplog, "e-413")

    def broken():
        raise RuntimeError("a bug")

    monkeypatch.setattr(state, "ready_client", broken)  # /v1/models calls it per request: an unhandled error
    r = httpx.get(f"{base}/v1/models", headers={**KEY, "X-Request-Id": "e-500"}, timeout=60)
    assert r.status_code == 500 and r.headers["x-request-id"] == "e-500"


async def open_stream(c: httpx.AsyncClient, base: str, path: str, body: dict, rid: str | None, events: int = 3):
    """A stream opened and read until `events` data lines came; returns its context, response and line iterator
    (kept referenced: a collected iterator would close the response, which aborts the request)."""
    headers = {**KEY, **({"X-Request-Id": rid} if rid else {})}
    cm = c.stream("POST", f"{base}{path}", json={**body, "stream": True}, headers=headers)
    r = await cm.__aenter__()
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    lines = r.aiter_lines()
    seen = 0
    async for line in lines:
        seen += line.startswith("data: ")
        if seen == events:
            break
    return cm, r, lines


async def rest(lines) -> list[str]:
    return [line async for line in lines if line.startswith("data: ")]


def test_streams_carry_the_id_and_the_engine_view_shows_it_and_the_same_id_twice_does_not_clash(server, caplog):
    """Two requests with one X-Request-Id at once (n = 2 completions, then a chat): their engine ids stay apart,
    the caller sees them in /v1/engine/state, and each response echoes the client's id."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    base, state = server
    # long enough that the first is still running when the second has started
    completion = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 120, "n": 2, "temperature": 0,
                  "ignore_eos": True}

    async def main():
        async with httpx.AsyncClient(timeout=120) as c:
            a = await open_stream(c, base, "/v1/completions", completion, "dup")
            b = await open_stream(c, base, "/v1/chat/completions", chat(60), "dup")
            try:
                view = (await c.get(f"{base}/v1/engine/state", headers=KEY)).json()
                return view, a[1].headers["x-request-id"], b[1].headers["x-request-id"], \
                    await rest(a[2]), await rest(b[2])
            finally:
                await b[0].__aexit__(None, None, None)
                await a[0].__aexit__(None, None, None)

    view, id_a, id_b, events_a, events_b = asyncio.run(main())
    assert id_a == id_b == "dup"
    assert sorted(s["request_id"] for s in view["sequences"]) == ["dup-0", "dup-0#2", "dup-1"]
    assert all(s["mine"] for s in view["sequences"])
    assert events_a[-1] == events_b[-1] == "data: [DONE]"  # both ran to their end
    lines = wait_for(lambda: len(m := [x for x in caplog.messages if x.startswith("request_id=dup ")]) == 2 and m,
                     "two log lines for dup")
    assert sorted(x.split()[2] for x in lines) == ["/v1/chat/completions", "/v1/completions"]
    assert all("completion_tokens=" in x for x in lines)
    assert {x.split("finish_reason=")[1].split()[0] for x in lines} == {"length,length", "length"}
    wait_for(lambda: state.client.num_running == state.client.num_waiting == 0, "idle")


# ---- OpenTelemetry spans -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def traced(make_engine):
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from pagedserve.server.otel import Tracing

    exporter = InMemorySpanExporter()
    engine = make_engine(num_blocks=96, max_num_seqs=8, max_step_ms=0)
    with running_server(engine, tracing=Tracing(exporter=exporter)) as (base, _):
        yield base, exporter


PHASES = ("queued", "prefill", "decode")


def spans_of(exporter, request_id: str):
    """The request's span (exactly one) and its phases, once exported."""
    def find():
        spans = exporter.get_finished_spans()
        mine = [s for s in spans if s.attributes.get("gen_ai.request.id") == request_id]
        return mine and (mine, spans)

    mine, spans = wait_for(find, f"no span for {request_id}")
    assert len(mine) == 1, mine
    (span,) = mine
    phases = [s for s in spans if s.parent is not None and s.parent.span_id == span.context.span_id]
    return span, phases


def check_phases(span, phases, choices: int) -> None:
    """Per choice: queued, prefill, decode, one after the other, inside the request's span."""
    from opentelemetry.trace import SpanKind

    assert len(phases) == 3 * choices
    for i in range(choices):
        mine = {p.name: p for p in phases if p.attributes["pagedserve.choice"] == i}
        q, p, d = (mine[name] for name in PHASES)
        assert span.start_time <= q.start_time <= q.end_time <= p.start_time <= p.end_time <= d.start_time \
            <= d.end_time <= span.end_time
        assert {x.context.trace_id for x in (q, p, d)} == {span.context.trace_id}
        assert all(x.kind == SpanKind.INTERNAL for x in (q, p, d))


def test_a_span_per_request_a_child_of_the_callers_trace(traced):
    from opentelemetry.trace import SpanKind, StatusCode

    base, exporter = traced
    trace_id, caller = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    r = httpx.post(f"{base}/v1/chat/completions", json=chat(5),
                   headers={"traceparent": f"00-{trace_id}-{caller}-01", "X-Request-Id": "traced-1"}, timeout=60)
    assert r.status_code == 200
    body = r.json()
    span, phases = spans_of(exporter, "traced-1")
    assert span.name == f"chat {MODEL}" and span.kind == SpanKind.SERVER and span.status.status_code != StatusCode.ERROR
    assert f"{span.context.trace_id:032x}" == trace_id and f"{span.parent.span_id:016x}" == caller
    a, u = span.attributes, body["usage"]
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.response.id"] == body["id"]
    assert a["gen_ai.request.model"] == a["gen_ai.response.model"] == MODEL
    assert a["gen_ai.usage.input_tokens"] == a["gen_ai.usage.prompt_tokens"] == u["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == a["gen_ai.usage.completion_tokens"] == u["completion_tokens"] == 5
    assert a["gen_ai.usage.cache_read.input_tokens"] == u["prompt_tokens_details"]["cached_tokens"]
    assert a["gen_ai.response.finish_reasons"] == ("length",) and a["http.response.status_code"] == 200
    assert 0 <= a["gen_ai.latency.time_in_queue"] <= a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]
    check_phases(span, phases, 1)
    (decode,) = [p for p in phases if p.name == "decode"]
    assert decode.attributes["gen_ai.usage.output_tokens"] == 5
    assert decode.attributes["pagedserve.engine_request_id"] == "traced-1-0"


def test_a_streamed_request_with_choices_is_a_root_span_with_phases_per_choice(traced):
    base, exporter = traced
    body = {"model": MODEL, "prompt": "The sea", "max_tokens": 4, "n": 2, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
        rid = r.headers["x-request-id"]
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    usage = json.loads(events[-2])["usage"]
    span, phases = spans_of(exporter, rid)
    assert span.parent is None and span.name == f"text_completion {MODEL}"
    assert span.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 8
    assert span.attributes["gen_ai.usage.num_sequences"] == 2
    check_phases(span, phases, 2)
    decodes = [p for p in phases if p.name == "decode"]
    assert sum(p.attributes["gen_ai.usage.output_tokens"] for p in decodes) == 8
    assert sorted(p.attributes["pagedserve.engine_request_id"] for p in decodes) == [f"{rid}-0", f"{rid}-1"]


def test_a_refused_request_has_a_span_without_phases_and_other_routes_none(traced):
    base, exporter = traced
    r = httpx.post(f"{base}/v1/chat/completions", json={"messages": []}, headers={"X-Request-Id": "refused"},
                   timeout=60)
    assert r.status_code == 400
    span, phases = spans_of(exporter, "refused")
    assert span.attributes["http.response.status_code"] == 400 and phases == []
    assert "gen_ai.usage.input_tokens" not in span.attributes
    assert httpx.get(f"{base}/health", headers={"X-Request-Id": "health-check"}).status_code == 200
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, headers={"X-Request-Id": "after"})
    spans_of(exporter, "after")  # a span the health check had made would have ended before this one
    assert not [s for s in exporter.get_finished_spans() if s.attributes.get("gen_ai.request.id") == "health-check"]
