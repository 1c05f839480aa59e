"""Steady streams in a burst: 64 prose requests at once, and how evenly every stream's tokens keep coming.

Each request is 40-200 consecutive words of the bundled book (uniform), `max_tokens` drawn from a lognormal
(median 32, sigma 1, clipped to 4..256), `ignore_eos`, temperature 0, streamed to the official `openai` client,
all sent at once. A request's TPOT is (last token - first token) / (tokens - 1); the table gives output tokens/s,
TTFT p50, TPOT p50 / p99 and their ratio over the requests, and the worst gap between two tokens of one stream.
After the burst, on the idle server, one request at a time: prefill tokens/s of a long prompt (PREFILL_WORDS words
of the book, about 2,000 tokens, `max_tokens` 1; the better of two prompts from different pages, so no prefix
cache helps) and the TPOT of one stream (64 tokens).

Sizes: `135m` is the bundled SmolLM2-135M-Instruct (Q4_1); `1b` is a Llama-3.2-1B-shaped GGUF written here with
random blocks (`--quant`, default Q4_1) at SmolLM2's vocabulary, served with the bundled tokenizer. Servers, in
interleaved rounds: this tree, each `--baseline-ref` (a git worktree of that commit serving the same file), and
each `--peer-url` (any OpenAI-compatible server already serving the same file, e.g. llama.cpp's llama-server).

    python benchmarks/steady_streams.py --sizes 135m,1b --rounds 2 --baseline-ref 25f1cf5 --json out.json \\
        [--serve-args "--quantization int4"] [--peer-url http://127.0.0.1:8080/v1]
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from pagedserve.benchmarks import common, gguf_quants, workloads

ONE_B_SHAPE = "llama-3.2-1b-smolvocab"
PREFILL_WORDS = 1500


def burst(n: int, seed: int) -> list[tuple[str, int]]:
    """(prompt, max_tokens) for the issue's workload."""
    rng = random.Random(seed)
    words = workloads.load_words()
    out = []
    for _ in range(n):
        k = rng.randint(40, 200)
        start = rng.randrange(0, len(words) - k)
        out.append((" ".join(words[start:start + k]), max(4, min(256, round(32 * math.exp(rng.gauss(0, 1)))))))
    return out


async def _one(client, model: str, prompt: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    times: list[float] = []
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            times.append(time.perf_counter() - t0)
    return {"times": times}


async def _run(base_url: str, reqs: list[tuple[str, int]]) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=1800,
                         http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=len(reqs) + 4),
                                                       timeout=1800))
    model = (await client.models.list()).data[0].id
    await _one(client, model, "Warm up.", 4)
    t0 = time.perf_counter()
    results = await asyncio.gather(*(_one(client, model, p, m) for p, m in reqs))
    wall = time.perf_counter() - t0
    alone = await _alone(client, model)
    await client.close()
    return summarize(results, wall) | alone


async def prefill_rates(client, model: str, prompts: list[str]) -> list[tuple[float, int]]:
    """Each prompt alone, one after another (`max_tokens=1`): (prompt tokens per second, prompt tokens)."""
    out = []
    for prompt in prompts:
        t0 = time.perf_counter()
        r = await client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0)
        out.append((r.usage.prompt_tokens / (time.perf_counter() - t0), r.usage.prompt_tokens))
    return out


async def _alone(client, model: str) -> dict:
    """One request at a time on the idle server: prefill tokens/s of a long prompt, TPOT of one stream."""
    words = workloads.load_words()
    prefill = await prefill_rates(client, model, [" ".join(words[s:s + PREFILL_WORDS]) for s in (1000, 20000)])
    times = (await _one(client, model, " ".join(words[500:540]), 64))["times"]
    best = max(prefill)
    return {"prefill_tok_s": best[0], "prefill_prompt_tokens": best[1],
            "single_tpot_ms": (times[-1] - times[0]) / (len(times) - 1) * 1e3}


