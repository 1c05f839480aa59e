"""GET /v1/engine/state over real HTTP (uvicorn on 127.0.0.1, the bundled model), and the page's files being served.

The browser itself is tested in tests/test_web.py (`pytest -m browser`).
"""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import httpx
import pytest
from test_server import MODEL, running_server

WEB = Path(__file__).resolve().parent.parent / "server" / "web"
SECRET = "zebra quokka marmalade"  # prompt text that must never appear in the state


def state(base: str, key: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.get(f"{base}/v1/engine/state", headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    assert SECRET not in r.text and "quokka" not in r.text
    return r.json()


def wait_idle(base: str, key: str | None = None) -> dict:
    deadline = time.monotonic() + 60
    while True:
        s = state(base, key)
        if s["running"] == s["waiting"] == 0 and s["kv"]["used"] == s["kv"]["shared"] == 0:
            return s
        assert time.monotonic() < deadline, s
        time.sleep(0.05)


def body(max_tokens: int = 200, system: str | None = None) -> dict:
    messages = [{"role": "system", "content": system}] if system else []
    return {"model": MODEL, "stream": True, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "messages": messages + [{"role": "user", "content": f"Tell me about the {SECRET}."}]}


async def first_chunks(c: httpx.AsyncClient, base: str, payload: dict, n: int, headers=None):
    """Open a stream and read until `n` content chunks came; returns the open response's context and its line
    iterator (kept referenced: a collected iterator would close the response, which aborts the request)."""
    cm = c.stream("POST", f"{base}/v1/chat/completions", json=payload, headers=headers or {})
    r = await cm.__aenter__()
    assert r.status_code == 200
    lines = r.aiter_lines()
    seen = 0
    async for line in lines:
        if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
            seen += 1
            if seen == n:
                break
    return cm, lines


@pytest.fixture(scope="module")
def server(make_engine):
    engine = make_engine(num_blocks=96, max_num_seqs=8, max_step_ms=0)
    with running_server(engine) as (base, st):
        yield base, engine


def test_state_while_a_request_runs_then_frees(server):
    base, engine = server
    idle = state(base)
    assert idle["object"] == "engine.state" and idle["model"] == MODEL
    assert idle["running"] == 0 and len(idle["kv"]["pool"]) == idle["kv"]["num_blocks"] == 96

    async def main():
        async with httpx.AsyncClient(timeout=120) as c:
            cm, _lines = await first_chunks(c, base, body(), 3)
            try:
                return await asyncio.to_thread(state, base)
            finally:
                await cm.__aexit__(None, None, None)  # hang up mid-reply: the server aborts the request

    s = asyncio.run(main())
    assert s["running"] == 1 and s["waiting"] == 0
    (seq,) = s["sequences"]
    assert seq["mine"] and seq["request_id"].startswith("req-") and seq["status"] == "running"
    assert seq["output_tokens"] >= 3 and seq["computed_tokens"] >= seq["prompt_tokens"]
    blocks = seq["blocks"]
    assert len(blocks) == -(-seq["computed_tokens"] // 16)  # between steps: exactly the computed tokens' blocks
    pool = s["kv"]["pool"]
    assert all(pool[b] == "u" for b in blocks) and pool.count("u") == len(blocks) == s["kv"]["used"]
    assert s["kv"]["shared"] == 0 and s["kv"]["usage"] == pytest.approx(len(blocks) / 96)
    step = s["step"]
    assert step["decode_tokens"] == 1 and step["prefill_tokens"] == 0 and step["num_seqs"] == 1
    assert step["budget_tokens"] == engine.config.scheduler.max_num_batched_tokens and step["index"] >= 4
    after = wait_idle(base)
    assert after["sequences"] == [] and after["kv"]["cached"] >= seq["prompt_tokens"] // 16  # prefix kept
    assert after["ttft_ms"]["count"] >= 1 and after["ttft_ms"]["p50"] > 0
    engine.block_manager.check_integrity([])


def test_common_prefix_shows_shared_blocks(server):
    base, engine = server
    system = "You are a careful assistant. " * 12  # several full blocks, the same for both requests

    async def main():
        async with httpx.AsyncClient(timeout=120) as c:
            (first, _a) = await first_chunks(c, base, body(system=system), 2)
            (second, _b) = await first_chunks(c, base, body(system=system), 2)  # admitted after the first published
            try:
                return await asyncio.to_thread(state, base)
            finally:
                await second.__aexit__(None, None, None)
                await first.__aexit__(None, None, None)

    s = asyncio.run(main())
    assert s["running"] == 2
    a, b = s["sequences"]
    common = [x for x, y in zip(a["blocks"], b["blocks"]) if x == y]
    assert len(common) >= 5 and b["cached_tokens"] == 16 * len(common)
    assert s["kv"]["shared"] == len(common) and all(s["kv"]["pool"][x] == "s" for x in common)
    assert s["prefix_cache"]["hits"] >= b["cached_tokens"] and 0 < s["prefix_cache"]["hit_rate"] < 1
    wait_idle(base)
    engine.block_manager.check_integrity([])


def test_state_needs_a_key_and_shows_each_key_its_own_ids(make_engine):
    engine = make_engine(num_blocks=64, max_num_seqs=4, max_step_ms=0)
    with running_server(engine, api_key="key-a,key-b") as (base, _):
        assert httpx.get(f"{base}/v1/engine/state").status_code == 401
        assert httpx.get(f"{base}/v1/engine/state", headers={"Authorization": "Bearer nope"}).status_code == 401

        async def main():
            async with httpx.AsyncClient(timeout=120) as c:
                cm, _lines = await first_chunks(c, base, body(), 2, headers={"Authorization": "Bearer key-a"})
                try:
                    return await asyncio.to_thread(state, base, "key-a"), await asyncio.to_thread(state, base, "key-b")
                finally:
                    await cm.__aexit__(None, None, None)

        mine, theirs = asyncio.run(main())
        assert mine["running"] == theirs["running"] == 1
        assert mine["sequences"][0]["mine"] and mine["sequences"][0]["request_id"].startswith("req-")
        other = theirs["sequences"][0]
        assert not other["mine"] and other["request_id"] is None and "req-" not in str(theirs)
        # the pool is one memory: its ids are not private. The second view was taken a step or more later, so the
        # stream may have taken a block since: the first view's table is a prefix of the second's
        first = mine["sequences"][0]["blocks"]
        assert other["blocks"][:len(first)] == first and len(other["blocks"]) <= len(first) + 1
        wait_idle(base, "key-a")
        # the page itself is public (it holds no data) and asks for the key
        page = httpx.get(f"{base}/dashboard")
        assert page.status_code == 200 and 'id="key-dialog"' in page.text


def test_page_and_assets_are_served_from_the_package(server):
    base, _ = server
    page = httpx.get(f"{base}/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp and "connect-src 'self'" in csp
    assert httpx.get(f"{base}/dashboard").text == page.text
    todo, fetched = re.findall(r'(?:src|href)="(/web/[^"]+)"', page.text), {}
    while todo:  # the page's assets and, transitively, the modules they import
        a = todo.pop()
        if a not in fetched:
            fetched[a] = httpx.get(f"{base}{a}")
            assert fetched[a].status_code == 200, a
            todo += re.findall(r'from "(/web/[^"]+)"', fetched[a].text) if a.endswith(".js") else []
    assert fetched["/web/app.js"].headers["content-type"].startswith("text/javascript")
    total = len(page.content) + sum(len(r.content) for r in fetched.values())
    assert total < 200_000, f"page weight {total} bytes"
    shipped = sorted(p.name for p in WEB.iterdir() if p.name != "index.html")
    assert sorted(a.removeprefix("/web/") for a in fetched) == shipped  # everything it needs, nothing unused
    for f in WEB.iterdir():  # works offline: nothing fetched from elsewhere
        assert not re.search(r"(?:https?:)?//[a-z0-9.-]+\.[a-z]{2,}", f.read_text().replace("http://www.w3.org", "")), f
