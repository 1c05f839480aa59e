"""The HTTP server for real: uvicorn on 127.0.0.1, the official openai client, curl, raw httpx."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import uvicorn
from conftest import run_to_completion
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.engine.async_engine import AdmissionLimits
from pagedserve.server.app import ServerConfig, create_app, uvicorn_config

MODEL = "smollm2-test"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(engine, limits: AdmissionLimits | None = None, tracing=None, **server_options):
    port = free_port()
    config = ServerConfig(MODEL, limits or AdmissionLimits(), port=port, log_level="warning", **server_options)
    app = create_app(lambda: engine, config, tracing=tracing)
    server = uvicorn.Server(uvicorn_config(app, config))  # the server `pagedserve serve` runs
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(f"{base}/ready", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "server did not become healthy"
        time.sleep(0.05)
    try:
        yield base, app.state.pagedserve
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def server(make_engine):
    engine = make_engine(num_blocks=256, max_num_seqs=16)
    with running_server(engine) as (base, state):
        yield base, state


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="none", max_retries=0, timeout=120)


def test_models_and_health(server):
    base, _ = server
    models = httpx.get(f"{base}/v1/models").json()
    assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == 4096
    assert httpx.get(f"{base}/health").json() == {"status": "ok"}


def test_chat_non_streaming_equals_offline_engine(client, make_engine, smollm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    choice = resp.choices[0]
    assert resp.object == "chat.completion" and choice.message.role == "assistant"
    from pagedserve.engine import SamplingParams
    from pagedserve.engine.tokenizer import apply_chat_template

    engine = make_engine(num_blocks=64)
    engine.add_request("x", apply_chat_template(smollm.tokenizer, messages),
                       SamplingParams(max_tokens=24, temperature=0))
    offline = run_to_completion(engine)["x"]
    assert choice.message.content == offline["text"]
    assert choice.finish_reason == offline["finish_reason"]
    assert resp.usage.completion_tokens == len(offline["tokens"])
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_chat_streaming_with_usage(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count from one to ten."}], max_tokens=12,
        temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    full = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count from one to ten."}],
                                          max_tokens=12, temperature=0)
    assert text == full.choices[0].message.content


def test_completions_stop_string_and_length(client):
    base = client.completions.create(model=MODEL, prompt="1, 2, 3, 4, 5,", max_tokens=12, temperature=0)
    assert base.choices[0].finish_reason == "length"
    text = base.choices[0].text
    stop = text[4:7]
    stopped = client.completions.create(model=MODEL, prompt="1, 2, 3, 4, 5,", max_tokens=12, temperature=0, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[:text.index(stop)]
    streamed = client.completions.create(model=MODEL, prompt="1, 2, 3, 4, 5,", max_tokens=12, temperature=0,
                                         stop=[stop], stream=True)
    pieces = list(streamed)
    assert "".join(p.choices[0].text for p in pieces) == stopped.choices[0].text  # nothing after the stop
    assert pieces[-1].choices[0].finish_reason == "stop"


def test_completions_token_prompt_n_and_logprobs(client):
    resp = client.completions.create(model=MODEL, prompt=[504, 3575, 282], max_tokens=5, temperature=0.8, n=3,
                                     seed=7, logprobs=2)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert resp.usage.prompt_tokens == 3 and resp.usage.completion_tokens == 15
    assert all(len(c.logprobs.tokens) == 5 and len(c.logprobs.top_logprobs[0]) == 2 for c in resp.choices)
    again = client.completions.create(model=MODEL, prompt=[504, 3575, 282], max_tokens=5, temperature=0.8, n=3,
                                      seed=7, logprobs=2)
    assert [c.text for c in again.choices] == [c.text for c in resp.choices]  # seeded: reproducible


def test_chat_logprobs(client):
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = resp.choices[0].logprobs.content
    assert len(content) == 4 and len(content[0].top_logprobs) == 3
    assert content[0].logprob == pytest.approx(content[0].top_logprobs[0].logprob)  # greedy picks the top


def test_curl_example_streams(server):
    base, _ = server
    out = subprocess.run([os.path.join(REPO, "examples", "curl_stream.sh"), "Say hello"], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "BASE_URL": f"{base}/v1", "MAX_TOKENS": "8"})
    assert out.returncode == 0, out.stderr
    events = [line for line in out.stdout.splitlines() if line.startswith("data: ")]
    assert len(events) >= 4 and events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["usage"]["completion_tokens"] <= 8


BAD_INPUTS = [
    ("invalid json", "{not json", 400, None),
    ("wrong type", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"}, 400, "max_tokens"),
    ("missing messages", {"model": MODEL}, 400, "messages"),
    ("empty messages", {"messages": []}, 400, "messages"),
    ("bad role", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ("unknown model", {"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
    ("negative max_tokens", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}, 400, "max_tokens"),
    ("temperature > 2", {"messages": [{"role": "user", "content": "hi"}], "temperature": 2.5}, 400, "temperature"),
    ("five stops", {"messages": [{"role": "user", "content": "hi"}], "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("too long", {"messages": [{"role": "user", "content": "word " * 5000}], "max_tokens": 10}, 400, "messages"),
    ("top_p 0", {"messages": [{"role": "user", "content": "hi"}], "top_p": 0}, 400, "top_p"),
]


@pytest.mark.parametrize("name,body,status,param", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_gets_openai_error(server, name, body, status, param):
    base, _ = server
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, str) else {"json": body}
    r = httpx.post(f"{base}/v1/chat/completions", timeout=60, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    if name == "too long":
        assert err["code"] == "context_length_exceeded" and "4096" in err["message"]
    if name == "unknown model":
        assert err["code"] == "model_not_found"


def test_bad_completion_prompt_and_engine_still_serves(server, client):
    base, state = server
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "", "max_tokens": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    # too long in tokens, short enough in characters: the completions route blames its own field
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "word " * 5000, "max_tokens": 10})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert r.json()["error"]["param"] == "prompt"
    r = httpx.post(f"{base}/v1/completions", json={"prompt": [1, 2, 999999999], "max_tokens": 3})
    assert r.status_code == 400
    ok = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
    assert ok.choices[0].finish_reason == "length"
    assert state.client.num_waiting == 0


def test_metrics_parse_and_move(server, client):
    base, _ = server

    def scrape() -> dict[str, float]:
        text = httpx.get(f"{base}/metrics").text
        values = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name.endswith("_created") or s.name.endswith("_bucket"):
                    continue
                reason = s.labels.get("finished_reason") or s.labels.get("reason")
                key = s.name + (f"[{reason}]" if reason else "")
                values[key] = values.get(key, 0) + s.value
        return values

    before = scrape()
    client.completions.create(model=MODEL, prompt="The sun is", max_tokens=5, temperature=0)
    httpx.post(f"{base}/v1/chat/completions", json={"model": "nope", "messages": [{"role": "user", "content": "x"}]})
    after = scrape()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
                 "vllm:inter_token_latency_seconds_count", "vllm:request_queue_time_seconds_count",
                 "vllm:num_preemptions_total"):
        assert name in after, name
    assert after["vllm:generation_tokens_total"] - before.get("vllm:generation_tokens_total", 0) == 5
    assert after["vllm:prompt_tokens_total"] > before.get("vllm:prompt_tokens_total", 0)
    assert after["vllm:request_success_total[length]"] == before.get("vllm:request_success_total[length]", 0) + 1
    assert after["vllm:time_to_first_token_seconds_count"] == before["vllm:time_to_first_token_seconds_count"] + 1
    assert after["pagedserve:rejected_requests_total[model_not_found]"] == \
        before.get("pagedserve:rejected_requests_total[model_not_found]", 0) + 1


async def _stream(client: httpx.AsyncClient, base: str, max_tokens: int) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}], "stream": True,
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return {"status": r.status_code, "headers": r.headers, "body": r.json()}
        events, finish = [], None
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if line != "data: [DONE]":
                    for c in json.loads(line[6:]).get("choices", []):
                        finish = c.get("finish_reason") or finish
        return {"status": 200, "events": events, "finish": finish}


@pytest.mark.slow  # load, flood or fuzz: the heavy tier
def test_overload_gets_429_with_retry_after(make_engine):
    n = 3
    engine = make_engine(num_blocks=128, max_num_seqs=2)
    with running_server(engine, AdmissionLimits(max_waiting_requests=n)) as (base, state):
        async def burst():
            async with httpx.AsyncClient(timeout=120) as c:
                return await asyncio.gather(*[_stream(c, base, 16) for _ in range(4 * n)])

        results = asyncio.run(burst())
        ok = [r for r in results if r["status"] == 200]
        rejected = [r for r in results if r["status"] == 429]
        assert len(ok) + len(rejected) == 4 * n, [r["status"] for r in results]
        assert ok and rejected
        for r in ok:
            assert r["events"][-1] == "[DONE]" and r["finish"] == "length"
        for r in rejected:
            err = r["body"]["error"]
            assert err["type"] == "rate_limit_error" and err["code"] == "server_overloaded"
            retry = int(r["headers"]["retry-after"])
            assert 1 <= retry <= 60 and int(r["headers"]["retry-after-ms"]) == retry * 1000

        # fill both running slots, then the queue, with long requests; the SDK (no retries) must then see
        # RateLimitError
        async def fill_then_probe():
            async def until(cond) -> None:
                deadline = time.monotonic() + 60
                while not cond():
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.02)

            async with httpx.AsyncClient(timeout=300) as c:
                tasks = [asyncio.create_task(_stream(c, base, 200)) for _ in range(2)]
                await until(lambda: state.client.num_running == 2)
                tasks += [asyncio.create_task(_stream(c, base, 200)) for _ in range(n)]
                await until(lambda: state.client.num_waiting == n)
                sdk = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
                with pytest.raises(openai.RateLimitError):
                    await sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                      max_tokens=2)
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run(fill_then_probe())
        _wait_idle(state)


def test_idle_time_after_abandoned_requests_is_no_queue_drain(make_engine, monkeypatch):
    """A request queued behind another and abandoned before it started, then a long idle spell (a clock jumped
    ahead by 10 minutes, not waited for): the next start is not a gap of the queue's drain, so the measured drain
    rate stays that of real waits, and a 429 for "would start too late" never reaches an idle server."""
    from pagedserve.engine import async_engine
    from pagedserve.engine.async_engine import AsyncEngine
    from pagedserve.engine.sampling_params import SamplingParams

    skipped = [0.0]

    class Clock:  # the module's `time`, ahead of the real one by `skipped`
        def __getattr__(self, name):
            return getattr(time, name)

        @staticmethod
        def monotonic() -> float:
            return time.monotonic() + skipped[0]

    monkeypatch.setattr(async_engine, "time", Clock())
    aeng = AsyncEngine(make_engine(num_blocks=64, max_num_seqs=1), AdmissionLimits(max_queue_wait_s=10))

    async def scenario() -> None:
        aeng.start(asyncio.get_running_loop())

        def submit(rid: str, n: int):
            params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
            return aeng.submit(aeng.input_processor.process(rid, [1, 2, 3, 4], params), aeng.reserve())

        first, abandoned = submit("a", 8), submit("b", 8)
        await first.wait_started()
        assert not abandoned.started
        abandoned.close()  # its client left while it waited
        async for _ in first:
            pass
        skipped[0] += 600
        late = [submit("c", 2), submit("d", 2)]  # d waits behind c: a real drain gap
        for stream in late:
            async for _ in stream:
                pass
            stream.close()
        assert aeng.drain_rate() is not None and aeng.drain_rate() > 1 / 10
        aeng.reserve().release()  # the idle server admits: no "would start in about 300 s"

    try:
        asyncio.run(scenario())
    finally:
        aeng.shutdown()


def _wait_idle(state, timeout: float = 30) -> None:
    engine = state.client.engine
    deadline = time.monotonic() + timeout
    while engine.has_unfinished() or state.client.num_running or engine.block_manager.num_used_blocks:
        assert time.monotonic() < deadline, "requests left behind in the engine"
        time.sleep(0.05)
    engine.block_manager.check_integrity([])


def test_disconnects_abort_and_free_blocks(make_engine):
    engine = make_engine(num_blocks=512, max_num_seqs=32)
    with running_server(engine) as (base, state):
        baseline = engine.block_manager.num_free_blocks
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long essay."}], "stream": True,
                "max_tokens": 400, "ignore_eos": True}

        async def drop_mid_stream(c: httpx.AsyncClient) -> int:
            async with c.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
                seen = 0
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        seen += 1
                        if seen == 3:
                            return seen  # leaving the context closes the connection

        async def time_out(c: httpx.AsyncClient) -> None:
            with pytest.raises(httpx.ReadTimeout):
                await c.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "Once", "max_tokens": 400,
                                                              "ignore_eos": True}, timeout=3.0)

        async def main():
            async with httpx.AsyncClient(timeout=120) as c:
                return await asyncio.gather(*[drop_mid_stream(c) for _ in range(20)], *[time_out(c) for _ in range(5)])

        results = asyncio.run(main())
        assert results[:20] == [3] * 20
        _wait_idle(state)
        assert engine.block_manager.num_free_blocks == baseline
        assert not engine.scheduler.running

        def aborted() -> float:
            families = text_string_to_metric_families(httpx.get(f"{base}/metrics").text)
            return sum(x.value for f in families if f.name == "vllm:request_success" for x in f.samples
                       if x.name.endswith("_total") and x.labels.get("finished_reason") == "abort")

        deadline = time.monotonic() + 30  # the loop counts an abort just after the engine forgets the request
        while aborted() < 25 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert aborted() == 25


def test_a_failed_warm_up_is_a_failed_load(make_engine):
    """The engine built but could not start (its warm-up raised): /health says the load failed and `serve`'s hook
    ends the process, instead of "still loading" for ever."""
    engine = make_engine(num_blocks=64, max_step_ms=0)

    def start(*args):
        raise RuntimeError("warm-up failed")

    app = create_app(lambda: engine, ServerConfig(MODEL, AdmissionLimits()), start=start)
    stopped = threading.Event()
    app.state.pagedserve.on_load_error = stopped.set
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        assert stopped.wait(30)
        r = None
        for _ in range(200):
            with contextlib.suppress(httpx.HTTPError):
                r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            time.sleep(0.05)
        assert r is not None and r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_ready_503_while_loading_health_503_after_engine_death(make_engine):
    """Liveness and readiness apart: while the model loads, /health is 200 (the process is fine: a probe must not
    restart it) and /ready 503; once the engine loop dies, both are 503."""
    gate = threading.Event()
    engine = make_engine(num_blocks=64, max_step_ms=0)  # no step-cost warm-up: healthy as soon as the gate opens

    def slow_factory():
        gate.wait(60)
        return engine

    port = free_port()
    app = create_app(slow_factory, ServerConfig(MODEL, AdmissionLimits()))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            with contextlib.suppress(httpx.HTTPError):
                r = httpx.get(f"{base}/ready", timeout=1)
                break
            time.sleep(0.05)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_loading"
        assert r.headers["Retry-After"] == "5"
        assert httpx.get(f"{base}/health").status_code == 200
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 503
        gate.set()
        deadline = time.monotonic() + 120
        while httpx.get(f"{base}/ready").status_code != 200:
            assert time.monotonic() < deadline, "never healthy after the load"
            time.sleep(0.05)
        # a crash inside the model kills the loop: a stream in flight gets an error event then [DONE];
        # /health and new requests answer 503; nothing hangs
        state = app.state.pagedserve
        original = engine.runner.run
        crash = threading.Event()

        def run(*args, **kwargs):
            if crash.is_set():
                raise RuntimeError("boom")
            return original(*args, **kwargs)

        engine.runner.run = run
        events = []
        body = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 3:
                        crash.set()
        err = json.loads(events[-2])["error"]
        assert events[-1] == "[DONE]" and err["code"] == "engine_dead" and "boom" not in err["message"]
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=30)
        err = r.json()["error"]
        assert r.status_code == 503 and err["code"] == "engine_dead" and "boom" not in err["message"]
        # the gauges of a dead engine are not reported as if it were still running
        assert "vllm:num_requests_running" not in httpx.get(f"{base}/metrics").text
        assert httpx.get(f"{base}/health").status_code == 503
        assert httpx.get(f"{base}/ready").status_code == 503
        assert not state.client.alive
        engine.runner.run = original
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.mark.slow  # the load-test client end to end: the heavy tier
def test_bench_against_live_pagedserve(make_engine, tmp_path, capsys):
    """`pagedserve bench` end to end: a tiny workload, every metric in the JSON; a 429 is counted."""
    from pagedserve.server.cli import main as cli_main

    engine = make_engine(num_blocks=256, max_num_seqs=4)
    with running_server(engine, AdmissionLimits(max_waiting_requests=2)) as (base, _):
        out = tmp_path / "bench.json"
        cli_main(["bench", "--base-url", base, "--workload", "random", "--random-input-len", "40",
                  "--random-output-len", "12", "--random-range-ratio", "0.5", "--num-prompts", "12",
                  "--no-progress", "--json", str(out), "--seed", "1"])
        result = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed
    for key in ("completed", "failed", "rejected_429", "request_throughput", "output_throughput",
                "total_token_throughput", "mean_ttft_ms", "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms",
                "mean_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "p99_itl_ms", "mean_e2el_ms", "p99_e2el_ms"):
        assert key in result, key
    # 12 at once against 4 running + 2 waiting: some are turned away, none fail, the rest complete
    assert result["failed"] == 0
    assert result["rejected_429"] > 0 and result["completed"] + result["rejected_429"] == 12
    assert result["output_throughput"] > 0


@pytest.mark.slow  # load, flood or fuzz: the heavy tier
def test_queued_token_limit(make_engine, smollm):
    """Past --max-queued-tokens of prompts waiting for their prefill, new requests get 429."""
    engine = make_engine(num_blocks=256, max_num_batched_tokens=64)  # a long prompt takes many steps
    long_prompt = smollm.tokenizer.decode(list(range(1000, 3000)))
    limit = len(smollm.tokenizer.encode(long_prompt)) + 100  # the first fits alone; the two together do not
    with running_server(engine, AdmissionLimits(max_queued_tokens=limit)) as (base, state):
        async def main():
            async with httpx.AsyncClient(timeout=120) as c:
                first = asyncio.create_task(c.post(f"{base}/v1/completions",
                                                   json={"prompt": long_prompt, "max_tokens": 2}))
                # submitted, not only admitted (AsyncEngine.num_waiting counts reservations too): the second
                # request's tokens must be the ones that find the first's queued
                while state.client.engine.num_waiting + state.client.num_running == 0:
                    await asyncio.sleep(0.01)
                second = await c.post(f"{base}/v1/completions", json={"prompt": "Hello " * 200, "max_tokens": 2})
                return await first, second

        first, second = asyncio.run(main())
        assert first.status_code == 200
        assert second.status_code == 429 and "prompt tokens queued" in second.json()["error"]["message"]
        assert int(second.headers["retry-after"]) >= 1
        _wait_idle(state)


def test_chat_cli_streams_a_reply(server):
    base, _ = server
    out = subprocess.run([sys.executable, "-m", "pagedserve.server", "chat", "--base-url", f"{base}/v1", "--max-tokens",
                          "8", "--temperature", "0"], input="Say hi\n\n", capture_output=True, text=True, timeout=120,
                         cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert f"chatting with {MODEL}" in out.stdout
    reply = out.stdout.split("assistant> ", 1)[1].splitlines()[0]
    assert reply.strip()


def test_usage_reports_cached_tokens_on_every_response(client):
    """OpenAI's usage.prompt_tokens_details.cached_tokens: 0 on a cold prompt, the prefix-cache hit (whole blocks)
    on a repeat; in chat and completions, streamed (the usage chunk) or not."""
    prompt = "A cold prompt about cached tokens, long enough for several blocks. " * 4
    messages = [{"role": "user", "content": prompt}]
    cold = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    # the chat template's system preamble is shared with every earlier chat request on this server
    preamble = cold.usage.prompt_tokens_details.cached_tokens
    assert preamble % 16 == 0 and preamble < 32
    warm = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    cached = warm.usage.prompt_tokens_details.cached_tokens
    assert cached > preamble + 16 and cached % 16 == 0 and cached < warm.usage.prompt_tokens
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached
    comp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert comp.usage.prompt_tokens_details.cached_tokens == 0
    comp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, stream=True,
                                     stream_options={"include_usage": True})
    assert list(comp)[-1].usage.prompt_tokens_details.cached_tokens > 0


def slowed(engine, seconds: float) -> None:
    """Every forward pass takes at least this long: a slow machine, whatever this one's speed."""
    run = engine.runner.run

    def slow_run(*args, **kwargs):
        time.sleep(seconds)
        return run(*args, **kwargs)

    engine.runner.run = slow_run


