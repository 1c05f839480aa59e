"""Replicas on Ray Serve: does the prefix-cache-aware router keep the cache's hits, and what does Ray cost?

Workload: 8 long system prompts x 8 requests each, arriving interleaved (prompt 0..7, then again, ...), all
streamed with a concurrency cap, greedy, `max_tokens` each. Contestants, on one local Ray cluster:
  - 1 replica (the hit rate to keep), 2 replicas with our router, 2 replicas with Ray's default router
    (power of two choices, prefix-blind).
Figures: prefix-cache hit rate (sum of usage.prompt_tokens_details.cached_tokens over prompt tokens), TTFT p50
(send -> first content chunk), output tok/s (sum of usage completion tokens / wall). Then the Ray path's
overheads: start-up (deploy -> /ready 200; direct: engine load -> /ready 200) and TPOT of one stream
through Ray vs the single server in this process, both with the same threads.

    python -m pagedserve.benchmarks.replicas --json out/replicas.json       # needs pagedserve[ray]
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import statistics
import threading
import time

import httpx

from pagedserve.benchmarks.common import free_port, parser, table, write_json
from pagedserve.benchmarks.metrics import percentile
from pagedserve.engine.machine import REPORTED_FLAGS, cpu

TOPICS = ["astronomy", "cooking", "tax law", "sailing", "chess", "botany", "jazz", "volcanoes"]


def system_prompt(topic: str, words: int) -> str:
    base = (f"You are a meticulous assistant who answers questions about {topic}. Follow the house rules: be "
            "precise, cite the rule you apply, prefer short sentences, and never invent facts. ")
    filler = " ".join(f"Rule {i}: when asked about {topic}, check detail number {i} twice." for i in range(words // 12))
    return base + filler


def workload(prompts: int, per_prompt: int, words: int) -> list[list[dict]]:
    systems = [system_prompt(t, words) for t in (TOPICS * 4)[:prompts]]
    return [[{"role": "system", "content": systems[p]}, {"role": "user", "content": f"Question {r}: give me one tip."}]
            for r in range(per_prompt) for p in range(prompts)]  # interleaved: 0..7, 0..7, ...


async def one(client: httpx.AsyncClient, base: str, messages: list[dict], max_tokens: int) -> dict:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, stamps, usage = None, [], None
    async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            elif chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                now = time.perf_counter()
                ttft = ttft if ttft is not None else now - t0
                stamps.append(now)
    end = time.perf_counter()
    n = usage["completion_tokens"]
    return {"ttft": ttft, "e2e": end - t0, "tpot": (end - t0 - ttft) / (n - 1) if n > 1 and ttft else None,
            "prompt": usage["prompt_tokens"], "cached": usage["prompt_tokens_details"]["cached_tokens"], "out": n}


async def drive(base: str, requests: list[list[dict]], max_tokens: int, concurrency: int) -> dict:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:
        async def gated(m):
            async with sem:
                return await one(client, base, m, max_tokens)

        t0 = time.perf_counter()
        rows = []
        for m in requests:  # launched in arrival order; the semaphore keeps that order at the gate
            rows.append(asyncio.create_task(gated(m)))
            await asyncio.sleep(0)
        rows = await asyncio.gather(*rows)
        wall = time.perf_counter() - t0
    return {"hit_rate": sum(r["cached"] for r in rows) / sum(r["prompt"] for r in rows),
            "ttft_p50_ms": percentile([r["ttft"] * 1e3 for r in rows], 50),
            "ttft_p90_ms": percentile([r["ttft"] * 1e3 for r in rows], 90),
            "out_tok_s": sum(r["out"] for r in rows) / wall, "wall_s": wall, "requests": len(rows)}


def wait_healthy(base: str, bound_s: float = 600) -> None:
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base}/ready", timeout=5).status_code == 200:
                return
        time.sleep(0.2)
    raise TimeoutError(f"{base} not healthy within {bound_s} s")


def single_stream_tpot(base: str, max_tokens: int, reps: int) -> float:
    msgs = [{"role": "user", "content": "Write a long story about a lighthouse."}]
    tpots = [asyncio.run(drive_one(base, msgs, max_tokens)) for _ in range(reps)]
    return statistics.median(tpots) * 1e3


async def drive_one(base: str, msgs: list[dict], max_tokens: int) -> float:
    async with httpx.AsyncClient(timeout=600) as client:
        return (await one(client, base, msgs, max_tokens))["tpot"]


def main(argv: list[str] | None = None) -> None:
    ap = parser(__doc__, rounds=None, baseline=False)
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--per-prompt", type=int, default=8)
    ap.add_argument("--system-words", type=int, default=300, help="about this many words per system prompt")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per replica (and for the direct server)")
    ap.add_argument("--num-cpus", type=int, default=2, help="the local Ray cluster's CPUs")
    ap.add_argument("--tpot-tokens", type=int, default=64)
    args = ap.parse_args(argv)

    import ray
    from ray import serve

    from pagedserve.engine.config import bundled_model_path, make_config
    from pagedserve.server.config import ReplicaConfig, ServerConfig
    from pagedserve.server.ray_app import build_app

    model = args.model or bundled_model_path()
    config = make_config(model=model, dtype="float32", device="cpu")
    server = ServerConfig("bench")
    requests = workload(args.prompts, args.per_prompt, args.system_words)
    flags = sorted(f for f in REPORTED_FLAGS if f in (cpu().flags or ()))
    results: dict[str, dict] = {}
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for name, n, router in (("1 replica", 1, "prefix"), ("2 replicas, our router", 2, "prefix"),
                                ("2 replicas, Ray default", 2, "pow2")):
            t0 = time.perf_counter()
            serve.run(build_app(config, server, ReplicaConfig(replicas=n, threads=args.threads, router=router)),
                      name="bench", route_prefix="/", blocking=False)
            wait_healthy(base)
            startup = time.perf_counter() - t0
            asyncio.run(drive(base, [[{"role": "user", "content": "warm up"}]] * 2 * n, 4, 2 * n))
            r = asyncio.run(drive(base, requests, args.max_tokens, args.concurrency))
            r["startup_s"] = startup
            if n == 1:
                r["tpot_single_stream_ms"] = single_stream_tpot(base, args.tpot_tokens, 3)
            results[name] = r
            print(name, json.dumps(r), flush=True)
            serve.delete("bench")
    finally:
        serve.shutdown()
        ray.shutdown()
    results["direct (no Ray)"] = direct(config, args)
    rows = [[k, f"{v.get('hit_rate', float('nan')):.3f}" if "hit_rate" in v else "-",
             f"{v['ttft_p50_ms']:.0f}" if "ttft_p50_ms" in v else "-",
             f"{v['out_tok_s']:.1f}" if "out_tok_s" in v else "-", f"{v['startup_s']:.1f}",
             f"{v['tpot_single_stream_ms']:.1f}" if "tpot_single_stream_ms" in v else "-"] for k, v in results.items()]
    title = (f"replicas.py: {args.prompts} system prompts (~{args.system_words} words) x {args.per_prompt} requests, "
             f"interleaved, concurrency {args.concurrency}, max_tokens {args.max_tokens}, greedy; {args.threads} "
             f"thread(s) per replica, Ray num_cpus={args.num_cpus}; CPU flags: {' '.join(flags) or 'none'}")
    table(["contestant", "hit rate", "TTFT p50 ms", "out tok/s", "start-up s", "TPOT 1 stream ms"], rows, title)
    write_json(args.json, {"cpu_flags": flags, "args": vars(args), "results": results})


def direct(config, args) -> dict:
    """The single server in this process (same threads): start-up to /ready and one stream's TPOT."""
    import torch
    import uvicorn

    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.server.app import create_app, uvicorn_config
    from pagedserve.server.config import ServerConfig

    torch.set_num_threads(args.threads)
    port = free_port()
    server = ServerConfig("bench", port=port, log_level="warning")
    t0 = time.perf_counter()
    app = create_app(lambda: LLMEngine(config), server)
    uv = uvicorn.Server(uvicorn_config(app, server))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base)
        startup = time.perf_counter() - t0
        asyncio.run(drive(base, [[{"role": "user", "content": "warm up"}]] * 2, 4, 2))
        return {"startup_s": startup, "tpot_single_stream_ms": single_stream_tpot(base, args.tpot_tokens, 3)}
    finally:
        uv.should_exit = True
        thread.join(timeout=10)


if __name__ == "__main__":
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    main()
