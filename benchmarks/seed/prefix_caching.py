"""Prefix caching: a request whose long prefix is already in the paged KV cache skips its prefill.

A ~1,000-token passage of the book is followed by a different short continuation per request (think:
one document or system prompt, many questions). Without prefix caching every request prefills the
whole prompt; with it, the full 16-token blocks of the shared prefix are found by hash and only the
rest is computed. Time to first token (the engine's own metric: first token - arrival) is compared,
and the greedy outputs must match (in fp32; a divergence is accepted only at a genuine near-tie,
both candidates' logits within 1e-3).

    python benchmarks/seed/prefix_caching.py [--quick] [--prefix-tokens 1024] [--json out.json]
"""

from __future__ import annotations

import os
import statistics

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see kv_cache.py

from pagedserve.benchmarks.common import table  # noqa: E402
from pagedserve.benchmarks.seed import common  # noqa: E402
from pagedserve.benchmarks.seed.common import ms  # noqa: E402


def experiment(loaded: common.Loaded, prefix_tokens: int, suffix_tokens: int, gen_tokens: int,
               repeats: int) -> dict:
    prefix = common.book_ids(loaded, prefix_tokens, offset=3000)
    # repeats + 2 continuations: [0] primes the cache, [1] warms up, the rest are timed
    suffixes = [common.book_ids(loaded, suffix_tokens, offset=20000 + 500 * i) for i in range(repeats + 2)]
    total = prefix_tokens + suffix_tokens + gen_tokens
    options = dict(num_blocks=4 * common.blocks_for(total), max_num_batched_tokens=max(2048, total))

    def run(eng, i: int) -> dict:
        rid = f"q{i}"
        eng.add_request(rid, prefix + suffixes[i], common.greedy(gen_tokens, logprobs=5))
        r = common.run_all(eng)[rid]
        return {"ttft_s": r["metrics"].ttft, "tokens": r["tokens"], "logprobs": r["logprobs"],
                "num_cached_tokens": r["num_cached_tokens"]}

    cold = common.engine(loaded, enable_prefix_caching=False, **options)
    run(cold, 1)  # warm-up (nothing is ever cached here)
    uncached = [run(cold, i) for i in range(2, repeats + 2)]

    warm = common.engine(loaded, enable_prefix_caching=True, **options)
    first = run(warm, 0)  # computes and publishes the prefix's blocks
    run(warm, 1)  # warm-up of the cached path
    cached = [run(warm, i) for i in range(2, repeats + 2)]

    comparisons = [common.compare_greedy(c["tokens"], u["tokens"], c["logprobs"]) for c, u in zip(cached, uncached)]
    ttft_u = [u["ttft_s"] for u in uncached]
    ttft_c = [c["ttft_s"] for c in cached]
    return {
        "dtype": loaded.dtype_name, "prompt_tokens": prefix_tokens + suffix_tokens, "prefix_tokens": prefix_tokens,
        "cached_tokens": cached[0]["num_cached_tokens"], "first_request_cached_tokens": first["num_cached_tokens"],
        "uncached_ttft_s": min(ttft_u), "cached_ttft_s": min(ttft_c),
        "uncached_ttft_median_s": statistics.median(ttft_u), "cached_ttft_median_s": statistics.median(ttft_c),
        "speedup": min(ttft_u) / min(ttft_c),
        "identical": all(c["tokens"] == u["tokens"] for c, u in zip(cached, uncached)),
        "ok": all(ok for ok, _ in comparisons), "details": [d for _, d in comparisons],
    }


def main(argv: list[str] | None = None) -> dict:
    ap = common.base_parser(__doc__)
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2")
    ap.add_argument("--dtype", default="auto", help="dtype of the timing run (auto = bf16 on this CPU)")
    ap.add_argument("--check-dtype", default="float32", help="dtype of the output-identity run")
    ap.add_argument("--prefix-tokens", type=int, default=None)
    ap.add_argument("--suffix-tokens", type=int, default=24)
    ap.add_argument("--gen-tokens", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    args = ap.parse_args(argv)
    result = common.setup(args)
    prefix_tokens = args.prefix_tokens or (1024 if not args.quick else 512)
    gen_tokens = args.gen_tokens or (8 if args.quick else 16)
    repeats = args.repeats or (2 if args.quick else 3)

    timing = common.load(args.model, args.dtype)
    runs = [experiment(timing, prefix_tokens, args.suffix_tokens, gen_tokens, repeats)]
    check = common.load(args.model, args.check_dtype)
    if check is not timing:
        runs.append(experiment(check, prefix_tokens, args.suffix_tokens, gen_tokens, 1))
    ident = runs[-1]
    result.update(model=timing.name, runs=runs)
    table(
        ["dtype", "prompt tokens", "cached tokens", "TTFT uncached ms", "TTFT cached ms", "speedup", "greedy output"],
        [[r["dtype"], r["prompt_tokens"], r["cached_tokens"], ms(r["uncached_ttft_s"]), ms(r["cached_ttft_s"]),
          f"{r['speedup']:.1f}x", "identical" if r["identical"] else ("near-tie" if r["ok"] else "DIFFERS")]
         for r in runs],
        title=f"Time to first token with the prefix cached vs not ({timing.name}; "
              f"{prefix_tokens}-token prefix + {args.suffix_tokens}-token continuation; best of repeats)")
    t = runs[0]
    checks = {
        "cached TTFT < uncached TTFT": (
            t["cached_ttft_s"] < t["uncached_ttft_s"],
            f"{ms(t['cached_ttft_s'])} ms vs {ms(t['uncached_ttft_s'])} ms ({t['dtype']})", common.TIMING),
        "the prefix was served from the cache": (
            t["cached_tokens"] >= prefix_tokens - 16 and t["first_request_cached_tokens"] == 0,
            f"{t['cached_tokens']} of {t['prompt_tokens']} prompt tokens cached"),
        f"identical greedy output ({ident['dtype']})": (ident["ok"], "; ".join(sorted(set(ident["details"])))),
    }
    return common.finish(result, checks, args)


if __name__ == "__main__":
    main()
