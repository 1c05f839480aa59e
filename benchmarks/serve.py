"""Online serving benchmark (`pagedserve bench`) for any OpenAI-compatible server.

Works against pagedserve, vLLM, llama.cpp's llama-server or `transformers serve`: it streams
/v1/chat/completions (or /v1/completions) with httpx and measures what a client sees, with the metric
definitions of vLLM's `bench serve` (see benchmarks/metrics.py).

    python -m benchmarks.serve --workload random --random-input-len 256 --random-output-len 64 \
        --max-concurrency 8 --json out.json
    python -m benchmarks.serve --workload prose --sweep-concurrency 1,2,4,8 --plot sweep.png
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import math
import os
import random
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx

from pagedserve.benchmarks import common, workloads
from pagedserve.benchmarks.metrics import (
    SLO_KEYS,
    RequestRecord,
    best_point,
    compute_metrics,
    find_knee,
    format_table,
)
from pagedserve.server.connections import is_loopback

WORKLOADS = ("random", "prose", "prefix", "nano-vllm")
ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
MAX_RETRY_AFTER_S = 60.0

# Common English words that are one token (with their leading space) in the usual BPE vocabularies
# (Llama, Qwen, GPT), so a prompt of N random words is about N tokens. Not sent as token ids: the
# bench is tokenizer-agnostic.
_WORDS = """the of and to in is was it for on with as be at by this had not are but from or have an
they which one you were her all she there would their we him been has when who will more no if out
so said what up its about into than them can only other new some could time these two may then do
first any my now such like our over man me even most made after also did many before must through
back years where much your way well down should because each just those people how too little state
good very make world still own see men work long get here between both life being under never day
same another know while last might us great old year off come since against go came right used take
three""".split()


class BenchError(RuntimeError):
    """A configuration or connection problem that stops the benchmark before it measures anything."""


@dataclass(frozen=True)
class BenchRequest:
    prompt: str
    max_tokens: int
    n_in_est: int  # estimated prompt tokens, used only when the server reports no `usage`


# ---------------------------------------------------------------- CLI

def _float_list(s: str) -> list[float]:
    vals = [float(x) for x in s.split(",") if x.strip()]  # float("inf") parses "inf"
    if not vals or min(vals) <= 0:
        raise argparse.ArgumentTypeError("rates must be positive numbers (or inf)")
    return vals


def _positive_int(s: str) -> int:
    if int(s) < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {s}")
    return int(s)


def _int_list(s: str) -> list[int]:
    vals = [int(x) for x in s.split(",") if x.strip()]
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError("concurrencies must be positive integers")
    return vals


def _slo(item: str) -> tuple[str, float]:
    key, sep, value = item.partition(":")
    if not sep or key not in SLO_KEYS:
        raise argparse.ArgumentTypeError(f"bad SLO {item!r}: use KEY:MS with KEY in {', '.join(SLO_KEYS)}")
    return key, float(value)


def build_parser() -> argparse.ArgumentParser:
    p = common.parser("Load-test an OpenAI-compatible server (pagedserve, vLLM, llama.cpp llama-server, "
                      "transformers serve).", rounds=None, baseline=False)
    p.prog = "pagedserve bench"
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (default %(default)s)")
    p.add_argument("--allow-remote", action="store_true", help="allow a base URL that is not loopback")
    p.add_argument("--endpoint", choices=sorted(ENDPOINTS), default="chat",
                   help="chat: /v1/chat/completions, completions: /v1/completions (default %(default)s)")
    p.add_argument("--model", default=None, help="model name (default: first id from GET /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="bearer token (default $OPENAI_API_KEY)")

    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=WORKLOADS, default="random")
    w.add_argument("--num-prompts", type=_positive_int, default=None,
                   help="requests per run (default 64; 256 for nano-vllm)")
    w.add_argument("--random-input-len", type=int, default=1024, help="(default %(default)s)")
    w.add_argument("--random-output-len", type=int, default=128, help="(default %(default)s)")
    w.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [L*(1-r), L*(1+r)], 0 <= r < 1 (default %(default)s)")
    w.add_argument("--text", default=None, help="text file for prose/prefix (default: the book the engine ships, "
                   "engine/data/)")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--temperature", type=float, default=0.0)
    w.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="send `ignore_eos: true` (a vLLM/llama.cpp/pagedserve extension) so outputs have "
                        "the asked length (default on)")

    t = p.add_argument_group("traffic")
    t.add_argument("--max-concurrency", type=_positive_int, default=None, help="cap on requests in flight")
    t.add_argument("--request-rate", type=float, default=math.inf,
                   help="arrivals per second; inf = all at once (default)")
    t.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of inter-arrival times (1 = Poisson; <1 burstier) (default %(default)s)")
    sweep = t.add_mutually_exclusive_group()
    sweep.add_argument("--sweep-concurrency", type=_int_list, default=None, metavar="N,N,...",
                       help="one run per max concurrency, in increasing-load order, e.g. 1,2,4,8")
    sweep.add_argument("--sweep-rate", type=_float_list, default=None, metavar="R,R,...",
                       help="one run per request rate, e.g. 1,2,4,inf")
    t.add_argument("--max-duration", type=float, default=600.0,
                   help="seconds per run (default %(default)g); outstanding requests are then cancelled "
                        "(counted as cancelled, not failed)")
    t.add_argument("--num-warmups", type=int, default=1, help="untimed requests sent first (default 1)")
    t.add_argument("--retry-429", action="store_true",
                   help="retry a 429 after its Retry-After (<= 60 s) instead of counting it as a rejection")
    t.add_argument("--max-retries", type=int, default=3, help="with --retry-429 (default %(default)s)")

    o = p.add_argument_group("output")
    o.add_argument("--goodput", nargs="+", type=_slo, default=None, metavar="KEY:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 (keys ttft, tpot, e2el; ms)")
    o.add_argument("--plot", default=None, metavar="PATH", help="PNG of latency percentiles vs throughput")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def check_base_url(url: str, allow_remote: bool) -> str:
    """Normalized base URL (no trailing slash or /v1); a non-loopback host needs --allow-remote."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BenchError(f"--base-url must look like http://HOST:PORT, got {url!r}")
    host = parts.hostname
    if not is_loopback(host) and not allow_remote:
        raise BenchError(f"refusing to load-test {host!r}: it is not a loopback address. Pass --allow-remote "
                         "to benchmark a remote server (only one you are allowed to load).")
    base = url.rstrip("/")
    return base[:-3] if base.endswith("/v1") else base