def summarize(results: list[dict], wall: float) -> dict:
    """Pieces of text stand in for tokens (one SSE chunk per token, as every server here streams)."""
    ttft = [r["times"][0] for r in results if r["times"]]
    tpot = [(r["times"][-1] - r["times"][0]) / (len(r["times"]) - 1) for r in results if len(r["times"]) > 1]
    gaps = [max(b - a for a, b in zip(r["times"], r["times"][1:])) for r in results if len(r["times"]) > 1]
    tokens = sum(len(r["times"]) for r in results)
    p = lambda xs, q: statistics.quantiles(xs, n=100, method="inclusive")[q - 1] * 1e3  # noqa: E731
    return {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall, "ttft_p50_ms": p(ttft, 50),
            "tpot_p50_ms": p(tpot, 50), "tpot_p99_ms": p(tpot, 99), "p99_over_p50": p(tpot, 99) / p(tpot, 50),
            "max_gap_ms": max(gaps) * 1e3}


def main(argv: list[str] | None = None) -> None:
    ap = common.parser(__doc__, rounds=2)
    ap.add_argument("--sizes", default="135m,1b", help="135m and/or 1b (default %(default)s)")
    ap.add_argument("--quant", default="Q4_1", help="block type of the 1B file: Q4_0, Q4_1, Q8_0, Q4_K_M ...")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--serve-args", default="", help="extra `serve` options for every pagedserve server")
    ap.add_argument("--peer-url", action="append", default=[], metavar="URL",
                    help="an OpenAI-compatible server (its /v1 URL) already serving the same file (loopback)")
    args = ap.parse_args(argv)
    from pagedserve.engine.config import bundled_model_path

    reqs = burst(args.requests, args.seed)
    extra = shlex.split(args.serve_args)
    trees = common.trees(args.baseline_ref)
    results: dict[str, dict[str, list[dict]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        log = open(os.path.join(tmp, "servers.log"), "w")
        models = {}
        for size in [s.strip() for s in args.sizes.split(",") if s.strip()]:
            if size == "135m":
                models[size] = (bundled_model_path(), None)
            elif size == "1b":
                path = os.path.join(tmp, f"1b-{args.quant}.gguf")
                gguf_quants.write_gguf(path, gguf_quants.SHAPES[ONE_B_SHAPE], args.quant)
                models[size] = (path, bundled_model_path())
            else:
                sys.exit(f"steady_streams: unknown size {size!r} (135m, 1b)")
        for size, (model, tok) in models.items():
            def contestant(tree: Path | None, model=model, tok=tok):
                def run() -> dict:
                    proc, url = common.serve(tree, ["--model", model, "--log-level", "warning",
                                                    *(["--tokenizer", tok] if tok else []), *extra], log)
                    try:
                        return asyncio.run(_run(url + "/v1", reqs))
                    finally:
                        common.stop(proc)
                return run

            runs = {label: contestant(tree) for label, tree in trees.items()}
            runs.update({url: (lambda url=url: asyncio.run(_run(url, reqs))) for url in args.peer_url})
            results[size] = common.interleaved(args.rounds, runs)
    medians = {size: {label: common.medians(r) for label, r in by.items()} for size, by in results.items()}
    rows = []
    for size, by in medians.items():
        base = by["this"]
        for label, m in by.items():
            rows.append([size, label, f"{m['tok_s']:.1f}", common.ratio(m["tok_s"], base["tok_s"]),
                         f"{m['ttft_p50_ms'] / 1e3:.2f}", f"{m['tpot_p50_ms']:.0f}", f"{m['tpot_p99_ms']:.0f}",
                         f"{m['p99_over_p50']:.2f}", f"{m['max_gap_ms']:.0f}",
                         f"{m['prefill_tok_s']:.0f}", common.ratio(m["prefill_tok_s"], base["prefill_tok_s"]),
                         f"{m['single_tpot_ms']:.1f}"])
    text = common.table(["model", "server", "out tok/s", "vs this", "TTFT p50 s", "TPOT p50 ms", "TPOT p99 ms",
                         "p99/p50", "worst gap ms", "prefill tok/s", "vs this", "1-stream TPOT ms"], rows,
                        f"{args.requests} prose requests at once (medians of {args.rounds} interleaved rounds; "
                        f"serve args {args.serve_args or '(defaults)'})")
    common.write_json(args.json, {"requests": args.requests, "quant_1b": args.quant, "serve_args": args.serve_args,
                                  "results": results, "medians": medians, "table": text})


if __name__ == "__main__":
    main()