def _two_long_prompts_at_once(engine, bound: float) -> None:
    """Two 3,000-token completions sent together under --max-queue-wait-s `bound`: both must get 200."""
    prompts = [[1000 + (7 * i + k) % 20000 for k in range(3000)] for i in range(2)]
    with running_server(engine, AdmissionLimits(max_queue_wait_s=bound)) as (base, state):
        async def both():
            async with httpx.AsyncClient(timeout=600) as c:
                return await asyncio.gather(*[c.post(f"{base}/v1/completions", json={
                    "prompt": p, "max_tokens": 2, "ignore_eos": True}) for p in prompts])

        results = asyncio.run(both())
        assert [r.status_code for r in results] == [200, 200], [r.text for r in results]
        assert all(r.json()["usage"]["prompt_tokens"] == 3000 for r in results)
        _wait_idle(state)


def test_scheduled_requests_are_never_refused_for_their_wait(make_engine):
    """--max-queue-wait-s bounds the wait to be scheduled, not the time to the first token: two ~3,000-token prompts
    scheduled in the same step, each prefill longer than the bound (every step outlasts it), both get 200."""
    bound = 1.0
    engine = make_engine(num_blocks=512, max_num_seqs=8, max_num_batched_tokens=4096, max_step_ms=0)
    slowed(engine, bound + 0.2)
    step = engine.step

    def step_once_both_queued(*args, **kwargs):  # the first step waits for both: they are scheduled together
        deadline = time.monotonic() + 60
        while engine.num_waiting < 2 and not engine.scheduler.running and time.monotonic() < deadline:
            time.sleep(0.01)
        return step(*args, **kwargs)

    engine.step = step_once_both_queued
    _two_long_prompts_at_once(engine, bound)