# ---------------------------------------------------------------- workloads

def _lengths(n: int, mean: int, ratio: float, rng: random.Random) -> list[int]:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def random_requests(n: int, input_len: int, output_len: int, ratio: float, rng: random.Random,
                    ) -> list[BenchRequest]:
    """vLLM's random dataset without a tokenizer: prompts of random common words, vLLM's length ranges."""
    if not 0 <= ratio < 1:
        raise BenchError("--random-range-ratio must be in [0, 1)")
    ins, outs = _lengths(n, input_len, ratio, rng), _lengths(n, output_len, ratio, rng)
    return [BenchRequest(" ".join(rng.choices(_WORDS, k=k)), m, k) for k, m in zip(ins, outs, strict=True)]


def _text_requests(reqs: list[workloads.Request]) -> list[BenchRequest]:
    # ~1.3 tokens per English word of prose (punctuation included) — only a fallback estimate
    return [BenchRequest(r.prompt, r.max_tokens, round(1.3 * len(r.prompt.split()))) for r in reqs]


def build_workload(args: argparse.Namespace) -> tuple[list[BenchRequest], str]:
    """The requests of one run (the same for every sweep point) and a one-line description."""
    name = args.workload
    n = args.num_prompts or (256 if name == "nano-vllm" else 64)
    rng = random.Random(args.seed)
    if name == "random":
        r = args.random_range_ratio
        reqs = random_requests(n, args.random_input_len, args.random_output_len, r, rng)
        desc = f"random: {n} prompts, input {args.random_input_len} / output {args.random_output_len} tokens"
        desc += f" (±{r:.0%})" if r else ""
    elif name == "nano-vllm":
        reqs = [BenchRequest(" ".join(rng.choices(_WORDS, k=k)), rng.randint(100, 1024), k)
                for k in (rng.randint(100, 1024) for _ in range(n))]
        desc = f"nano-vllm: {n} prompts, input and output lengths uniform in 100-1024 tokens"
    elif name == "prose":
        reqs = _text_requests(workloads.prose(n, seed=args.seed, text_path=args.text))
        desc = f"prose: {n} prompts of 40-200 words from the text, outputs skewed (median 32, max 256)"
    else:
        reqs = _text_requests(workloads.shared_prefix(n, seed=args.seed, text_path=args.text))
        desc = f"prefix: {n} prompts sharing 4 prefixes of 800 words (+30-word suffixes), 32 output tokens"
    return reqs, desc


