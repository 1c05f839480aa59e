"""The page in a real browser: headless Chromium (Debian's package) driven by Playwright, against a real uvicorn on
127.0.0.1 serving the bundled model. The browser tier: `pytest -m browser` (.ci/run installs chromium if missing).

Order and counts are asserted, never wall time. Screenshots go to results/screenshots/ (gitignored).
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_server import MODEL, REPO, running_server

pytestmark = pytest.mark.browser

CHROMIUM = os.environ.get("PAGEDSERVE_CHROMIUM", "/usr/bin/chromium")
SHOTS = Path(REPO) / "results" / "screenshots"
XSS = "<img src=x onerror=window.__pwned=1>"
SYSTEM = ("You are the assistant of a small library. Answer questions about opening hours, loans and the reading "
          "room politely and briefly. ") * 3  # several full KV blocks, the same for every request


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright  # the browser extra: only this tier needs it

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                              args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        yield b
        b.close()


@pytest.fixture(scope="module")
def server(make_engine):
    engine = make_engine(num_blocks=256, max_num_seqs=16, max_step_ms=0)
    with running_server(engine) as (base, state):
        yield base, engine


@pytest.fixture()
def page(browser):
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    p = context.new_page()
    errors: list[str] = []
    p.on("pageerror", lambda e: errors.append(str(e)))
    p.on("console", lambda m: errors.append(m.text) if m.type == "error" and "401" not in m.text else None)
    yield p
    context.close()
    assert errors == [], errors  # no script error, no CSP violation


def state(base: str, key: str | None = None) -> dict:
    r = httpx.get(f"{base}/v1/engine/state", headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=30)
    assert r.status_code == 200
    return r.json()


def wait_idle(base: str, engine) -> dict:
    deadline = time.monotonic() + 60
    while True:
        s = state(base)
        if s["running"] == s["waiting"] == 0 and s["kv"]["used"] == s["kv"]["shared"] == 0:
            engine.block_manager.check_integrity([])
            return s
        assert time.monotonic() < deadline, s
        time.sleep(0.05)


def aborted(base: str) -> float:
    return sum(x.value for f in text_string_to_metric_families(httpx.get(f"{base}/metrics").text)
               if f.name == "vllm:request_success" for x in f.samples
               if x.name.endswith("_total") and x.labels.get("finished_reason") == "abort")


def settings(page, **values) -> None:
    for name, value in values.items():
        field = page.locator(f"#set-{name}")
        if isinstance(value, bool):
            field.set_checked(value)
        else:
            field.fill(str(value))
        field.dispatch_event("change")


def record_states(page) -> None:
    """Log every (data-state, characters) the last reply goes through, in order, as the page sets them."""
    page.evaluate("""() => {
        window.__log = [];
        new MutationObserver(() => {
            const m = document.querySelector('#messages article.assistant:last-of-type');
            if (m) window.__log.push([m.dataset.state, Number(m.dataset.chars)]);
        }).observe(document.getElementById('messages'), {subtree: true, childList: true, attributes: true,
                                                         attributeFilter: ['data-state', 'data-chars']});
    }""")


def send(page, text: str) -> None:
    page.fill("#prompt", text)
    page.click("#send")


def stored(page) -> list[dict]:
    return json.loads(page.evaluate("localStorage.getItem('pagedserve.chat')"))


def test_chat_streams_tokens_then_completes_with_stats(server, page):
    base, engine = server
    loaded = []  # the page's own files (not the API's answers)
    page.on("response", lambda r: loaded.append(r) if "/v1/" not in r.url else None)
    page.goto(f"{base}/")
    page.wait_for_load_state("load")
    nav = page.evaluate("JSON.stringify(performance.getEntriesByType('navigation')[0])")
    sizes = {r.url: len(r.body()) for r in loaded}  # before any navigation drops the bodies
    settings(page, temperature=0, max_tokens=64, ignore_eos=True)  # many chunks, even on a starved renderer
    record_states(page)
    question = "Name three colours of the rainbow."
    send(page, question)
    page.wait_for_selector("#messages article.assistant[data-state=done]", timeout=120_000)
    log = page.evaluate("window.__log")
    done = next(i for i, (s, _) in enumerate(log) if s == "done")
    streaming = [n for s, n in log[:done] if s == "streaming" and n > 0]
    assert len(set(streaming)) >= 2, log  # text grew in several steps before the reply ended
    assert streaming == sorted(streaming) and log[done][1] >= streaming[-1]
    stats = page.inner_text("#messages article.assistant .stats")
    assert re.fullmatch(r"64 tokens · TTFT \d+ ms · [\d.]+ tok/s · \d+ cached prompt tokens · length", stats), stats
    convo = stored(page)
    assert [m["role"] for m in convo] == ["user", "assistant"] and convo[0]["content"] == question
    # the same request without streaming gives the same text (greedy)
    same = httpx.post(f"{base}/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": [{"role": "user", "content": question}], "max_tokens": 64, "temperature": 0,
        "ignore_eos": True}).json()
    assert convo[1]["content"] == same["choices"][0]["message"]["content"] and convo[1]["stats"]["tokens"] == 64
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / "chat.png"))
    page.reload()  # the conversation lives in localStorage
    page.wait_for_selector("#messages article.assistant[data-state=done]")
    assert page.locator("#messages article").count() == 2
    page.click("#new-chat")
    assert page.locator("#messages article").count() == 0 and stored(page) == []
    weight = sum(sizes.values())
    (SHOTS / "page_load.json").write_text(json.dumps({"bytes": weight, "files": len(sizes),
                                                      "navigation": json.loads(nav)}, indent=1))
    assert weight < 200_000 and len(sizes) >= 7, sizes  # html, css, favicon, 5 modules
    wait_idle(base, engine)


def test_stop_mid_reply_frees_the_request_on_the_server(server, page):
    base, engine = server
    before = aborted(base)
    page.goto(f"{base}/")
    settings(page, temperature=0.8, max_tokens=2000, ignore_eos=True)
    send(page, "Write a very long story about a lighthouse keeper.")
    page.wait_for_function("() => { const m = document.querySelector('#messages article.assistant');"
                           " return m && m.dataset.state === 'streaming' && Number(m.dataset.chars) > 20; }",
                           timeout=120_000)
    running = state(base)
    assert running["running"] == 1 and running["kv"]["used"] > 0
    page.click("#stop")
    page.wait_for_selector("#messages article.assistant[data-state=stopped]")
    idle = wait_idle(base, engine)
    assert idle["running"] == 0 and idle["sequences"] == []
    assert aborted(base) == before + 1
    assert "stopped" in page.inner_text("#messages article.assistant .stats")
    assert not page.is_disabled("#send") and page.is_disabled("#stop")


def test_dashboard_shows_running_and_shared_blocks_for_8_requests(server, page):
    base, engine = server
    page.goto(f"{base}/dashboard")
    page.wait_for_function("() => document.body.dataset.polls >= 1")
    assert page.inner_text("#st-running") == "0"
    first_chunk, stop = threading.Event(), threading.Event()
    chunks = [0] * 8

    def client(i: int) -> None:
        body = {"model": MODEL, "stream": True, "max_tokens": 400, "ignore_eos": True, "temperature": 0.8,
                "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Question {i}?"}]}
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and '"content":"' in line:
                    chunks[i] += 1
                    first_chunk.set()
                if stop.is_set():
                    return  # hang up: the server aborts the rest

    threads = [threading.Thread(target=client, args=(0,))]
    threads[0].start()
    assert first_chunk.wait(120)  # the first has published the system prompt's blocks: the others hit them
    threads += [threading.Thread(target=client, args=(i,)) for i in range(1, 8)]
    for t in threads[1:]:
        t.start()
    try:
        page.wait_for_function("() => Number(document.getElementById('st-running').textContent) >= 2 && "
                               "Number(document.getElementById('st-shared').textContent) > 0", timeout=120_000)
        running = int(page.inner_text("#st-running"))
        assert 2 <= running <= 8 and page.locator("#seqs tbody tr").count() >= running
        assert int(page.inner_text("#st-shared")) > 0 and page.inner_text("#st-hits").endswith("%")
        # hover a shared block: the tooltip names the sequences holding it and their block tables
        s = state(base)
        shared = s["kv"]["pool"].index("s")
        box = page.locator("#pool").bounding_box()
        cell, cols = (int(page.get_attribute("#pool", a)) for a in ("data-cell", "data-cols"))
        page.mouse.move(box["x"] + (shared % cols) * cell + cell / 2, box["y"] + (shared // cols) * cell + cell / 2)
        tip = page.inner_text("#tip")
        assert tip.startswith(f"block {shared}: shared") and tip.count("seq ") >= 2
        SHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SHOTS / "dashboard.png"), full_page=True)
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    assert all(chunks)
    wait_idle(base, engine)
    page.wait_for_function("() => document.getElementById('st-running').textContent === '0' && "
                           "document.getElementById('st-shared').textContent === '0'")


def test_markup_in_a_model_reply_renders_as_text(server, page):
    """The bundled model writes the markup itself: a JSON schema constrains its reply to contain it."""
    base, engine = server
    page.goto(f"{base}/")
    page.evaluate("localStorage.clear()")
    page.reload()
    schema = {"type": "object", "properties": {"html": {"const": XSS}}, "required": ["html"]}
    settings(page, temperature=0, max_tokens=64, ignore_eos=False, json=True, schema=json.dumps(schema))
    send(page, "Reply with an image tag.")
    page.wait_for_selector("#messages article.assistant[data-state=done]", timeout=120_000)
    reply = stored(page)[1]["content"]
    assert XSS in reply and json.loads(reply) == {"html": XSS}  # the model's own output carries the markup
    body = page.locator("#messages article.assistant .body")
    assert XSS in body.inner_text()
    assert page.locator("#messages img").count() == 0 and page.evaluate("window.__pwned") is None
    page.reload()  # rendered again from localStorage: still text
    page.wait_for_selector("#messages article.assistant[data-state=done]")
    assert XSS in page.inner_text("#messages article.assistant .body")
    assert page.locator("#messages img").count() == 0 and page.evaluate("window.__pwned") is None
    wait_idle(base, engine)


def test_with_an_api_key_the_page_gets_no_data_until_given_the_key(make_engine, browser):
    engine = make_engine(num_blocks=64, max_num_seqs=4, max_step_ms=0)
    with running_server(engine, api_key="sesame-key") as (base, _):
        context = browser.new_context()
        page = context.new_page()
        seen: list[tuple[str, int]] = []
        page.on("response", lambda r: seen.append((r.url.removeprefix(base), r.status)) if "/v1/" in r.url else None)

        def answered(action) -> list[tuple[str, int]]:
            """The two calls `action` makes the page send (model, engine state), once both are answered."""
            start = len(seen)
            action()
            for _ in range(200):
                if len(seen) >= start + 2:
                    break
                page.wait_for_timeout(50)
            return sorted(seen[start : start + 2])

        first = answered(lambda: page.goto(f"{base}/dashboard"))
        page.wait_for_selector("#key-dialog[open]")
        page.wait_for_function("() => !document.getElementById('engine-error').hidden")
        assert first == [("/v1/engine/state", 401), ("/v1/models", 401)], first
        assert page.inner_text("#st-running") == "—" and page.inner_text("#model") == ""
        assert "API key" in page.inner_text("#engine-error") and page.locator("#seqs tbody tr").count() == 0
        page.fill("#key-input", "wrong")
        assert answered(lambda: page.click("#key-save")) == [("/v1/engine/state", 401), ("/v1/models", 401)]
        page.wait_for_selector("#key-dialog[open]")  # refused: asked again
        assert page.inner_text("#st-running") == "—"
        page.fill("#key-input", "sesame-key")
        assert answered(lambda: page.click("#key-save")) == [("/v1/engine/state", 200), ("/v1/models", 200)]
        page.wait_for_function("() => document.getElementById('st-running').textContent === '0'")
        page.wait_for_function("() => document.getElementById('model').textContent !== ''")
        assert page.inner_text("#model").startswith(MODEL) and not page.locator("#key-dialog[open]").count()
        assert page.evaluate("sessionStorage.getItem('pagedserve.key')") == "sesame-key"
        assert "sesame-key" not in page.evaluate("JSON.stringify(localStorage)")
        context.close()
