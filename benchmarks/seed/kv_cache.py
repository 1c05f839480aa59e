"""KV cache on vs off: the chapter's first experiment.

Without a cache, every generation step re-runs the whole sequence so far; with one, a step runs
only the new token and attends over the stored keys/values. Four tables:

  1. identity: greedy generation with the cache (the engine) vs without (a fresh full prefill of the
     whole sequence for every new token, prefix caching off) -- same tokens (fp32; a divergence is
     accepted only at a genuine near-tie, both candidates' logits within 1e-3) -- and their wall time;
  2. one single-head attention step (d = 64, fp32): a 1 x n score row (cached) vs the n x n matrix
     (recompute), with the score memory each builds;
  3. multiply-accumulates of that head to generate T tokens from cold: O(T^2) vs O(T^3);
  4. the engine's step at context n: a cached decode step vs an uncached full recompute, and the
     total for T = n tokens summed from those measured step times (interpolated between contexts).

    python benchmarks/seed/kv_cache.py [--quick] [--model PATH] [--dtype auto] [--json out.json]
"""

from __future__ import annotations

import math
import os

# Idle OpenMP workers sleep instead of spinning: on a shared machine a spinning 2-thread team waits on a
# descheduled peer and steps get many times slower. Only effective before torch is first imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from pagedserve.benchmarks.common import table, timed, times_ms  # noqa: E402
from pagedserve.benchmarks.seed import common  # noqa: E402
from pagedserve.benchmarks.seed.common import ms  # noqa: E402

FULL_CONTEXTS = [64, 128, 256, 512, 1024, 2048, 4096]
QUICK_CONTEXTS = [64, 128, 256, 512]


# ---- 1. identity -----------------------------------------------------------------------------------
def identity_run(loaded: common.Loaded, prompt_tokens: int, gen_tokens: int) -> dict:
    ids = common.book_ids(loaded, prompt_tokens, offset=0)
    total = prompt_tokens + gen_tokens
    eng = common.engine(loaded, num_blocks=common.blocks_for(total), enable_prefix_caching=False,
                        max_num_batched_tokens=max(2048, total))
    # warm-up both paths at small sizes
    eng.add_request("warm-c", ids[:8], common.greedy(4))
    common.run_all(eng)

    # with the cache: one prefill, then one token per step against the stored K/V
    runs: dict[str, dict] = {}

    def with_cache() -> None:
        eng.add_request("cached", ids, common.greedy(gen_tokens, logprobs=5))
        runs.update(common.run_all(eng))

    cached_s = timed(with_cache)
    cached = runs["cached"]

    # without: every token is a new request holding the whole sequence so far -> a full prefill
    out: list[int] = []

    def without_cache() -> None:
        for i in range(gen_tokens):
            eng.add_request(f"uncached-{i}", ids + out, common.greedy(1))
            out.extend(common.run_all(eng)[f"uncached-{i}"]["tokens"])

    uncached_s = timed(without_cache)
    ok, detail = common.compare_greedy(cached["tokens"], out, cached["logprobs"])
    text = loaded.tokenizer.decode(cached["tokens"]) if loaded.tokenizer is not None else None
    return {"dtype": loaded.dtype_name, "prompt_tokens": prompt_tokens, "gen_tokens": gen_tokens,
            "cached_s": cached_s, "uncached_s": uncached_s, "ratio": uncached_s / cached_s,
            "identical": cached["tokens"] == out, "ok": ok, "detail": detail, "cached_text": text}


