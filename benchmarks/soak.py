"""Soak: N minutes of mixed traffic against `pagedserve serve` on 127.0.0.1, watching for leaks and stalls.

Clients (--concurrency) loop over a mix: streamed chat with usage, plain completions, JSON-schema output, tool
calls, clients that hang up mid-stream, and bad requests (invalid JSON, negative max_tokens, unknown model). Every
--sample-s seconds it records the server's resident memory, running / waiting requests, KV-cache usage and the
status codes so far. At the end the server is left to drain: no request may still run, no KV block may stay in
use, and the RSS slope after --warmup-min is fitted by least squares.

    python benchmarks/soak.py --minutes 30 [--concurrency 24] [--json results/soak.json] [-- serve options]

Bars (issue 36): 0 5xx, 0 leaked blocks, RSS slope after the first 5 minutes under 1 MB/min.
"""

from __future__ import annotations

import asyncio
import random
import re
import subprocess
import sys
import time
from collections import Counter

import httpx

from pagedserve.benchmarks import common, workloads

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer"}}, "required": ["name", "age"]}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "the weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
BAD = [b'{"messages": [', b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}',
       b'{"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}']
MIX = {"chat_stream": 30, "completion": 25, "json_schema": 10, "tools": 10, "disconnect": 15, "bad": 10}


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def gauges(text: str) -> dict[str, float]:
    out = {}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} ([0-9.e+-]+)$", text, re.M)
        out[name.split(":")[1]] = float(m.group(1)) if m else float("nan")
    return out


async def client(c: httpx.AsyncClient, base: str, words: list[str], rng: random.Random, stop: float,
                 codes: Counter) -> None:
    kinds, weights = zip(*MIX.items())
    while time.monotonic() < stop:
        kind = rng.choices(kinds, weights)[0]
        start = rng.randrange(len(words) - 300)
        text = " ".join(words[start:start + rng.randint(20, 150)])
        max_tokens = rng.randint(8, 64)
        messages = [{"role": "user", "content": f"Summarize: {text}"}]
        try:
            if kind == "bad":
                r = await c.post(f"{base}/v1/chat/completions", content=rng.choice(BAD),
                                 headers={"content-type": "application/json"})
                codes[r.status_code] += 1
            elif kind == "completion":
                r = await c.post(f"{base}/v1/completions", json={"prompt": text, "max_tokens": max_tokens})
                codes[r.status_code] += 1
            elif kind in ("json_schema", "tools"):
                body = {"messages": messages, "max_tokens": max_tokens}
                body |= {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}} \
                    if kind == "json_schema" else {"tools": TOOLS, "tool_choice": "required"}
                r = await c.post(f"{base}/v1/chat/completions", json=body)
                codes[r.status_code] += 1
            else:  # streamed; a "disconnect" client hangs up after a few chunks
                body = {"messages": messages, "max_tokens": max_tokens, "stream": True,
                        "stream_options": {"include_usage": True}}
                async with c.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
                    codes[r.status_code] += 1
                    chunks = 0
                    async for line in r.aiter_lines():
                        chunks += line.startswith("data: ")
                        if kind == "disconnect" and chunks >= 3:
                            break
            if r.status_code == 429:
                await asyncio.sleep(float(r.headers.get("retry-after", "1")))
        except httpx.HTTPError as e:
            codes[type(e).__name__] += 1


async def soak(base: str, pid: int, args) -> dict:
    words = workloads.load_words()
    rng = random.Random(args.seed)
    codes: Counter = Counter()
    t0 = time.monotonic()
    stop = t0 + args.minutes * 60
    samples = []
    async with httpx.AsyncClient(timeout=600) as c:
        tasks = [asyncio.create_task(client(c, base, words, random.Random(rng.random()), stop, codes))
                 for _ in range(args.concurrency)]
        while time.monotonic() < stop:
            await asyncio.sleep(min(args.sample_s, max(0.0, stop - time.monotonic())))
            g = gauges((await c.get(f"{base}/metrics")).text)
            samples.append({"minute": round((time.monotonic() - t0) / 60, 2), "rss_mb": round(rss_mb(pid), 1), **g,
                            "requests": sum(v for k, v in codes.items() if isinstance(k, int)),
                            "5xx": sum(v for k, v in codes.items() if isinstance(k, int) and k >= 500)})
            print(f"  {samples[-1]}", flush=True)
        await asyncio.gather(*tasks)
        for _ in range(600):  # drained: nothing running or waiting, no block held
            g = gauges((await c.get(f"{base}/metrics")).text)
            if g["num_requests_running"] == 0 and g["num_requests_waiting"] == 0 and g["kv_cache_usage_perc"] == 0:
                break
            await asyncio.sleep(0.5)
    return {"samples": samples, "codes": {str(k): v for k, v in sorted(codes.items(), key=str)}, "drained": g,
            "rss_idle_mb": round(rss_mb(pid), 1)}


def slope_mb_per_min(samples: list[dict], warmup_min: float) -> float | None:
    pts = [(s["minute"], s["rss_mb"]) for s in samples if s["minute"] >= warmup_min]
    if len(pts) < 2:
        return None
    mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(__doc__, rounds=None, baseline=False)
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--concurrency", type=int, default=24)
    ap.add_argument("--sample-s", type=float, default=30)
    ap.add_argument("--warmup-min", type=float, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("serve_args", nargs="*", help="options for `pagedserve serve` (after --)")
    args = ap.parse_args(argv)
    port = common.free_port()
    server = subprocess.Popen([sys.executable, "-m", "pagedserve.server.cli", "serve", "--port", str(port),
                               "--log-level", "warning", *args.serve_args], stdout=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(1200):
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                if server.poll() is not None:
                    sys.exit("the server did not start")
            time.sleep(0.1)
        result = asyncio.run(soak(base, server.pid, args))
    finally:
        server.terminate()
        server.wait(timeout=60)
    slope = slope_mb_per_min(result["samples"], args.warmup_min)
    s = result["samples"]
    common.table(["minute", "RSS MB", "running", "waiting", "KV usage", "requests", "5xx"],
                 [[x["minute"], x["rss_mb"], x["num_requests_running"], x["num_requests_waiting"],
                   f"{x['kv_cache_usage_perc']:.2f}", x["requests"], x["5xx"]] for x in s],
                 title=f"soak: {args.minutes:g} min, {args.concurrency} clients, mix {MIX}")
    five_xx = sum(v for k, v in result["codes"].items() if k.isdigit() and int(k) >= 500)
    leaked = result["drained"]["kv_cache_usage_perc"]
    print(f"status codes: {result['codes']}")
    print(f"5xx: {five_xx}; KV usage after draining: {leaked:.4f}; RSS idle after: {result['rss_idle_mb']} MB; "
          f"RSS slope after {args.warmup_min:g} min: {'-' if slope is None else f'{slope:+.2f} MB/min'}")
    common.write_json(args.json, {**result, "rss_slope_mb_per_min": slope, "5xx": five_xx,
                                  "minutes": args.minutes, "concurrency": args.concurrency})
    ok = five_xx == 0 and leaked == 0 and (slope is None or slope < 1.0)
    print("bars (0 5xx, 0 leaked blocks, RSS slope < 1 MB/min):", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
