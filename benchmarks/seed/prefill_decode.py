"""Prefill vs decode: the two phases of generation have different physics.

Prefill runs P prompt tokens through the model in one pass (matrix-matrix work: the weights are read
once for all P tokens). Decode runs one token against a cache of C tokens (matrix-vector work: all the
weights are read to produce one vector). Two tables, as in the chapter:

  prefill: one pass over P = 16 ... 1024 tokens (fresh, nothing cached), time and time per token;
  decode:  one step against a cache of C = 16 ... 1024 tokens -- roughly flat in C.

and the ratio "one generated token costs as much as k prompt tokens". The chapter's model is
Qwen2.5-0.5B; the full run uses random weights at its shapes (speed does not depend on the values).

    python benchmarks/seed/prefill_decode.py [--quick] [--model random:qwen2.5-0.5b] [--json out.json]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see kv_cache.py: sleeping, not spinning, OMP workers

import numpy as np  # noqa: E402

from pagedserve.benchmarks.common import table  # noqa: E402
from pagedserve.benchmarks.seed import common  # noqa: E402
from pagedserve.benchmarks.seed.common import ms  # noqa: E402

FULL_SIZES = [16, 32, 64, 128, 256, 512, 1024]


def measure(loaded: common.Loaded, prompt_sizes: list[int], cache_sizes: list[int], repeats: int,
            decode_steps: int) -> tuple[list[dict], list[dict]]:
    top = max(prompt_sizes + cache_sizes)
    ids = common.book_ids(loaded, top, offset=1000)
    eng = common.engine(loaded, num_blocks=common.blocks_for(top + decode_steps + 2), enable_prefix_caching=False,
                        max_num_batched_tokens=max(2048, top))
    common.prefill_times(eng, ids[:32], repeats=1)  # warm-up
    common.decode_times(eng, ids[:32], 2)
    prefill = []
    for p in prompt_sizes:
        t = common.prefill_times(eng, ids[:p], repeats=repeats)
        prefill.append({"P": p, "step_s": min(t), "median_s": float(np.median(t)), "per_token_s": min(t) / p})
        print(f"  prefill P={p:>5}: {ms(min(t))} ms", flush=True)
    decode = []
    for c in cache_sizes:
        t = common.decode_times(eng, ids[:c], decode_steps)
        decode.append({"C": c, "step_s": min(t), "median_s": float(np.median(t)), "tokens_per_s": 1 / min(t)})
        print(f"  decode  C={c:>5}: {ms(min(t))} ms", flush=True)
    return prefill, decode


def main(argv: list[str] | None = None) -> dict:
    ap = common.base_parser(__doc__)
    ap.add_argument("--model", default=None,
                    help=f"default: {common.QWEN} (the chapter's shapes); --quick: the bundled SmolLM2")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prompt-sizes", type=int, nargs="+", default=None)
    ap.add_argument("--cache-sizes", type=int, nargs="+", default=None)
    ap.add_argument("--repeats", type=int, default=None)
    args = ap.parse_args(argv)
    result = common.setup(args)
    model = args.model or (None if args.quick else common.QWEN)
    prompt_sizes = args.prompt_sizes or ([16, 64, 256] if args.quick else FULL_SIZES)
    cache_sizes = args.cache_sizes or ([16, 256] if args.quick else FULL_SIZES)
    repeats = args.repeats or (2 if args.quick else 3)

    loaded = common.load(model, args.dtype)
    print(f"measuring {loaded.name} ({loaded.dtype_name}) ...", flush=True)
    prefill, decode = measure(loaded, prompt_sizes, cache_sizes, repeats, decode_steps=3 if args.quick else 8)
    result.update(model=loaded.name, dtype=loaded.dtype_name, prefill=prefill, decode=decode)

    table(["prompt P", "prefill ms", "ms / token", "tokens/s"],
          [[r["P"], ms(r["step_s"]), ms(r["per_token_s"], 2), f"{1 / r['per_token_s']:,.0f}"] for r in prefill],
          title=f"Prefill, one pass over P tokens ({loaded.name}, {loaded.dtype_name}, best of {repeats})")
    d0 = decode[0]["step_s"]
    table(["cache C", "decode step ms", "vs smallest C", "tokens/s"],
          [[r["C"], ms(r["step_s"]), f"{r['step_s'] / d0:.2f}x", f"{r['tokens_per_s']:.1f}"] for r in decode],
          title=f"Decode, one token against a cache of C tokens ({loaded.name}, {loaded.dtype_name})")

    ref_p = 256 if 256 in prompt_sizes else prompt_sizes[-1]
    per_token = next(r["per_token_s"] for r in prefill if r["P"] == ref_p)
    decode_min = min(r["step_s"] for r in decode)
    decode_at = next((r["step_s"] for r in decode if r["C"] == ref_p), decode_min)
    flat = decode[-1]["step_s"] / d0
    result["summary"] = {"reference_P": ref_p, "prefill_per_token_s": per_token, "decode_step_s": decode_at,
                         "decode_over_prefill_token": decode_at / per_token,
                         "decode_growth": flat, "cache_growth": decode[-1]["C"] / decode[0]["C"]}
    print(f"\nAt P = C = {ref_p}: a generated token costs {ms(decode_at)} ms, a prompt token {ms(per_token, 2)} ms "
          f"-> {decode_at / per_token:.0f}x. Decode step from C={decode[0]['C']} to {decode[-1]['C']} "
          f"({decode[-1]['C'] // decode[0]['C']}x more cache): x{flat:.2f}.")
    checks = {
        f"a prompt token (P={ref_p}) is cheaper than a decode step": (
            per_token < decode_min, f"{ms(per_token, 2)} ms/token vs {ms(decode_min)} ms/step (fastest C)",
            common.TIMING),
    }
    return common.finish(result, checks, args)


if __name__ == "__main__":
    main()
