"""Steady streams in a burst: 64 prose requests at once, and how evenly every stream's tokens keep coming.

Each request is 40-200 consecutive words of the bundled book (uniform), `max_tokens` drawn from a lognormal
(median 32, sigma 1, clipped to 4..256), `ignore_eos`, temperature 0, streamed to the official `openai` client,
all sent at once. A request's TPOT is (last token - first token) / (tokens - 1); the table gives output tokens/s,
TTFT p50, TPOT p50 / p99 and their ratio over the requests, and the worst gap between two tokens of one stream.
After the burst, on the idle server, one request at a time: prefill tokens/s of a long prompt (PREFILL_WORDS words
of the book, about 2,000 tokens, `max_tokens` 1; the better of two prompts from different pages, so no prefix
cache helps) and the TPOT of one stream (64 tokens).

Sizes: `135m` is the bundled SmolLM2-135M-Instruct (Q4_1); `1b` and `8b` are Llama-3.2-1B- and Llama-3.1-8B-shaped
GGUFs with random blocks (`--quant`, default Q4_1; Q4_K_M is llama.cpp's default download) at SmolLM2's
49152-token vocabulary, carrying the bundled tokenizer, so every server tokenizes alike: the 8B's LM head, read
for every token, is therefore smaller than the real model's (49152 rows, not 128256). The files are written once
into the cache directory and reused. An 8B burst is slow on few cores: `--requests-8b`
shrinks it (the table says how many requests each row served).

Servers, in interleaved rounds, one up at a time (each started for its own round and stopped after it, so none
shares the cores or the caches with another): this tree, each `--baseline-ref` (a git worktree of that commit),
each `--peer-cmd` (any OpenAI-compatible server's command line, `{model}` and `{port}` filled in, e.g.
llama.cpp's llama-server; its row is named after the program) and each `--peer-url` (a server already running on
the same file, up the whole time).

    python benchmarks/steady_streams.py --sizes 135m,1b --rounds 2 --baseline-ref 25f1cf5 --json out.json \\
        [--serve-args "--quantization int4"] [--peer-url http://127.0.0.1:8080/v1] \\
        [--peer-cmd "llama-server -m {model} --port {port} -np 16 -t 2 -c 32768"]
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import shlex
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from pagedserve.benchmarks import common, gguf_quants, workloads

ONE_B_SHAPE = "llama-3.2-1b-smolvocab"
SHAPES = {"1b": ONE_B_SHAPE, "8b": "llama-3.1-8b-smolvocab"}  # the GGUF sizes and their shapes in gguf_quants
PREFILL_WORDS = 1500


def peer_command(template: str, model: str, port: int) -> list[str]:
    """The argv of `--peer-cmd TEMPLATE` serving `model` on `port`: split as a shell would, then `{model}` and
    `{port}` filled in each word (so a path with spaces stays one argument; other braces are left alone)."""
    return [w.replace("{model}", model).replace("{port}", str(port)) for w in shlex.split(template)]


def peer_labels(templates: list[str]) -> list[str]:
    """Each peer command's row name: its program's file name, numbered where two run the same program."""
    names = [os.path.basename(shlex.split(t)[0]) for t in templates]
    return [f"{n} #{names[:i].count(n) + 1}" if names.count(n) > 1 else n for i, n in enumerate(names)]


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
    ap.add_argument("--sizes", default="135m,1b", help="135m, 1b and/or 8b (default %(default)s)")
    ap.add_argument("--quant", default="Q4_1", help="block type of the 1B and 8B files: Q4_0, Q4_1, Q8_0, Q4_K_M ...")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--requests-8b", type=int, metavar="N", help="the 8B burst's size (default: --requests)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--serve-args", default="", help="extra `serve` options for every pagedserve server")
    ap.add_argument("--peer-url", action="append", default=[], metavar="URL",
                    help="an OpenAI-compatible server (its /v1 URL) already serving the same file (loopback)")
    ap.add_argument("--peer-cmd", action="append", default=[], metavar="CMD",
                    help="the command line of an OpenAI-compatible server, with {model} and {port}: started on "
                         "each file for its own rounds only (repeatable)")
    args = ap.parse_args(argv)
    for t in args.peer_cmd:
        if not shlex.split(t) or "{model}" not in t or "{port}" not in t:
            ap.error(f"--peer-cmd needs a program and both {{model}} and {{port}}: {t!r}")
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    for size in sizes:
        if size != "135m" and size not in SHAPES:
            ap.error(f"unknown size {size!r} (135m, {', '.join(SHAPES)})")
    from pagedserve.engine.config import bundled_model_path

    extra = shlex.split(args.serve_args)
    trees = common.trees(args.baseline_ref)
    counts = {size: args.requests_8b or args.requests if size == "8b" else args.requests for size in sizes}
    results: dict[str, dict[str, list[dict]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        log = open(os.path.join(tmp, "servers.log"), "w")
        models = {}
        for size in sizes:
            if size == "135m":
                models[size] = (bundled_model_path(), None)
            else:
                path = gguf_quants.cached_gguf(SHAPES[size], args.quant, tokenizer_from=bundled_model_path())
                models[size] = (path, bundled_model_path())
        for size, (model, tok) in models.items():
            reqs = burst(counts[size], args.seed)

            def ours(tree: Path | None, model=model, tok=tok, reqs=reqs):
                def run() -> dict:
                    proc, url = common.serve(tree, ["--model", model, "--log-level", "warning",
                                                    *(["--tokenizer", tok] if tok else []), *extra], log)
                    try:
                        return asyncio.run(_run(url + "/v1", reqs))
                    finally:
                        common.stop(proc)
                return run

            def peer(template: str, label: str, model=model, reqs=reqs):
                def run() -> dict:
                    port = common.free_port()
                    proc, url = common.launch(peer_command(template, model, port), port, log, label)
                    try:
                        return asyncio.run(_run(url + "/v1", reqs))
                    finally:
                        common.stop(proc)
                return run

            runs = {label: ours(tree) for label, tree in trees.items()}
            runs.update({label: peer(t, label) for t, label in zip(args.peer_cmd, peer_labels(args.peer_cmd))})
            runs.update({url: (lambda url=url, reqs=reqs: asyncio.run(_run(url, reqs))) for url in args.peer_url})
            results[size] = common.interleaved(args.rounds, runs)
    medians = {size: {label: common.medians(r) for label, r in by.items()} for size, by in results.items()}
    rows = []
    for size, by in medians.items():
        base = by["this"]
        for label, m in by.items():
            rows.append([size, counts[size], label, f"{m['tok_s']:.1f}", common.ratio(m["tok_s"], base["tok_s"]),
                         f"{m['ttft_p50_ms'] / 1e3:.2f}", f"{m['tpot_p50_ms']:.0f}", f"{m['tpot_p99_ms']:.0f}",
                         f"{m['p99_over_p50']:.2f}", f"{m['max_gap_ms']:.0f}",
                         f"{m['prefill_tok_s']:.0f}", common.ratio(m["prefill_tok_s"], base["prefill_tok_s"]),
                         f"{m['single_tpot_ms']:.1f}"])
    written = [s for s in sizes if s in SHAPES]
    quant = f"{'/'.join(written)} {args.quant}, " if written else ""
    text = common.table(["model", "requests", "server", "out tok/s", "vs this", "TTFT p50 s", "TPOT p50 ms",
                         "TPOT p99 ms", "p99/p50", "worst gap ms", "prefill tok/s", "vs this", "1-stream TPOT ms"],
                        rows, f"prose requests at once (medians of {args.rounds} interleaved rounds, one server up "
                              f"at a time; {quant}serve args {args.serve_args or '(defaults)'})")
    common.write_json(args.json, {"requests": counts, "quant": args.quant, "serve_args": args.serve_args,
                                  "peer_cmds": dict(zip(peer_labels(args.peer_cmd), args.peer_cmd)),
                                  "results": results, "medians": medians, "table": text})

if __name__ == "__main__":
    main()
