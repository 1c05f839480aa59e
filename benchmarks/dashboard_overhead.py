"""What watching the engine costs it: throughput with the live view's endpoint polled at 5 Hz vs not polled.

One `pagedserve serve` process (its defaults) serves the same offline-like workload (N requests at once over
/v1/completions; by default `pagedserve bench`'s random workload, fixed lengths, so every round does the same work;
`--workload prose` is serve_vs_offline.py's HTTP row) in interleaved rounds:
  no dashboard     nobody asks for /v1/engine/state;
  dashboard 5 Hz   another process polls GET /v1/engine/state every 200 ms for the whole run (as an open page does,
                   at a faster rate than the page's 4 Hz), reading each JSON document.
Medians over rounds; the spread of the no-dashboard rounds is the noise the difference is judged against. A last
table times the snapshot itself (engine/snapshot.py's `take`, what the engine thread does per poll) over a pool of
the server's size with every block held, in this process.

    python benchmarks/dashboard_overhead.py [--num-prompts 16] [--input-len 256] [--output-len 64] [--rounds 3]
        [--workload random|prose] [--control] [--dtype auto] [--json PATH]
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import tempfile

import httpx

from pagedserve.benchmarks import common
from pagedserve.benchmarks import serve as bench

POLL_PERIOD_S = 0.2  # 5 Hz


def cpu_flags() -> str:
    """The flags that pick the CPU kernels' paths (engine/machine.py reads them)."""
    from pagedserve.engine.machine import REPORTED_FLAGS, cpu

    have = cpu().flags
    return "?" if have is None else " ".join(f for f in REPORTED_FLAGS if f in have) or "none"


# The dashboard, in its own small process (httpx only: no torch import competing with the run): GETs the URL every
# PERIOD seconds, parsing each answer as the page does, says "ready" after the first, and stops when stdin closes.
POLLER = r"""
import json, sys, threading, time
import httpx
url, period = sys.argv[1], float(sys.argv[2])
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
n, latency, size = 0, 0.0, 0
with httpx.Client(timeout=30, trust_env=False) as c:
    next_at = time.monotonic()
    while not stop.is_set():
        t = time.perf_counter()
        r = c.get(url)
        r.raise_for_status()
        r.json()
        latency += time.perf_counter() - t
        size += len(r.content)
        n += 1
        if n == 1:
            print("ready", flush=True)
        next_at += period
        stop.wait(max(0.0, next_at - time.monotonic()))
print(json.dumps({"polls": n, "poll_ms": latency * 1e3 / n, "state_bytes": size / n}), flush=True)
"""


