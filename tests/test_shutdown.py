"""The graceful stop (server/shutdown.py) on a real `pagedserve serve` process: SIGTERM drains, a second signal
stops at once."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager

import httpx
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# more than a decode can make before the drain's timeout on any machine: these streams are always cut
ENDLESS = 4000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve_process(*flags: str):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pagedserve.server", "serve", "--port", str(port),
                             "--log-level", "warning", *flags], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"{base}/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "never ready"
            time.sleep(0.1)
        yield proc, base
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def _stream(client: httpx.AsyncClient, base: str, max_tokens: int, started: asyncio.Event) -> dict:
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    events, tokens = [], 0
    async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                started.set()
    chunks = [json.loads(e) for e in events[:-1]]
    tokens = sum(1 for c in chunks if "choices" in c and c["choices"])
    errors = [c["error"] for c in chunks if "error" in c]
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices") and c["choices"][0]["finish_reason"]]
    return {"last": events[-1] if events else None, "errors": errors, "finish": finish, "tokens": tokens}


def test_sigterm_drains_then_ends_what_still_runs_with_an_error_and_done():
    """8 streams and 2 plain requests run; SIGTERM: /ready turns 503 while /health stays 200, a new request gets
    503 with Retry-After in OpenAI's shape, the short requests finish in full, the endless ones end with an error
    event (streams) or a 503 (plain) at --shutdown-timeout-s, every stream ends with [DONE], and the exit code is 0."""
    with serve_process("--max-num-seqs", "16", "--shutdown-timeout-s", "5") as (proc, base):
        async def scenario():
            async with httpx.AsyncClient(timeout=120) as client:
                started = [asyncio.Event() for _ in range(8)]
                streams = [asyncio.create_task(_stream(client, base, 24 if i < 4 else ENDLESS, started[i]))
                           for i in range(8)]
                plain = [asyncio.create_task(client.post(f"{base}/v1/completions", json={
                    "prompt": "Hello", "max_tokens": n, "ignore_eos": True})) for n in (8, ENDLESS)]
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started[4:])), 120)
                proc.send_signal(signal.SIGTERM)
                # the drain: not ready, still alive, new requests refused in OpenAI's shape with Retry-After
                for _ in range(100):
                    if (await client.get(f"{base}/ready")).status_code == 503:
                        break
                    await asyncio.sleep(0.02)
                ready = await client.get(f"{base}/ready")
                assert ready.status_code == 503 and ready.json()["error"]["code"] == "server_shutting_down"
                assert (await client.get(f"{base}/health")).status_code == 200
                refused = await client.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
                assert refused.status_code == 503 and int(refused.headers["Retry-After"]) >= 1
                assert refused.json()["error"]["code"] == "server_shutting_down"
                return await asyncio.gather(*streams), await asyncio.gather(*plain)

        results, (short, long_) = asyncio.run(scenario())
        assert proc.wait(timeout=60) == 0
    for i, r in enumerate(results):
        assert r["last"] == "[DONE]", r
        if i < 4:  # finished within the drain
            assert r["errors"] == [] and r["finish"] == ["length"] and r["tokens"] == 24, r
        else:  # cut at the timeout: an error event naming the shutdown, then [DONE]
            assert [e["code"] for e in r["errors"]] == ["server_shutting_down"] and r["finish"] == [], r
            assert 0 < r["tokens"] < ENDLESS
    assert short.status_code == 200 and short.json()["usage"]["completion_tokens"] == 8
    assert long_.status_code == 503 and long_.json()["error"]["code"] == "server_shutting_down"


def test_a_second_signal_stops_at_once():
    """While a drain waits on an endless stream, a second SIGINT ends the process without waiting out the drain."""
    with serve_process("--shutdown-timeout-s", "600") as (proc, base):
        body = {"prompt": "Once upon a time", "max_tokens": ENDLESS, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGINT)
            for _ in range(200):  # the first signal has been taken once readiness drops
                if httpx.get(f"{base}/ready", timeout=5).status_code == 503:
                    break
                time.sleep(0.02)
            proc.send_signal(signal.SIGINT)
            # the process ends long before the 600 s drain would have: the stream is cut, not completed
            with pytest.raises(httpx.HTTPError):
                for _ in lines:
                    pass
        assert proc.wait(timeout=60) != 0