def test_a_request_with_a_free_seat_is_never_refused_for_the_prefill_ahead(make_engine):
    """The default token budget holds one prompt's chunk a step: two ~3,000-token prompts sent together, steps that
    outlast --max-queue-wait-s. The second is prefilled only after the first step, yet a seat and its blocks were
    free for it from the start (it is seated, as a llama.cpp slot would take it): both get 200."""
    bound = 1.0
    engine = make_engine(num_blocks=512, max_num_seqs=8, max_num_batched_tokens=2048, max_step_ms=0)
    slowed(engine, bound + 0.2)
    _two_long_prompts_at_once(engine, bound)


def test_a_request_not_scheduled_within_the_bound_gets_429_with_an_estimated_retry_after(make_engine):
    """The only seat is taken by a long request: the next one is not scheduled within --max-queue-wait-s and gets a
    429 whose Retry-After is the engine's estimate (the running request's remaining tokens at the measured step
    time), not a constant."""
    engine = make_engine(num_blocks=128, max_num_seqs=1, max_step_ms=0)
    slowed(engine, 0.2)
    with running_server(engine, AdmissionLimits(max_queue_wait_s=1)) as (base, state):
        async def main():
            async with httpx.AsyncClient(timeout=120) as c:
                long = asyncio.create_task(_stream(c, base, 60))
                while not state.client.num_running:
                    await asyncio.sleep(0.02)
                refused = await c.post(f"{base}/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
                long.cancel()  # its client leaves: aborted
                await asyncio.gather(long, return_exceptions=True)
                return refused

        refused = asyncio.run(main())
        assert refused.status_code == 429, refused.text
        err = refused.json()["error"]
        assert err["code"] == "server_overloaded" and "not scheduled within 1 s" in err["message"]
        retry = int(refused.headers["retry-after"])
        assert 2 <= retry <= 60 and f"Retry after {retry} s" in err["message"]
        _wait_idle(state)


def test_priority_is_refused_under_fcfs_on_both_routes(server):
    """vLLM's rule: a non-zero priority without --scheduling-policy priority is a 400 naming the field."""
    base, _ = server
    routes = {"chat/completions": {"messages": [{"role": "user", "content": "Hi"}]}, "completions": {"prompt": "Hi"}}
    for route, body in routes.items():
        ok = httpx.post(f"{base}/v1/{route}", json={**body, "max_tokens": 2, "priority": 0}, timeout=120)
        assert ok.status_code == 200, ok.text
        r = httpx.post(f"{base}/v1/{route}", json={**body, "max_tokens": 2, "priority": 3}, timeout=120)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["type"] == "invalid_request_error" and err["param"] == "priority" and "priority" in err["message"]


def test_priority_preempts_and_a_preempted_request_is_never_refused(make_engine):
    """--scheduling-policy priority, one seat: an urgent request (either route) takes it from one whose prefill has
    begun; that one waits, preempted, for longer than --max-queue-wait-s, and still gets its 200 (it had started)."""
    engine = make_engine(num_blocks=128, max_num_seqs=1, max_num_batched_tokens=64, max_step_ms=0,
                         scheduling_policy="priority")
    slowed(engine, 0.3)
    low_prompt = [1000 + k for k in range(640)]  # 10 steps of prefill
    with running_server(engine, AdmissionLimits(max_queue_wait_s=1)) as (base, state):
        async def main():
            async with httpx.AsyncClient(timeout=300) as c:
                low = asyncio.create_task(c.post(f"{base}/v1/completions", json={
                    "prompt": low_prompt, "max_tokens": 2, "ignore_eos": True, "priority": 5}))
                while not state.client.num_running:
                    await asyncio.sleep(0.02)
                urgent = await c.post(f"{base}/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "ignore_eos": True,
                    "priority": -1})
                done_first = not low.done()
                return await low, urgent, done_first

        low, urgent, urgent_first = asyncio.run(main())
        assert urgent.status_code == 200 and low.status_code == 200, (urgent.text, low.text)
        assert urgent_first and low.json()["usage"]["completion_tokens"] == 2
        assert engine.scheduler.stats.num_preemptions >= 1
        _wait_idle(state)
