"""Connection floods and queue waits against a real server on 127.0.0.1: silent and slow-header sockets cannot lock
users out, every refusal is OpenAI's JSON, and a request the server cannot start in time gets 429 + Retry-After
(which a retrying client can follow to success) instead of silence."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time

import httpx
import pytest
from test_server import MODEL, running_server

from pagedserve.engine.async_engine import AdmissionLimits


def _response(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (the socket's timeout fails a hang). A reset
    after the reply ends it too: the kernel answers bytes a client sends after the close (a trickler's next
    header byte) with one, and the reply read before it stays read."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def _json_error(reply: bytes, status: int) -> dict:
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status} ".encode()), head[:80]
    assert b"content-type: application/json" in head.lower() and b"retry-after: " in head.lower()
    return json.loads(body)["error"]


@pytest.mark.slow  # load, flood or fuzz: the heavy tier
def test_idle_and_slow_header_sockets_do_not_lock_users_out(make_engine):
    engine = make_engine(num_blocks=128, max_step_ms=0)
    with running_server(engine, header_timeout_s=3.0, max_connections=1024) as (base, _):
        host, port = base.removeprefix("http://").split(":")
        idle = [socket.create_connection((host, int(port)), timeout=60) for _ in range(1100)]
        slow = [socket.create_connection((host, int(port)), timeout=60) for _ in range(50)]
        stop = threading.Event()

        def trickle():  # one header byte per socket per second: a request that never completes
            for s in slow:
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
            while not stop.wait(1.0):
                for s in slow:
                    try:
                        s.sendall(b"X")
                    except OSError:
                        pass

        threading.Thread(target=trickle, daemon=True).start()
        try:
            # a new client, while all 1,150 sockets are open: served (the idle ones longest open make room)
            assert httpx.get(f"{base}/health", timeout=30).status_code == 200
            r = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
                "model": MODEL, "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 4})
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
            # every attack socket is closed by the server (a hang would raise the socket's timeout); what the
            # slow ones receive is a 408 in OpenAI's shape; the silent ones get no response, only the close
            assert all(_response(s) == b"" for s in idle)
            replies = [_response(s) for s in slow]
            assert sum(1 for rep in replies if rep) >= 1
            for rep in filter(None, replies):
                assert _json_error(rep, 408)["code"] == "request_timeout"
        finally:
            stop.set()
            for s in idle + slow:
                s.close()
        assert httpx.get(f"{base}/health", timeout=30).status_code == 200


def test_a_full_server_refuses_in_json_and_recovers(make_engine):
    """At the cap with every connection busy, a new one gets a 503 in OpenAI's shape with Retry-After."""
    engine = make_engine(num_blocks=128, max_step_ms=0)
    with running_server(engine, max_connections=2) as (base, state):
        host, port = base.removeprefix("http://").split(":")
        body = json.dumps({"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "stream": True})
        busy = []
        for _ in range(2):
            s = socket.create_connection((host, int(port)), timeout=60)
            s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
            assert s.recv(15).startswith(b"HTTP/1.1 200")  # streaming: busy until the end
            busy.append(s)
        refused = socket.create_connection((host, int(port)), timeout=60)
        assert _json_error(_response(refused), 503)["code"] == "too_many_connections"
        refused.close()
        for s in busy:
            s.close()  # the streams are aborted; the connections go away
        for _ in range(100):
            try:
                if httpx.get(f"{base}/ready", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        else:
            pytest.fail("the server did not take connections again")


def _health(sock: socket.socket) -> bytes:
    """GET /health on a keep-alive connection: the status line, or b"" if the server had closed it."""
    reply = b""
    try:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        while b"\r\n\r\n" not in reply:
            if not (chunk := sock.recv(65536)):
                return b""
            reply += chunk
    except (BrokenPipeError, ConnectionResetError):
        return b""
    head, _, body = reply.partition(b"\r\n\r\n")
    length = int(re.search(rb"content-length: (\d+)", head.lower()).group(1))
    while len(body) < length:
        body += sock.recv(65536)
    return head.split(b"\r\n")[0]


def test_at_the_cap_the_connection_idle_longest_gives_way(make_engine):
    """Three idle keep-alive connections, idle since their responses in this order, and the cap is three: a fourth
    closes the one idle longest, not a newer one, and everyone else is still served."""
    engine = make_engine(num_blocks=16, max_step_ms=0)  # no idle connection expires on its own meanwhile:
    with running_server(engine, max_connections=3, keep_alive_timeout_s=300, header_timeout_s=300) as (base, _):
        host, port = base.removeprefix("http://").split(":")
        idle = []
        for _ in range(3):  # each idle from the end of its own response: oldest first
            s = socket.create_connection((host, int(port)), timeout=30)
            assert _health(s) == b"HTTP/1.1 200 OK"
            idle.append(s)
        newcomer = socket.create_connection((host, int(port)), timeout=30)
        try:
            assert _health(newcomer) == b"HTTP/1.1 200 OK"  # it made room when it arrived
            # the oldest was closed (a request on it gets nothing), the newer ones were kept
            assert [_health(s) for s in idle] == [b"", b"HTTP/1.1 200 OK", b"HTTP/1.1 200 OK"]
        finally:
            for s in [*idle, newcomer]:
                s.close()


@pytest.mark.slow  # load, flood or fuzz: the heavy tier
def test_requests_that_cannot_start_in_time_get_429_and_retries_succeed(make_engine):
    """One sequence at a time and slowed steps: most of a burst cannot start within max_queue_wait_s. Each of
    those gets 429 + Retry-After (at admission once the start rate is measured, else when the bound passes);
    following Retry-After, every client gets its answer. No request ends any other way."""
    engine = make_engine(num_blocks=128, max_num_seqs=1, max_step_ms=0)
    real_run = engine.runner.run

    def slow_run(step):
        time.sleep(0.05)  # makes the queue's drain slow enough to wait on
        return real_run(step)

    engine.runner.run = slow_run
    limits = AdmissionLimits(max_queue_wait_s=1.0)
    with running_server(engine, limits) as (base, state):
        async def client(c: httpx.AsyncClient, i: int) -> list[tuple[int, float | None]]:
            attempts = []
            for _ in range(40):
                r = await c.post(f"{base}/v1/completions", json={"prompt": f"Request {i}:", "max_tokens": 8,
                                                                  "ignore_eos": True, "stream": i % 2 == 0})
                if r.status_code == 429:
                    err = r.json()["error"]
                    assert err["type"] == "rate_limit_error" and err["code"] == "server_overloaded"
                    retry = float(r.headers["retry-after"])
                    assert 1 <= retry <= 60 and r.headers["retry-after-ms"] == str(int(retry * 1000))
                    attempts.append((429, retry))
                    await asyncio.sleep(retry)
                    continue
                assert r.status_code == 200, r.text
                if i % 2 == 0:
                    assert r.text.rstrip().endswith("data: [DONE]")
                attempts.append((200, None))
                return attempts
            pytest.fail(f"client {i} never got through")

        async def main():
            async with httpx.AsyncClient(timeout=120) as c:
                return await asyncio.gather(*(client(c, i) for i in range(6)))

        results = asyncio.run(main())
        assert all(a[-1][0] == 200 for a in results)  # everyone got an answer in the end
        refusals = sum(code == 429 for a in results for code, _ in a)
        assert refusals >= 1
        metrics = httpx.get(f"{base}/metrics").text
        counted = sum(float(v) for v in re.findall(
            r'pagedserve:rejected_requests_total\{[^}]*reason="queue_wait"[^}]*\} ([0-9.e+]+)', metrics))
        assert counted == refusals  # every 429 here was a queue-wait refusal, and each was counted
        assert state.client.num_waiting == 0 and state.client.engine.block_manager.num_used_blocks == 0