def arrival_offsets(n: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """Send times (s from start): gamma inter-arrivals with shape `burstiness` and mean 1/rate, as vLLM."""
    if burstiness <= 0:
        raise BenchError("--burstiness must be > 0")
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0:
        raise BenchError("--request-rate must be > 0")
    theta = 1.0 / (rate * burstiness)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, theta)
    return out


# ---------------------------------------------------------------- client

def build_body(endpoint: str, model: str, req: BenchRequest, args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": req.max_tokens, "temperature": args.temperature,
                            "stream": True, "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    if args.ignore_eos:
        body["ignore_eos"] = True
    return body


def parse_event(data: dict[str, Any], endpoint: str) -> tuple[str, dict | None, str | None]:
    """(content, usage, error) of one SSE JSON event; reasoning text counts as content (it is output)."""
    if data.get("error"):
        err = data["error"]
        return "", None, str(err.get("message", err) if isinstance(err, dict) else err)
    content = ""
    choices = data.get("choices") or []
    if choices:
        c = choices[0]
        if endpoint == "chat":
            delta = c.get("delta") or {}
            content = delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or ""
        else:
            content = c.get("text") or ""
    usage = data.get("usage")
    return content, usage if isinstance(usage, dict) else None, None


def _error_message(body: bytes) -> str:
    try:
        err = json.loads(body).get("error")
        return str(err.get("message", err) if isinstance(err, dict) else err)
    except (ValueError, AttributeError):
        return body[:200].decode("utf-8", "replace")


def _retry_after(headers: httpx.Headers) -> float:
    try:
        return min(MAX_RETRY_AFTER_S, max(0.0, float(headers.get("retry-after", "1"))))
    except ValueError:
        return 1.0


async def send_request(client: httpx.AsyncClient, url: str, body: dict[str, Any], rec: RequestRecord,
                       t0: float, endpoint: str, retry_429: bool = False, max_retries: int = 3) -> None:
    """Stream one request, filling `rec` (times relative to t0). Never raises except on cancellation."""
    now = lambda: time.perf_counter() - t0
    rec.send_time = now()
    try:
        for attempt in range(max_retries + 1):
            rec.error = ""
            async with client.stream("POST", url, json=body) as resp:
                rec.status = resp.status_code
                if resp.status_code == 429:
                    rec.num_429 += 1
                    rec.error = _error_message(await resp.aread())
                    wait = _retry_after(resp.headers)
                elif resp.status_code != 200:
                    rec.error = f"HTTP {resp.status_code}: {_error_message(await resp.aread())}"
                    return
                else:
                    await _read_stream(resp, rec, endpoint, now)
                    return
            if not retry_429 or attempt == max_retries:
                return
            await asyncio.sleep(wait)
    except httpx.HTTPError as e:
        rec.error = f"{type(e).__name__}: {e}"
    except Exception as e:  # a malformed response fails this request, never the whole benchmark
        rec.ok = False
        rec.error = f"bad response ({type(e).__name__}: {e})"
    finally:
        rec.end_time = now()


async def _read_stream(resp: httpx.Response, rec: RequestRecord, endpoint: str,
                       now: Callable[[], float]) -> None:
    usage: dict | None = None
    saw_data = False
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue  # blank separators, ": ping" comments, event:/id: fields
        payload = line[5:].strip()
        saw_data = True
        if payload == "[DONE]":
            break
        try:
            data = json.loads(payload)
        except ValueError:
            rec.error = f"bad SSE payload: {payload[:100]}"
            return
        content, u, err = parse_event(data, endpoint)
        if err is not None:
            rec.error = err
            return
        if content:
            rec.chunk_times.append(now())
        if u is not None:
            usage = u  # some servers repeat usage on every chunk: the last one wins
    if not saw_data:
        rec.error = "the server did not stream (no SSE `data:` lines)"
        return
    if usage and usage.get("completion_tokens") is not None:
        rec.n_out = int(usage["completion_tokens"])
        rec.n_in = int(usage.get("prompt_tokens") or rec.n_in)
        rec.usage = True
    else:
        rec.n_out = len(rec.chunk_times)  # fallback: one token per content chunk (reported in the output)
    rec.ok = True


SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_per_pos")


async def scrape_spec_decode(client: httpx.AsyncClient, base: str) -> dict[str, Any] | None:
    """The server's speculative-decoding counters (vLLM's names) from /metrics; None if it exposes none."""
    try:
        resp = await client.get(base + "/metrics", timeout=10.0)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    found: dict[str, Any] = {}
    for line in resp.text.splitlines():
        for name in SPEC_COUNTERS:
            if not line.startswith(name + "_total"):
                continue
            rest = line[len(name) + len("_total"):]
            if not rest.startswith(("{", " ")):
                continue
            value = float(rest.rsplit(" ", 1)[1])
            if name.endswith("_per_pos"):
                pos = re.search(r'position="(\d+)"', rest)
                if pos:
                    per = found.setdefault(name, {})
                    per[int(pos.group(1))] = per.get(int(pos.group(1)), 0.0) + value
            else:
                found[name] = found.get(name, 0.0) + value
    return found if "vllm:spec_decode_num_drafts" in found else None


def spec_decode_delta(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, Any] | None:
    """Acceptance over one run: rate = accepted / drafted tokens, mean length = 1 + accepted / drafts."""
    if after is None:
        return None
    before = before or {}
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in SPEC_COUNTERS[:3]}
    drafts, tokens, accepted = d[SPEC_COUNTERS[0]], d[SPEC_COUNTERS[1]], d[SPEC_COUNTERS[2]]
    per_a, per_b = after.get(SPEC_COUNTERS[3], {}), before.get(SPEC_COUNTERS[3], {})
    per_pos = [(per_a.get(p, 0.0) - per_b.get(p, 0.0)) / drafts if drafts else None for p in sorted(per_a)]
    return {"num_drafts": int(drafts), "num_draft_tokens": int(tokens), "num_accepted_tokens": int(accepted),
            "acceptance_rate": accepted / tokens if tokens else None,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
            "acceptance_per_position": per_pos}


