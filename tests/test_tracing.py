"""Request ids: X-Request-Id through a real server (echoed, sanitized, generated, on errors and streams, in the log
line and /v1/engine/state), and ids that must not clash in the engine."""

from __future__ import annotations

import asyncio
import logging
import re
import time

import httpx
import pytest
from test_server import MODEL, running_server

from pagedserve.engine.async_engine import AdmissionLimits, AsyncEngine
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.server.tracing import safe_id

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
def test_safe_ids():
    assert safe_id(b"lb.7f3a_01:x-9") == "lb.7f3a_01:x-9" and safe_id(b"a" * 128) == "a" * 128
    for bad in (None, b"", b"a" * 129, b"has space", b"<script>", b"caf\xc3\xa9", b"a\r\nb", b"x#2"):
        assert safe_id(bad) is None, bad


def test_an_id_the_engine_still_holds_is_suffixed(make_engine):
    """A client's retry can arrive before its first attempt's abort reached the engine: the retry runs under a
    suffixed id instead of being refused as a duplicate. The engine thread is not started: this test steps it."""
    engine = make_engine(num_blocks=32, max_num_seqs=4, max_step_ms=0)
    aeng = AsyncEngine(engine)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)

    async def main():
        def submit():
            aeng.reserve()
            return aeng.submit("retry-0", [1, 2, 3, 4], params)

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
    for _ in range(4):  # the queue, full: the next request is refused before it is tokenized
        state.engine.reserve()
    try:
        r = post("e-429", chat())
        assert r.status_code == 429 and r.headers["retry-after"]
    finally:
        for _ in range(4):
            state.engine.release()
    assert "status=429 prompt_tokens=- completion_tokens=-" in log_line(caplog, "e-429")
    assert "status=401" in log_line(caplog, "e-401") and "status=413" in log_line(caplog, "e-413")

    def broken():
        raise RuntimeError("a bug")

    monkeypatch.setattr(state, "ready_engine", broken)  # /v1/models calls it per request: an unhandled error
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
    wait_for(lambda: state.engine.num_running == state.engine.num_waiting == 0, "idle")