# ---- 2. one attention head -----------------------------------------------------------------------
def single_head(contexts: list[int], d: int = 64) -> list[dict]:
    """Timed on one thread: microsecond-sized ops would otherwise measure thread wake-ups."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _single_head(contexts, d)
    finally:
        torch.set_num_threads(threads)


@torch.inference_mode()
def _single_head(contexts: list[int], d: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    rows = []
    scale = 1.0 / math.sqrt(d)
    for n in contexts:
        x = torch.randn(n, d, generator=g)
        k, v = torch.randn(n, d, generator=g), torch.randn(n, d, generator=g)
        q_last = x[-1:]  # the new token's query
        future = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)

        def cached(q_last=q_last, k=k, v=v):  # 1 x n scores against the cached keys
            return torch.softmax((q_last @ k.T) * scale, dim=-1) @ v

        # n x n scores: every position again, causal mask, keep the last row
        def recompute(x=x, k=k, v=v, future=future):
            s = (x @ k.T) * scale
            s.masked_fill_(future, float("-inf"))
            return (torch.softmax(s, dim=-1) @ v)[-1:]

        assert torch.allclose(cached(), recompute(), atol=1e-5)
        tc, tu = (min(times_ms(fn, reps=5, warmup=1, min_s=0.02)) / 1e3 for fn in (cached, recompute))
        rows.append({"n": n, "cached_s": tc, "recompute_s": tu, "ratio": tu / tc,
                     "cached_score_bytes": n * 4, "recompute_score_bytes": n * n * 4})
    return rows


def macs(contexts: list[int], d: int = 64) -> list[dict]:
    """One head: a cached step at context n costs 2nd MACs (q.K^T and p.V), a recompute 2n^2 d."""
    rows = []
    for t in contexts:
        cached = d * t * (t + 1)  # sum_{n=1..T} 2 n d
        uncached = 2 * d * t * (t + 1) * (2 * t + 1) // 6  # sum 2 n^2 d
        rows.append({"T": t, "cached_macs": cached, "uncached_macs": uncached, "ratio": uncached / cached})
    return rows


# ---- 4. the engine at context n ----------------------------------------------------------------------
def engine_steps(loaded: common.Loaded, contexts: list[int], repeats: int, decode_steps: int) -> list[dict]:
    top = max(contexts)
    ids = common.book_ids(loaded, top + 1, offset=0)
    eng = common.engine(loaded, num_blocks=common.blocks_for(top + decode_steps + 2), enable_prefix_caching=False,
                        max_num_batched_tokens=max(2048, top))
    common.prefill_times(eng, ids[:32], repeats=1)  # warm-up
    rows = []
    for n in contexts:
        # the step that produces token n+1: cached = one decode step with n tokens attended;
        # uncached = a full forward over all n tokens from nothing
        dec = common.decode_times(eng, ids[:n - 1], decode_steps)
        full = common.prefill_times(eng, ids[:n], repeats=repeats)
        rows.append({"n": n, "cached_step_s": min(dec), "uncached_step_s": min(full),
                     "cached_step_median_s": float(np.median(dec)), "uncached_step_median_s": float(np.median(full))})
        print(f"  context {n:>5}: cached {ms(min(dec))} ms, uncached {ms(min(full))} ms", flush=True)
    grid = np.array([r["n"] for r in rows], dtype=float)
    for key in ("cached", "uncached"):
        per = np.array([r[f"{key}_step_s"] for r in rows])
        for r in rows:
            steps = np.arange(1, r["n"] + 1, dtype=float)
            # linear interpolation between measured contexts, flat outside them
            r[f"{key}_total_s"] = float(np.interp(steps, grid, per).sum())
    for r in rows:
        r["step_ratio"] = r["uncached_step_s"] / r["cached_step_s"]
        r["total_ratio"] = r["uncached_total_s"] / r["cached_total_s"]
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = common.base_parser(__doc__)
    ap.add_argument("--model", default=None, help="model for the timing tables (default: bundled SmolLM2)")
    ap.add_argument("--dtype", default="auto", help="dtype for the timing tables (auto = bf16 on this CPU)")
    ap.add_argument("--check-dtype", default="float32", help="dtype of the identity check")
    ap.add_argument("--contexts", type=int, nargs="+", default=None)
    ap.add_argument("--prompt-tokens", type=int, default=None)
    ap.add_argument("--gen-tokens", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None, help="timed full recomputes per context")
    args = ap.parse_args(argv)
    result = common.setup(args)
    contexts = args.contexts or (QUICK_CONTEXTS if args.quick else FULL_CONTEXTS)
    prompt_tokens = args.prompt_tokens or (16 if args.quick else 40)
    gen_tokens = args.gen_tokens or (16 if args.quick else 48)
    repeats = args.repeats or 2

    # 1. identity (and the opening's measured gap) --------------------------------------------------
    check_model = common.load(None if args.model is None or args.model.startswith("random:") else args.model,
                              args.check_dtype)
    ident = identity_run(check_model, prompt_tokens, gen_tokens)
    result["identity"] = ident
    table(
        ["path", "dtype", "prompt", "generated", "wall s", "ms/token"],
        [["with KV cache", ident["dtype"], prompt_tokens, gen_tokens, f"{ident['cached_s']:.2f}",
          ms(ident["cached_s"] / gen_tokens)],
         ["recompute everything", ident["dtype"], prompt_tokens, gen_tokens, f"{ident['uncached_s']:.2f}",
          ms(ident["uncached_s"] / gen_tokens)]],
        title=f"1. Greedy generation with vs without the cache ({check_model.name}): "
              f"{ident['ratio']:.1f}x slower without; tokens: {ident['detail']}")

    # 2. one attention head -------------------------------------------------------------------------
    head = single_head(contexts)
    result["single_head"] = head
    table(
        ["context n", "cached (1 x n) ms", "recompute (n x n) ms", "ratio", "scores cached", "scores recompute"],
        [[r["n"], ms(r["cached_s"], 3), ms(r["recompute_s"], 3), f"{r['ratio']:.0f}x",
          _bytes(r["cached_score_bytes"]), _bytes(r["recompute_score_bytes"])] for r in head],
        title="2. One attention head, d = 64, fp32, one thread: one generation step with vs without a cache")

    mac_rows = macs(contexts)
    result["macs"] = mac_rows
    table(
        ["T tokens", "cached MACs", "recompute MACs", "ratio"],
        [[r["T"], f"{r['cached_macs']:,}", f"{r['uncached_macs']:,}", f"{r['ratio']:.0f}x"] for r in mac_rows],
        title="3. That head's multiply-accumulates to generate T tokens from cold: O(T^2) vs O(T^3)")

    # 4. the engine ---------------------------------------------------------------------------------
    timing_model = common.load(args.model, args.dtype)
    print(f"\n4. measuring engine steps ({timing_model.name}, {timing_model.dtype_name}) ...", flush=True)
    steps = engine_steps(timing_model, contexts, repeats, decode_steps=4 if args.quick else 5)
    result["engine"] = {"model": timing_model.name, "dtype": timing_model.dtype_name, "rows": steps}
    table(
        ["context n", "cached step ms", "uncached step ms", "ratio", "total T=n cached s", "uncached s", "ratio"],
        [[r["n"], ms(r["cached_step_s"]), ms(r["uncached_step_s"]), f"{r['step_ratio']:.1f}x",
          f"{r['cached_total_s']:.2f}", f"{r['uncached_total_s']:.2f}", f"{r['total_ratio']:.0f}x"] for r in steps],
        title=f"4. Engine ({timing_model.name}, {timing_model.dtype_name}): one step at context n "
              f"(best of repeats), and the total for T = n tokens summed from those step costs")
    lo, hi = steps[0], steps[-1]
    growth = hi["n"] / lo["n"]
    cached_growth = hi["cached_step_s"] / lo["cached_step_s"]
    uncached_growth = hi["uncached_step_s"] / lo["uncached_step_s"]
    head_c = head[-1]["cached_s"] / head[0]["cached_s"]
    head_u = head[-1]["recompute_s"] / head[0]["recompute_s"]
    print(f"\ncontext {lo['n']} -> {hi['n']} ({growth:.0f}x): engine step cached x{cached_growth:.2f}, "
          f"uncached x{uncached_growth:.1f}; single head cached x{head_c:.1f}, recompute x{head_u:.0f}")
    result["growth"] = {"context": growth, "engine_cached": cached_growth, "engine_uncached": uncached_growth,
                        "head_cached": head_c, "head_recompute": head_u}

    checks = {
        "identical greedy tokens with and without the cache": (ident["ok"], ident["detail"]),
        "recompute is slower for the whole generation": (
            ident["uncached_s"] > ident["cached_s"],
            f"{ident['uncached_s']:.2f} s vs {ident['cached_s']:.2f} s", common.TIMING),
        "engine: uncached step grows much faster with context than the cached step": (
            uncached_growth > 2 * cached_growth and hi["uncached_step_s"] > hi["cached_step_s"],
            f"x{uncached_growth:.1f} vs x{cached_growth:.2f} over {growth:.0f}x context", common.TIMING),
        "single head: n x n recompute grows faster than the 1 x n row and costs more": (
            head_u > 2 * head_c and head[-1]["recompute_s"] > head[-1]["cached_s"],
            f"x{head_u:.0f} vs x{head_c:.1f}", common.TIMING),
    }
    return common.finish(result, checks, args)


def _bytes(n: int) -> str:
    for unit, size in (("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}" if n < 10 * size else f"{n / size:.0f} {unit}"
    return f"{n} B"


if __name__ == "__main__":
    main()