async def fetch_model(client: httpx.AsyncClient, base: str) -> str:
    try:
        resp = await client.get(base + "/v1/models", timeout=30.0)
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
        raise BenchError(f"could not get a model from {base}/v1/models ({type(e).__name__}: {e}); "
                         "is the server up? Pass --model to skip this") from e


def _progress(total: int, desc: str, disable: bool) -> Any:
    if disable:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr)


async def run_point(client: httpx.AsyncClient, url: str, model: str, reqs: list[BenchRequest],
                    args: argparse.Namespace, rate: float, concurrency: int | None,
                    ) -> tuple[list[RequestRecord], float]:
    """One run: dispatch every request per the arrival process and concurrency cap; return records, wall s."""
    offsets = arrival_offsets(len(reqs), rate, args.burstiness, random.Random(args.seed))
    sem = asyncio.Semaphore(concurrency) if concurrency else None
    records = [RequestRecord(index=i, max_tokens=r.max_tokens, n_in=r.n_in_est) for i, r in enumerate(reqs)]
    bar = _progress(len(reqs), f"rate={rate} conc={concurrency or 'max'}", args.no_progress)
    t0 = time.perf_counter()

    async def one(i: int) -> None:
        delay = t0 + offsets[i] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        body = build_body(args.endpoint, model, reqs[i], args)
        if sem is not None:
            await sem.acquire()  # TTFT starts at the actual send, not while queued behind the cap (as vLLM)
        try:
            await send_request(client, url, body, records[i], t0, args.endpoint, args.retry_429,
                               args.max_retries)
        finally:
            if sem is not None:
                sem.release()
        if bar is not None:
            bar.update(1)

    tasks = [asyncio.create_task(one(i)) for i in range(len(reqs))]
    try:
        done, pending = await asyncio.wait(tasks, timeout=args.max_duration)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    finally:
        if bar is not None:
            bar.close()
    duration = time.perf_counter() - t0
    for task in done:
        if task.exception() is not None:
            raise task.exception()  # a bug in the bench itself, not a request failure
    for task, rec in zip(tasks, records, strict=True):
        if task in pending and not rec.ok:
            rec.cancelled = True
            rec.error = f"cancelled after --max-duration {args.max_duration:g} s"
    return records, duration


