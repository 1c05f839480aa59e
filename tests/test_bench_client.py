"""End-to-end tests of the serving benchmark against a fake OpenAI-compatible server on 127.0.0.1.

The fake server (FastAPI + uvicorn in a background thread) streams `max_tokens` content chunks with a
short sleep between them; its behaviour is picked by the request's model name:
  fake           usage chunk when asked, [DONE]
  fake-429       every 3rd request gets 429 in the OpenAI error shape with Retry-After: 1
  fake-nousage   never sends usage (the bench falls back to counting content chunks)
  fake-error     an `{"error": ...}` event after two chunks
  fake-garbage   a malformed chunk after two chunks
  fake-slow      one chunk, then never another (only --max-duration ends it)
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pagedserve.benchmarks import serve
from pagedserve.benchmarks.metrics import LATENCY_METRICS, STATS
from pagedserve.benchmarks.serve import BenchError, build_parser, main, run_benchmark

CHUNK_SLEEP_S = 0.002


class FakeState:
    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.bodies: list[dict[str, Any]] = []
        self.auth: list[str | None] = []

    def reset(self) -> None:
        self.counts.clear()
        self.bodies.clear()
        self.auth.clear()


def make_app(state: FakeState) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "fake", "object": "model", "owned_by": "test"}]}

    async def complete(request: Request, chat: bool) -> Any:
        body = await request.json()
        state.bodies.append(body)
        state.auth.append(request.headers.get("authorization"))
        model, n = body["model"], int(body.get("max_tokens", 16))
        state.counts[model] += 1  # one event loop: no lock needed
        if model == "fake-429" and state.counts[model] % 3 == 0:
            err = {"message": "server overloaded, retry later", "type": "rate_limit_error", "param": None,
                   "code": "server_overloaded"}
            return JSONResponse({"error": err}, status_code=429,
                                headers={"Retry-After": "1", "retry-after-ms": "1000"})
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        usage = {"prompt_tokens": len(prompt.split()) + (7 if chat else 0), "completion_tokens": n,
                 "total_tokens": 0}
        usage["total_tokens"] = usage["prompt_tokens"] + n
        want_usage = (body.get("stream_options") or {}).get("include_usage") and model != "fake-nousage"
        base = {"id": "cmpl-1", "created": 0, "model": model,
                "object": "chat.completion.chunk" if chat else "text_completion"}

        def sse(obj: dict) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        def chunk(text: str, finish: str | None = None) -> str:
            choice = ({"index": 0, "delta": {"content": text}, "finish_reason": finish} if chat
                      else {"index": 0, "text": text, "finish_reason": finish})
            return sse({**base, "choices": [choice]})

        async def events() -> AsyncIterator[str]:
            yield ": ping\n\n"  # comment lines must be ignored
            if chat:  # role-only first chunk: has no content, so it must not stop the TTFT clock
                yield sse({**base, "choices": [{"index": 0, "delta": {"role": "assistant"}}]})
            for i in range(n):
                await asyncio.sleep(CHUNK_SLEEP_S)
                if model == "fake-slow" and i == 1:
                    await asyncio.Event().wait()
                if model == "fake-error" and i == 2:
                    yield sse({"error": {"message": "engine died", "type": "server_error"}})
                    return
                if model == "fake-garbage" and i == 2:
                    yield sse({"choices": "not a list"})
                yield chunk(f" w{i}")
            yield chunk("", "length")
            if want_usage:
                yield sse({**base, "choices": [], "usage": usage})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        return await complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await complete(request, chat=False)

    return app


@pytest.fixture(scope="module")
def fake_server() -> Iterator[tuple[str, FakeState]]:
    state = FakeState()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))  # a free port, held from the start so nothing can take it
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(make_app(state), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}", state
    server.should_exit = True
    thread.join(timeout=5)
    sock.close()


@pytest.fixture
def server(fake_server: tuple[str, FakeState]) -> tuple[str, FakeState]:
    fake_server[1].reset()
    return fake_server


def bench(base_url: str, *extra: str) -> dict[str, Any]:
    """Run through the Python entry point the way the real-server test will: parse_args + run_benchmark."""
    args = build_parser().parse_args(["--base-url", base_url, "--no-progress", "--num-prompts", "8",
                                      "--random-input-len", "16", "--random-output-len", "8", *extra])
    return asyncio.run(run_benchmark(args))


METRIC_KEYS = ["num_requests", "completed", "failed", "rejected_429", "http_429_responses", "cancelled",
               "duration", "total_input_tokens", "total_output_tokens", "request_throughput",
               "request_goodput", "output_throughput", "total_token_throughput", "max_concurrent_requests",
               "requests_without_usage"] + [f"{s}_{m}_ms" for m in LATENCY_METRICS for s in STATS]


def test_single_run_end_to_end(server: tuple[str, FakeState], tmp_path: Any, capsys: Any) -> None:
    url, state = server
    out = tmp_path / "result.json"
    res = bench(url, "--max-concurrency", "4", "--random-range-ratio", "0.5", "--goodput", "ttft:5000",
                "tpot:1000", "--json", str(out), "--api-key", "sk-test")
    on_disk = json.loads(out.read_text())  # strict JSON (inf written as "inf")
    for d in (res, on_disk):
        for key in METRIC_KEYS:
            assert key in d, key
    assert on_disk["config"]["request_rate"] == "inf"
    assert on_disk["config"]["api_key"] == "***" and "sk-test" not in out.read_text()  # never written
    assert res["model"] == "fake"  # discovered from GET /v1/models
    assert (res["completed"], res["failed"], res["rejected_429"]) == (8, 0, 0)
    assert len(res["requests"]) == 8 and len(on_disk["requests"]) == 8
    assert res["total_output_tokens"] == sum(r["max_tokens"] for r in res["requests"])
    assert res["requests_without_usage"] == 0
    assert res["request_goodput"] == pytest.approx(res["request_throughput"])  # generous SLOs: all met
    assert 1 <= res["max_concurrent_requests"] <= 4
    for r in res["requests"]:
        assert r["ok"] and r["usage"] and r["n_out"] == r["max_tokens"] == len(r["chunk_times"])
        assert 4 <= r["max_tokens"] <= 12  # 8 * (1 -+ 0.5)
        assert 0 < r["ttft_ms"] <= r["e2el_ms"]
    # 1 warm-up + 8 measured requests, each a streaming request with usage and ignore_eos
    assert len(state.bodies) == 9
    assert all(b["stream"] and b["stream_options"] == {"include_usage": True} and b["ignore_eos"]
               for b in state.bodies)
    assert set(state.auth) == {"Bearer sk-test"}
    table = capsys.readouterr().out
    assert "============ Serving Benchmark Result ============" in table
    assert "Successful requests:                     8" in table
    assert "Request goodput (req/s):" in table


def test_429_counted_as_rejections(server: tuple[str, FakeState], capsys: Any) -> None:
    url, _ = server
    res = bench(url, "--model", "fake-429", "--max-concurrency", "4", "--num-warmups", "0")
    # requests 3 and 6 (by arrival at the server) are rejected
    assert (res["completed"], res["failed"], res["rejected_429"], res["http_429_responses"]) == (6, 0, 2, 2)
    rejected = [r for r in res["requests"] if r["rejected"]]
    assert all(r["status"] == 429 and "overloaded" in r["error"] for r in rejected)
    assert res["total_output_tokens"] == sum(r["n_out"] for r in res["requests"] if r["ok"])
    assert "Rejected requests (HTTP 429):            2" in capsys.readouterr().out


def test_retry_429(server: tuple[str, FakeState]) -> None:
    url, _ = server
    res = bench(url, "--model", "fake-429", "--max-concurrency", "4", "--num-warmups", "0", "--retry-429",
                "--num-prompts", "4")
    assert (res["completed"], res["rejected_429"]) == (4, 0)
    assert res["http_429_responses"] == 1  # request 3 was retried after Retry-After: 1
    retried = [r for r in res["requests"] if r["num_429"]]
    assert len(retried) == 1 and retried[0]["ttft_ms"] >= 1000  # TTFT counts from the first attempt
    assert retried[0]["ok"] and retried[0]["error"] == "" and retried[0]["status"] == 200


def test_sweep_with_plot(server: tuple[str, FakeState], tmp_path: Any, capsys: Any) -> None:
    pytest.importorskip("matplotlib")
    url, _ = server
    png, out = tmp_path / "plots" / "sweep.png", tmp_path / "sweep.json"  # missing folders are created
    res = bench(url, "--sweep-concurrency", "1,4", "--plot", str(png), "--json", str(out))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert res["sweep"] == {"param": "max_concurrency", "values": [1, 4]}
    assert [p["max_concurrency"] for p in res["points"]] == [1, 4]
    for p in res["points"]:
        assert p["completed"] == 8 and len(p["requests"]) == 8
        assert all(k in p for k in METRIC_KEYS)
    assert res["points"][0]["max_concurrent_requests"] == 1
    assert res["knee"]["index"] in (0, 1) and res["knee"]["rule"]
    assert res["best"]["by"] == "output_throughput"
    assert json.loads(out.read_text())["knee"] == res["knee"]
    text = capsys.readouterr().out
    assert text.count("Serving Benchmark Result") == 2 and "Sweep over max_concurrency" in text
    assert "knee:" in text


def test_rate_sweep_and_completions_without_usage(server: tuple[str, FakeState], capsys: Any) -> None:
    url, state = server
    res = bench(url, "--endpoint", "completions", "--model", "fake-nousage", "--sweep-rate", "50,inf",
                "--burstiness", "0.5")
    assert [p["request_rate"] for p in res["points"]] == [50.0, float("inf")]
    for p in res["points"]:
        assert p["completed"] == 8 and p["requests_without_usage"] == 8
        assert all(r["n_out"] == len(r["chunk_times"]) == r["max_tokens"] and not r["usage"]
                   for r in p["requests"])
    assert "prompt" in state.bodies[-1] and "messages" not in state.bodies[-1]
    assert "successful requests had no `usage`" in capsys.readouterr().out


def test_error_event_marks_failed(server: tuple[str, FakeState]) -> None:
    url, _ = server
    res = bench(url, "--model", "fake-error", "--num-warmups", "0", "--num-prompts", "4")
    assert (res["completed"], res["failed"], res["rejected_429"]) == (0, 4, 0)
    assert all(r["error"] == "engine died" for r in res["requests"])
    assert res["mean_ttft_ms"] is None and res["output_throughput"] == 0.0
    res = bench(url, "--model", "fake-garbage", "--num-warmups", "0", "--num-prompts", "2")
    assert res["failed"] == 2 and all(r["error"].startswith("bad response") for r in res["requests"])


def test_warmup_failure_is_a_clear_error(server: tuple[str, FakeState], capsys: Any) -> None:
    url, _ = server
    with pytest.raises(SystemExit) as e:
        main(["--base-url", url, "--model", "fake-error", "--no-progress", "--random-output-len", "8"])
    assert e.value.code == 1
    assert "warm-up request" in capsys.readouterr().err


def test_max_duration_cancels_outstanding(server: tuple[str, FakeState], capsys: Any) -> None:
    url, _ = server
    res = bench(url, "--model", "fake-slow", "--num-warmups", "0", "--num-prompts", "4", "--max-concurrency",
                "2", "--max-duration", "0.5")
    # the fake never finishes a stream: returning at all means the cap cancelled them; cancelled, not failed
    assert (res["completed"], res["failed"], res["rejected_429"], res["cancelled"]) == (0, 0, 0, 4)
    assert all(r["cancelled"] and not r["ok"] for r in res["requests"])
    table = capsys.readouterr().out.splitlines()
    assert "Failed requests:                         0" in table
    assert "Cancelled requests (--max-duration):     4" in table
    assert sum(r["send_time"] is None for r in res["requests"]) == 2  # queued behind the cap, never sent
    assert res["duration"] >= 0.5


def test_prose_and_prefix_workloads(server: tuple[str, FakeState]) -> None:
    try:
        serve.workloads.default_text_path()
    except FileNotFoundError:
        pytest.skip("no shipped text file (benchmarks/data/)")
    url, _ = server
    for workload in ("prose", "prefix"):
        res = bench(url, "--workload", workload, "--num-prompts", "4", "--num-warmups", "0")
        assert res["completed"] == 4 and res["workload"].startswith(workload)


def test_connection_refused(capsys: Any) -> None:
    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(SystemExit):
        main(["--base-url", dead, "--no-progress"])  # model discovery fails with a clear message
    assert "/v1/models" in capsys.readouterr().err
    res = bench(dead, "--model", "m", "--num-warmups", "0", "--num-prompts", "3")
    assert res["failed"] == 3 and all("ConnectError" in r["error"] for r in res["requests"])


def test_remote_url_refused(capsys: Any) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--base-url", "http://10.1.2.3:8000", "--no-progress"])
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert "not a loopback address" in err and "--allow-remote" in err
    with pytest.raises(BenchError, match="--allow-remote"):
        asyncio.run(run_benchmark(build_parser().parse_args(["--base-url", "https://api.example.com/v1"])))
    assert serve.check_base_url("http://localhost:8000/v1/", False) == "http://localhost:8000"
    assert serve.check_base_url("http://[::1]:8000", False) == "http://[::1]:8000"
    assert serve.check_base_url("http://10.1.2.3:8000", True) == "http://10.1.2.3:8000"


def test_random_workload_range_semantics() -> None:
    args = build_parser().parse_args(["--random-input-len", "100", "--random-output-len", "20",
                                      "--random-range-ratio", "0.5", "--num-prompts", "200"])
    reqs, desc = serve.build_workload(args)
    assert len(reqs) == 200 and "random" in desc
    assert all(50 <= len(r.prompt.split()) == r.n_in_est <= 150 for r in reqs)
    assert all(10 <= r.max_tokens <= 30 for r in reqs)
    assert reqs == serve.build_workload(args)[0]  # deterministic for a seed
    nano = build_parser().parse_args(["--workload", "nano-vllm"])
    reqs, _ = serve.build_workload(nano)
    assert len(reqs) == 256 and all(100 <= r.max_tokens <= 1024 and 100 <= r.n_in_est <= 1024 for r in reqs)


def test_arrivals() -> None:
    import random

    assert serve.arrival_offsets(3, float("inf"), 1.0, random.Random(0)) == [0.0, 0.0, 0.0]
    for burstiness in (1.0, 0.5):
        t = serve.arrival_offsets(20001, 10.0, burstiness, random.Random(0))
        assert t[0] == 0.0 and t == sorted(t)
        assert t[-1] / 20000 == pytest.approx(0.1, rel=0.05)  # mean inter-arrival 1/rate
    with pytest.raises(BenchError):
        serve.arrival_offsets(1, 1.0, 0.0, random.Random(0))


def test_parse_event() -> None:
    assert serve.parse_event({"choices": [{"delta": {"content": "hi"}}]}, "chat") == ("hi", None, None)
    assert serve.parse_event({"choices": [{"delta": {"role": "assistant"}}]}, "chat") == ("", None, None)
    assert serve.parse_event({"choices": [{"text": "yo"}]}, "completions") == ("yo", None, None)
    usage = {"prompt_tokens": 3, "completion_tokens": 5}
    assert serve.parse_event({"choices": [], "usage": usage}, "chat") == ("", usage, None)
    assert serve.parse_event({"error": {"message": "bad"}}, "chat") == ("", None, "bad")


def test_runs_as_module_help() -> None:
    # `python -m benchmarks.serve` is wired; --help exits 0 and shows the usage line
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    assert os.path.isfile(serve.__file__)
