"""HTTP serving vs the offline engine, this tree vs other commits (--baseline-ref), and the step-time target curve.

The same prose workload (64 requests at once, /v1/completions so the prompts are the offline run's) goes through
each row, in its own process with its tree's engine:
  offline         `LLM.generate` (benchmarks/offline_throughput.py's worker);
  HTTP            `python -m server.cli serve` (its defaults), loaded by `pagedserve bench` from this process;
  HTTP, max-step-ms=X   this tree's server for each X in --step-targets (0 = time budget off: the token budget only).
Each HTTP row starts its server, waits for /ready, runs the bench and stops the server; the CPU time of the
server's main thread (uvicorn's event loop: HTTP, SSE, metrics; the engine steps in its own thread) over the run is
shown beside it. Client and server share this machine's cores. Rounds alternate every row; medians are reported.

    python benchmarks/serve_vs_offline.py [--baseline-ref 25f1cf5] [--step-targets 0,250] [--num-prompts 64]
        [--dtype auto] [--rounds 1] [--json results/serve_vs_offline.json]
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time

from pagedserve.benchmarks import common, workloads
from pagedserve.benchmarks import serve as bench
from pagedserve.benchmarks.offline_throughput import run_offline


def main_thread_cpu_s(pid: int) -> float:
    """CPU seconds the process's main thread has used (Linux; 0 elsewhere)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_http(tree, serve_args: list[str], args) -> dict:
    """Start `tree`'s server, load it with the prose workload, stop it."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as log:
        server, url = common.serve(tree, ["--log-level", "warning", "--dtype", args.dtype, *serve_args], log,
                                   bound_s=600)
        try:
            startup = time.perf_counter() - t0
            bench_args = bench.build_parser().parse_args(
                ["--base-url", url, "--endpoint", "completions", "--workload", "prose", "--num-prompts",
                 str(args.num_prompts), "--num-warmups", "1", "--no-progress"]
                + (["--text", args.text] if args.text else []))
            cpu0 = main_thread_cpu_s(server.pid)
            m = asyncio.run(bench.run_benchmark(bench_args))
            loop_cpu = main_thread_cpu_s(server.pid) - cpu0
        finally:
            common.stop(server)
    return {"startup_s": startup, "output_tok_s": m["output_throughput"], "ttft_p50_ms": m["median_ttft_ms"],
            "ttft_p99_ms": m["p99_ttft_ms"], "tpot_p50_ms": m["median_tpot_ms"], "tpot_p99_ms": m["p99_tpot_ms"],
            "event_loop_cpu_s": loop_cpu, "duration_s": m["duration"]}


def main(argv: list[str] | None = None) -> dict:
    ap = common.parser(__doc__, rounds=1)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--text", default=None)
    ap.add_argument("--step-targets", default="", help="max-step-ms values for extra HTTP rows of this tree")
    args = ap.parse_args(argv)
    reqs = workloads.prose(args.num_prompts, text_path=args.text)
    prompts, max_tokens = [r.prompt for r in reqs], [r.max_tokens for r in reqs]
    model_args = ["--model", args.model] if args.model else []

    def offline(tree):
        def run() -> dict:
            r = run_offline(tree, args.model, prompts, max_tokens, dtype=args.dtype)
            return {"output_tok_s": r["output_tok_s"], "ttft_p50_ms": r["ttft_p50_s"] * 1e3}
        return run

    contestants = {}
    for label, tree in common.trees(args.baseline_ref).items():
        contestants[(label, "offline")] = offline(tree)
        contestants[(label, "HTTP")] = lambda tree=tree: run_http(tree, model_args, args)
    for x in filter(None, args.step_targets.split(",")):
        contestants[("this", f"HTTP, max-step-ms={x}")] = lambda x=x: run_http(None, [*model_args, "--max-step-ms",
                                                                                      x], args)
    runs = common.interleaved(args.rounds, contestants)
    rows = {key: common.medians(rounds) for key, rounds in runs.items()}
    bases = [common.commit_of(ref) for ref in args.baseline_ref]

    def cell(r: dict, key: str, fmt: str) -> str:
        return "-" if r.get(key) is None else format(r[key], fmt)

    common.table(
        ["tree", "path", "out tok/s", "vs offline"] + [f"vs {b}" for b in bases]
        + ["TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms", "loop CPU %", "start s"],
        [[label, path, f"{r['output_tok_s']:.1f}", common.ratio(r["output_tok_s"],
                                                                rows[(label, "offline")]["output_tok_s"])]
         + [common.ratio(r["output_tok_s"], rows[(b, path)]["output_tok_s"]) if (b, path) in rows else "-"
            for b in bases]
         + [cell(r, "ttft_p50_ms", ".0f"), cell(r, "ttft_p99_ms", ".0f"), cell(r, "tpot_p50_ms", ".0f"),
            cell(r, "tpot_p99_ms", ".0f"),
            "-" if "event_loop_cpu_s" not in r else f"{100 * r['event_loop_cpu_s'] / r['duration_s']:.1f}",
            cell(r, "startup_s", ".1f")]
         for (label, path), r in rows.items()],
        f"{args.num_prompts} prose requests at once, dtype {args.dtype}; median of {args.rounds} rounds; "
        "loop CPU: the server's event-loop thread, % of one core over the run")
    result = {"rows": [{"tree": label, "path": path, **r} for (label, path), r in rows.items()]}
    common.write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