async def warm_up(client: httpx.AsyncClient, url: str, model: str, req: BenchRequest,
                  args: argparse.Namespace) -> None:
    """Untimed requests first: fail fast on a wrong URL or model; warm the server up (compile, caches)."""
    short = BenchRequest(req.prompt, min(req.max_tokens, 16), req.n_in_est)
    body = build_body(args.endpoint, model, short, args)
    for _ in range(args.num_warmups):
        rec = RequestRecord(index=-1)
        await send_request(client, url, body, rec, time.perf_counter(), args.endpoint)
        if not rec.ok and not rec.rejected:
            raise BenchError(f"warm-up request to {url} failed: {rec.error or 'no error message'}")


# ---------------------------------------------------------------- output

KNEE_RULE = ("last point before p99 TTFT or p99 TPOT grows >2x (and >1 ms) from one sweep point to the "
             "next, or before a point with no successful request; the last point if there is no such jump")


def _fmt_ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f}"


def format_sweep(points: list[dict[str, Any]], param: str, knee: int | None, best: int | None) -> str:
    """One line per sweep point; `*` marks the knee, `+` the best (max goodput / throughput) point."""
    label = "conc" if param == "max_concurrency" else "rate"
    goodput = points[0]["request_goodput"] is not None
    cols = [label, "req/s", "out tok/s", "p50 TTFT", "p99 TTFT", "p50 TPOT", "p99 TPOT"]
    cols += (["goodput"] if goodput else []) + ["ok", "failed", "429", "cancelled"]
    lines = ["{s:{c}^{n}}".format(s=f" Sweep over {param} (latencies in ms) ", n=100, c="="),
             "   " + "".join(f"{c:>11}" for c in cols)]
    for i, p in enumerate(points):
        mark = ("*" if i == knee else " ") + ("+" if i == best else " ")
        vals = [str(p[param] if p[param] is not None else "max"), f"{p['request_throughput']:.2f}",
                f"{p['output_throughput']:.1f}", _fmt_ms(p["median_ttft_ms"]), _fmt_ms(p["p99_ttft_ms"]),
                _fmt_ms(p["median_tpot_ms"]), _fmt_ms(p["p99_tpot_ms"])]
        vals += ([f"{p['request_goodput']:.2f}"] if goodput else [])
        vals += [str(p["completed"]), str(p["failed"]), str(p["rejected_429"]), str(p["cancelled"])]
        lines.append(f" {mark}" + "".join(f"{v:>11}" for v in vals))
    if knee is not None:
        lines.append(f"* knee: {label} {points[knee][param]} — {KNEE_RULE}")
    if best is not None:
        by = "request goodput" if goodput else "output token throughput"
        lines.append(f"+ best: {label} {points[best][param]} — max {by}")
    return "\n".join(lines)