def run(url: str, args, path: str | None) -> dict:
    bench_args = bench.build_parser().parse_args(
        ["--base-url", url, "--endpoint", "completions", "--workload", args.workload, "--num-prompts",
         str(args.num_prompts), "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
         "--num-warmups", "1", "--no-progress"])
    poller = None
    if path:
        poller = subprocess.Popen([sys.executable, "-c", POLLER, url + path, str(POLL_PERIOD_S)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if poller.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the poller failed (exit {poller.wait()})")
    try:
        m = asyncio.run(bench.run_benchmark(bench_args))
    finally:
        polled = {"polls": 0, "poll_ms": 0.0, "state_bytes": 0.0}
        if poller is not None:
            out, _ = poller.communicate("", timeout=60)  # closing stdin stops it
            polled = json.loads(out.strip().splitlines()[-1])
    return {"output_tok_s": m["output_throughput"], "ttft_p50_ms": m["median_ttft_ms"],
            "tpot_p50_ms": m["median_tpot_ms"], "duration_s": m["duration"], **polled}


def snapshot_cost(num_blocks: int, block_size: int, num_seqs: int = 64) -> dict:
    """µs per `take` over a full pool: `num_seqs` running sequences holding every block between them."""
    from pagedserve.engine.block_manager import BlockManager
    from pagedserve.engine.config import SchedulerConfig
    from pagedserve.engine.sampling_params import SamplingParams
    from pagedserve.engine.scheduler import Scheduler
    from pagedserve.engine.sequence import Sequence, SequenceStatus
    from pagedserve.engine.snapshot import take

    bm = BlockManager(num_blocks, block_size)
    sched = Scheduler(SchedulerConfig(), bm)
    per = num_blocks // num_seqs
    for i in range(num_seqs):
        seq = Sequence(i, f"r{i}", list(range(i * 100_000, i * 100_000 + per * block_size - 1)),
                       SamplingParams(max_tokens=1), 1)
        bm.allocate(seq, seq.num_tokens)
        seq.status = SequenceStatus.RUNNING
        sched.running.append(seq)
    ms = common.times_ms(lambda: take(sched, 0, None), reps=7, warmup=2, min_s=0.05)
    return {"num_blocks": num_blocks, "num_seqs": num_seqs, "take_us": statistics.median(ms) * 1e3}


def main(argv: list[str] | None = None) -> dict:
    ap = common.parser(__doc__, rounds=3, baseline=False)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--workload", choices=["random", "prose"], default="random")
    ap.add_argument("--input-len", type=int, default=256, help="random workload: prompt tokens")
    ap.add_argument("--output-len", type=int, default=64, help="random workload: output tokens (EOS ignored)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--control", action="store_true", help="also a row polling /health at 5 Hz: the cost of any "
                    "request at that rate, without the snapshot")
    args = ap.parse_args(argv)
    print(f"CPU flags: {cpu_flags()}", flush=True)
    log = tempfile.TemporaryFile("w+")
    server, url = common.serve(None, ["--log-level", "warning", "--dtype", args.dtype], log, bound_s=600)
    try:
        kv = httpx.get(url + "/v1/engine/state", timeout=30, trust_env=False).json()["kv"]
        contestants = {"no dashboard": lambda: run(url, args, None),
                       "dashboard 5 Hz": lambda: run(url, args, "/v1/engine/state")}
        if args.control:
            contestants["/health 5 Hz"] = lambda: run(url, args, "/health")
        runs = common.interleaved(args.rounds, contestants)
    finally:
        common.stop(server)
        log.close()
    rows = {name: common.medians(r) for name, r in runs.items()}
    desc = "prose" if args.workload == "prose" else f"random {args.input_len}-in/{args.output_len}-out"
    base = [r["output_tok_s"] for r in runs["no dashboard"]]
    noise = (max(base) - min(base)) / statistics.median(base) if len(base) > 1 else None
    common.table(
        ["run", "out tok/s", "vs none", "min-max tok/s", "TTFT p50 ms", "TPOT p50 ms", "polls", "poll ms",
         "state kB"],
        [[name, f"{r['output_tok_s']:.1f}", common.ratio(r["output_tok_s"], rows["no dashboard"]["output_tok_s"]),
          f"{min(x['output_tok_s'] for x in runs[name]):.1f}-{max(x['output_tok_s'] for x in runs[name]):.1f}",
          f"{r['ttft_p50_ms']:.0f}", f"{r['tpot_p50_ms']:.1f}", f"{r['polls']:.0f}",
          f"{r['poll_ms']:.1f}" if r["polls"] else "-", f"{r['state_bytes'] / 1e3:.1f}" if r["polls"] else "-"]
         for name, r in rows.items()],
        f"{args.num_prompts} {desc} requests at once over /v1/completions, dtype {args.dtype}, {kv['num_blocks']} KV "
        f"blocks; median of {args.rounds} interleaved rounds; noise (no-dashboard spread) "
        f"{'-' if noise is None else f'{100 * noise:.1f} %'}; CPU flags: {cpu_flags()}")
    cost = snapshot_cost(kv["num_blocks"], kv["block_size"])
    common.table(["blocks", "sequences", "take µs", "engine-loop share at 5 Hz"],
                 [[cost["num_blocks"], cost["num_seqs"], f"{cost['take_us']:.0f}",
                   f"{100 * cost['take_us'] * 1e-6 / POLL_PERIOD_S:.3f} %"]],
                 "the snapshot the engine thread builds per poll (engine/snapshot.py `take`), every block held")
    result = {"cpu_flags": cpu_flags(), "workload": desc, "num_prompts": args.num_prompts, "dtype": args.dtype,
              "rows": [{"run": name, **r} for name, r in rows.items()], "rounds": runs,
              "noise": noise, "snapshot": cost}
    common.write_json(args.json, result)
    print(json.dumps(common.json_safe(result)), flush=True)
    return result


if __name__ == "__main__":
    main()
