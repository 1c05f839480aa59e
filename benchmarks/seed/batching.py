"""Batching: B requests decoding together share one read of the weights.

Each request holds a 64-token cache and the engine decodes one token for all B of them per step
(B = 1, 2, 4 ... 64). Throughput is B / step time; the latency each request sees per token is the
step time. Past the knee the step stops being memory-bound and becomes compute-bound: throughput
stops growing while latency keeps climbing. The chapter's model is Qwen2.5-0.5B; the full run uses
random weights at its shapes.

    python benchmarks/seed/batching.py [--quick] [--model random:qwen2.5-0.5b] [--json out.json]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see kv_cache.py

import numpy as np  # noqa: E402

from pagedserve.benchmarks.common import table  # noqa: E402
from pagedserve.benchmarks.seed import common  # noqa: E402
from pagedserve.benchmarks.seed.common import ms  # noqa: E402

FULL_BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256]  # past 64 to find the knee on a CPU


def measure(loaded: common.Loaded, batches: list[int], context: int, steps: int) -> list[dict]:
    top = max(batches)
    eng = common.engine(loaded, num_blocks=top * common.blocks_for(context + steps + 2, slack=1),
                        enable_prefix_caching=False, max_num_seqs=top,
                        max_num_batched_tokens=max(2048, top * context))
    prompts = [common.book_ids(loaded, context, offset=i * context) for i in range(top)]
    common.decode_times(eng, prompts[0], 2)  # warm-up
    rows = []
    for b in batches:
        times = common.batch_decode_times(eng, prompts[:b], steps)
        step = min(times)
        rows.append({"batch": b, "step_s": step, "step_median_s": float(np.median(times)), "tokens_per_s": b / step})
        print(f"  batch {b:>3}: step {ms(step)} ms, {b / step:.1f} tok/s", flush=True)
    base = rows[0]
    for r in rows:
        r["throughput_x"] = r["tokens_per_s"] / base["tokens_per_s"]
        r["latency_x"] = r["step_s"] / base["step_s"]
    return rows


def knee(rows: list[dict], gain: float = 1.25) -> int | None:
    """The first batch size after which doubling buys less than `gain` x throughput."""
    for a, b in zip(rows, rows[1:]):
        if b["batch"] == 2 * a["batch"] and b["tokens_per_s"] < gain * a["tokens_per_s"]:
            return a["batch"]
    return None


def main(argv: list[str] | None = None) -> dict:
    ap = common.base_parser(__doc__)
    ap.add_argument("--model", default=None,
                    help=f"default: {common.QWEN} (the chapter's shapes); --quick: the bundled SmolLM2")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batches", type=int, nargs="+", default=None)
    ap.add_argument("--context", type=int, default=64, help="tokens each request holds in its cache")
    ap.add_argument("--steps", type=int, default=None, help="timed decode steps per batch size")
    args = ap.parse_args(argv)
    result = common.setup(args)
    model = args.model or (None if args.quick else common.QWEN)
    batches = args.batches or ([1, 2, 4, 8] if args.quick else FULL_BATCHES)
    steps = args.steps or (3 if args.quick else 5)

    loaded = common.load(model, args.dtype)
    print(f"measuring {loaded.name} ({loaded.dtype_name}) ...", flush=True)
    rows = measure(loaded, batches, args.context, steps)
    k = knee(rows)
    result.update(model=loaded.name, dtype=loaded.dtype_name, context=args.context, rows=rows, knee=k)
    table(
        ["batch", "step ms", "tokens/s", "throughput x", "latency x"],
        [[r["batch"], ms(r["step_s"]), f"{r['tokens_per_s']:.1f}", f"{r['throughput_x']:.2f}",
          f"{r['latency_x']:.2f}"] for r in rows],
        title=f"Batch of B requests, each holding a {args.context}-token cache, decoding one token per step "
              f"({loaded.name}, {loaded.dtype_name}, best of {steps} steps)")
    if k is not None:
        print(f"knee: doubling past batch {k} buys < 1.25x throughput")
    by = {r["batch"]: r for r in rows}
    hi = max(b for b in batches if b <= 8) if any(b <= 8 for b in batches) else batches[-1]
    checks = {
        f"throughput at batch {hi} > batch {batches[0]}": (
            by[hi]["tokens_per_s"] > by[batches[0]]["tokens_per_s"],
            f"{by[hi]['tokens_per_s']:.1f} vs {by[batches[0]]['tokens_per_s']:.1f} tok/s "
            f"({by[hi]['throughput_x']:.2f}x; per-token latency {by[hi]['latency_x']:.2f}x)", common.TIMING),
    }
    return common.finish(result, checks, args)


if __name__ == "__main__":
    main()