def plot_points(points: list[dict[str, Any]], param: str, path: str, title: str, knee: int | None) -> None:
    """PNG of TTFT / TPOT / E2EL percentiles against output throughput, one marker per sweep point."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # lazy: only --plot needs matplotlib
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 4.8))
    FigureCanvasAgg(fig)  # no pyplot: no global backend state, safe in threads and tests
    xs = [p["output_throughput"] for p in points]
    nan = float("nan")
    for k, (metric, name) in enumerate((("ttft", "TTFT"), ("tpot", "TPOT"), ("e2el", "E2E latency"))):
        ax = fig.add_subplot(1, 3, k + 1)
        for stat, style in (("median", "o-"), ("p90", "s--"), ("p99", "^:")):
            ys = [p[f"{stat}_{metric}_ms"] for p in points]
            ax.plot(xs, [nan if y is None else y for y in ys], style, label=stat)
        for x, p in zip(xs, points, strict=True):
            ax.annotate(str(p[param]), (x, p[f"p99_{metric}_ms"] or 0.0), textcoords="offset points",
                        xytext=(4, 4), fontsize=8)
        if knee is not None:
            ax.axvline(xs[knee], color="red", alpha=0.4, linestyle="--", label="knee")
        ax.set_xlabel("output throughput (tok/s)")
        ax.set_ylabel(f"{name} (ms)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{title}  (labels: {param})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---------------------------------------------------------------- entry points

async def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark described by `build_parser().parse_args(...)`; print tables, write --json/--plot.

    Returns the result dict: for a single run, every metric at top level plus `requests` (per-request
    records); for a sweep, `points` (one such dict each), `knee` and `best`.
    """
    base = check_base_url(args.base_url, args.allow_remote)
    slos = dict(args.goodput) if args.goodput else None
    try:
        reqs, desc = build_workload(args)
    except FileNotFoundError as e:
        raise BenchError(str(e)) from e
    if args.sweep_concurrency:
        param, runs = "max_concurrency", [(args.request_rate, c) for c in args.sweep_concurrency]
    elif args.sweep_rate:
        param, runs = "request_rate", [(r, args.max_concurrency) for r in args.sweep_rate]
    else:
        param, runs = None, [(args.request_rate, args.max_concurrency)]
    for rate, _ in runs:
        arrival_offsets(1, rate, args.burstiness, random.Random(0))  # validate before connecting

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=len(reqs))
    # a proxy from the environment must not sit between the bench and a local server
    local = is_loopback(urlsplit(base).hostname or "")
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0), limits=limits, headers=headers,
                                 trust_env=not local) as client:
        model = args.model or await fetch_model(client, base)
        url = base + ENDPOINTS[args.endpoint]
        try:  # bounded like the runs, so a hung server cannot stall the bench before it starts
            await asyncio.wait_for(warm_up(client, url, model, reqs[0], args), timeout=args.max_duration)
        except asyncio.TimeoutError as e:
            raise BenchError(f"warm-up did not finish within --max-duration {args.max_duration:g} s") from e
        points = []
        for rate, conc in runs:
            spec_before = await scrape_spec_decode(client, base)
            records, duration = await run_point(client, url, model, reqs, args, rate, conc)
            m = compute_metrics(records, duration, slos)
            m["spec_decode"] = spec_decode_delta(spec_before, await scrape_spec_decode(client, base))
            header = [("Endpoint", url), ("Model", model), ("Workload", desc),
                      ("Request rate configured (RPS)", rate)]
            if math.isfinite(rate):
                header.append(("Burstiness (gamma shape)", args.burstiness))
            header.append(("Maximum request concurrency", conc if conc else "unlimited"))
            print(common.machine_header() + "\n" + format_table(m, header), flush=True)
            points.append({"request_rate": rate, "burstiness": args.burstiness, "max_concurrency": conc, **m,
                           "requests": [r.to_dict() for r in records]})

    info = {"date": _dt.datetime.now().isoformat(timespec="seconds"), "base_url": base,
            "endpoint": url, "model": model, "workload": desc,
            "config": {**vars(args), "api_key": "***" if args.api_key else None}}  # never write secrets
    knee = None
    if param is None:
        result = {**info, **points[0]}
    else:
        knee, best = find_knee(points), best_point(points)
        print(format_sweep(points, param, knee, best), flush=True)
        by = "request_goodput" if slos else "output_throughput"
        result = {**info, "sweep": {"param": param, "values": [p[param] for p in points]}, "points": points,
                  "knee": {"index": knee, "value": points[knee][param], "rule": KNEE_RULE},
                  "best": {"index": best, "value": points[best][param], "by": by}}
    common.write_json(args.json, result)  # infinite rates written as "inf": strict JSON
    if args.plot:
        if os.path.dirname(args.plot):
            os.makedirs(os.path.dirname(args.plot), exist_ok=True)
        plot_points(points, param or "max_concurrency", args.plot, f"{model} — {desc}", knee)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    try:
        return asyncio.run(run_benchmark(args))
    except BenchError as e:
        print(f"pagedserve bench: error: {e}", file=sys.stderr)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
