"""Static vs continuous batching: the chapter's simulation, and the same workload run for real.

64 requests, all arriving at once, with skewed output lengths -- median 18, longest 231, total 1,874
(a deterministic list built to hit exactly those three statistics) -- and 8 slots.

Simulation (the chapter's method), at a per-step cost measured on the engine (one decode step with
8 sequences):
  static:     requests are taken 8 at a time in arrival order; a batch runs until its longest member
              is done, finished members keep their slot as padding, and everyone hears back when the
              batch ends;
  continuous: a slot freed by a finished request takes the next queued request at the next step.

Real run: the same output lengths (EOS ignored) on prose prompts from the book, through LLMEngine
with policy="static" (a new batch is admitted only when the previous one has fully drained) and
policy="continuous", max_num_seqs=8. Latency = finish - arrival, per request.

    python benchmarks/seed/static_vs_continuous.py [--quick] [--model PATH] [--json out.json]
"""

from __future__ import annotations

import math
import os
import random
import statistics
from statistics import NormalDist

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see kv_cache.py

from pagedserve.benchmarks.common import table, timed  # noqa: E402
from pagedserve.benchmarks.seed import common  # noqa: E402
from pagedserve.benchmarks.seed.common import ms  # noqa: E402

CHAPTER = dict(n=64, median=18, longest=231, total=1874)
QUICK = dict(n=24, median=6, longest=40, total=240)


def make_lengths(n: int, median: int, longest: int, total: int, seed: int = 0) -> list[int]:
    """n output lengths with exactly this median, maximum and sum, in a deterministic shuffled order.

    Log-normal quantiles around the median, with the spread chosen (bisection) to come close to the
    total; the middle value(s) are then pinned to the median, the largest to `longest`, and the sum is
    corrected one token at a time on the upper (then lower) half without crossing the median.
    """
    z = [NormalDist().inv_cdf((i + 0.5) / n) for i in range(n)]

    def base(sigma: float) -> list[int]:
        v = [max(1, min(longest, round(median * math.exp(sigma * zi)))) for zi in z]
        v[-1] = longest
        return v

    lo, hi = 0.0, 5.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(base(mid)) < total else (lo, mid)
    v = base((lo + hi) / 2)
    h = n // 2
    mids = [h - 1, h] if n % 2 == 0 else [h]
    for i in mids:
        v[i] = median
    for i in range(mids[0]):
        v[i] = min(v[i], median)
    for i in range(mids[-1] + 1, n - 1):
        v[i] = max(v[i], median)
    diff = total - sum(v)
    upper = list(range(n - 2, mids[-1], -1))  # largest first; the maximum itself stays put
    lower = list(range(mids[0] - 1, -1, -1))
    while diff:
        moved = False
        for i in upper + lower if diff < 0 else upper:
            floor = median if i > mids[-1] else 1
            if diff > 0 and v[i] < longest:
                v[i] += 1
                diff -= 1
                moved = True
            elif diff < 0 and v[i] > floor:
                v[i] -= 1
                diff += 1
                moved = True
            if not diff:
                break
        if not moved:
            raise ValueError(f"no list of {n} lengths has median {median}, max {longest} and total {total}")
    v.sort()
    random.Random(seed).shuffle(v)
    assert statistics.median(v) == median and max(v) == longest and sum(v) == total
    return v


def simulate(lengths: list[int], slots: int, step_s: float) -> dict:
    """Both policies at a constant cost per step; every request arrives at t = 0."""
    # static: fixed groups in arrival order, returned together when the longest member is done
    t, lat_static, in_slot_static = 0, [], []
    for i in range(0, len(lengths), slots):
        group = lengths[i:i + slots]
        t += max(group)
        lat_static += [t] * len(group)
        in_slot_static += [max(group)] * len(group)
    static_steps = t
    # continuous: a freed slot is refilled from the queue at the next step
    queue, active, step, done = list(enumerate(lengths)), {}, 0, {}
    start = {}
    while queue or active:
        while queue and len(active) < slots:
            i, n = queue.pop(0)
            active[i] = n
            start[i] = step
        step += 1
        for i in list(active):
            active[i] -= 1
            if active[i] == 0:
                done[i] = step
                del active[i]
    total = sum(lengths)
    out = {}
    for name, steps, lat, in_slot in (
            ("static", static_steps, lat_static, in_slot_static),
            ("continuous", step, list(done.values()), [done[i] - start[i] for i in done])):
        out[name] = {"steps": steps, "time_s": steps * step_s, "tokens_per_s": total / (steps * step_s),
                     "mean_latency_s": statistics.mean(lat) * step_s,
                     "mean_in_slot_s": statistics.mean(in_slot) * step_s}
    out["throughput_ratio"] = out["continuous"]["tokens_per_s"] / out["static"]["tokens_per_s"]
    out["latency_ratio"] = out["static"]["mean_latency_s"] / out["continuous"]["mean_latency_s"]
    # mixed definitions: static from arrival (queue + padding), continuous in its slot only (no queue)
    out["latency_ratio_static_vs_continuous_in_slot"] = (out["static"]["mean_latency_s"]
                                                         / out["continuous"]["mean_in_slot_s"])
    return out


def run_engine(loaded: common.Loaded, policy: str, prompts: list[list[int]], lengths: list[int], slots: int) -> dict:
    eng = common.engine(loaded, policy=policy, max_num_seqs=slots, enable_prefix_caching=False,
                        num_blocks=slots * common.blocks_for(max(map(len, prompts)) + max(lengths), slack=1) + 8)
    eng.add_request("warm", prompts[0][:16], common.greedy(3))  # warm-up
    common.run_all(eng)
    res: dict[str, dict] = {}
    steps = 0

    def run() -> None:
        nonlocal steps
        for i, (ids, n) in enumerate(zip(prompts, lengths)):
            eng.add_request(f"r{i}", ids, common.greedy(n))
        while eng.has_unfinished():
            steps += 1
            for out in eng.step():
                r = res.setdefault(out.request_id, {"tokens": 0})
                r["tokens"] += len(out.new_token_ids)
                if out.finished:
                    r["metrics"] = out.metrics

    wall = timed(run)
    tokens = sum(r["tokens"] for r in res.values())
    assert tokens == sum(lengths), (tokens, sum(lengths))
    lat = [r["metrics"].finish_time - r["metrics"].arrival_time for r in res.values()]
    ttft = [r["metrics"].ttft for r in res.values()]
    return {"policy": policy, "steps": steps, "wall_s": wall, "output_tokens": tokens, "tokens_per_s": tokens / wall,
            "mean_latency_s": statistics.mean(lat), "p50_latency_s": statistics.median(lat),
            "max_latency_s": max(lat), "mean_ttft_s": statistics.mean(ttft)}


def main(argv: list[str] | None = None) -> dict:
    ap = common.base_parser(__doc__)
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0, help="arrival order of the lengths, and prompt choice")
    ap.add_argument("--skip-engine", action="store_true", help="only the simulation")
    args = ap.parse_args(argv)
    result = common.setup(args)
    spec = QUICK if args.quick else CHAPTER
    lengths = make_lengths(**spec, seed=args.seed)
    result["workload"] = {**spec, "lengths": lengths, "slots": args.slots}
    print(f"output lengths ({spec['n']} requests): median {statistics.median(lengths):g}, longest {max(lengths)}, "
          f"total {sum(lengths):,}\n{lengths}")

    loaded = common.load(args.model, args.dtype)
    rng = random.Random(args.seed)
    lo, hi = (16, 32) if args.quick else (24, 96)
    prompts = [common.book_ids(loaded, rng.randint(lo, hi), offset=rng.randrange(0, 20000)) for _ in lengths]

    # the per-step cost: one decode step with all slots busy
    eng = common.engine(loaded, max_num_seqs=args.slots, enable_prefix_caching=False,
                        num_blocks=args.slots * common.blocks_for(hi + 16, slack=1))
    step_times = common.batch_decode_times(eng, prompts[:args.slots], 4 if args.quick else 8)
    step_s = min(step_times)
    del eng
    sim = simulate(lengths, args.slots, step_s)
    result["simulation"] = {"step_s": step_s, **sim}
    table(
        ["policy", "steps", "time s", "tokens/s", "mean latency s", "mean time in slot s"],
        [[p, sim[p]["steps"], f"{sim[p]['time_s']:.2f}", f"{sim[p]['tokens_per_s']:.1f}",
          f"{sim[p]['mean_latency_s']:.2f}", f"{sim[p]['mean_in_slot_s']:.2f}"] for p in ("static", "continuous")],
        title=f"Simulation: {spec['n']} requests, {args.slots} slots, {ms(step_s)} ms per step (measured: one "
              f"{args.slots}-sequence decode step, {loaded.name}, {loaded.dtype_name}). Continuous: "
              f"{sim['throughput_ratio']:.2f}x throughput, mean latency / {sim['latency_ratio']:.1f}")

    print(f"(static mean latency / continuous mean time in slot, i.e. not counting continuous's queue wait: "
          f"{sim['latency_ratio_static_vs_continuous_in_slot']:.1f}x)")
    checks = {
        "simulation: continuous beats static on throughput and mean latency": (
            sim["throughput_ratio"] > 1 and sim["latency_ratio"] > 1,
            f"throughput x{sim['throughput_ratio']:.2f}, mean latency / {sim['latency_ratio']:.2f}"),
    }
    if not args.skip_engine:
        runs = {}
        for policy in ("static", "continuous"):
            print(f"running the workload through the engine, policy={policy} ...", flush=True)
            runs[policy] = run_engine(loaded, policy, prompts, lengths, args.slots)
        s, c = runs["static"], runs["continuous"]
        ratios = {"throughput": c["tokens_per_s"] / s["tokens_per_s"],
                  "mean_latency": s["mean_latency_s"] / c["mean_latency_s"]}
        result["engine"] = {"model": loaded.name, "dtype": loaded.dtype_name, **runs, "ratios": ratios}
        table(
            ["policy", "engine steps", "wall s", "out tokens", "tokens/s", "mean latency s", "p50 latency s",
             "mean TTFT s"],
            [[p, r["steps"], f"{r['wall_s']:.2f}", r["output_tokens"], f"{r['tokens_per_s']:.1f}",
              f"{r['mean_latency_s']:.2f}", f"{r['p50_latency_s']:.2f}", f"{r['mean_ttft_s']:.2f}"]
             for p, r in runs.items()],
            title=f"Engine, for real ({loaded.name}, {loaded.dtype_name}, max_num_seqs={args.slots}): continuous "
                  f"{ratios['throughput']:.2f}x throughput, mean latency / {ratios['mean_latency']:.2f}")
        checks["engine: continuous throughput >= static"] = (
            c["tokens_per_s"] >= s["tokens_per_s"],
            f"{c['tokens_per_s']:.1f} vs {s['tokens_per_s']:.1f} tok/s ({c['steps']} vs {s['steps']} steps)",
            common.TIMING)
    return common.finish(result, checks, args)


if __name__ == "__main__":
    main()
