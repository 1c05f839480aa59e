"""CPU decode step time by batch size, the fused decode layer vs the per-op path, one model load.

For each batch size B, B prose prompts are prefilled, then --steps decode steps are timed through the
engine API, once with the fused layer serving up to --fused-max rows (engine/csrc/decode_layer.cpp, our
GEMV throughout) and once with it off (the per-op path: oneDNN past DENSE_GEMV_MAX_M rows, one Python call
per op). Rounds alternate the two; the table shows each one's median. This is how FUSED_DENSE_MAX_M
(engine/models/llama.py) was chosen: where fused stops being faster.

    flock /tmp/pagedserve-bench.lock python benchmarks/kernels/bench_fused_decode.py [--batches 2,3,4,6,8,12,16]
        [--dtype auto] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks import workloads  # noqa: E402
from benchmarks.machine import machine_header  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.models import llama  # noqa: E402


def decode_ms(engine, batch: int, steps: int, tag: str) -> float:
    """Mean ms of `steps` decode steps at `batch` running sequences (prompts prefilled first)."""
    for i, r in enumerate(workloads.prose(batch, seed=batch)):
        engine.add_request(f"{tag}-{i}", r.prompt, SamplingParams(max_tokens=steps + 8, temperature=0.0,
                                                                  ignore_eos=True))
    while engine.num_waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running):
        engine.step()
    for _ in range(3):
        engine.step()
    assert len(engine.scheduler.running) == batch
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    ms = (time.perf_counter() - t0) / steps * 1e3
    while engine.has_unfinished():
        engine.step()
    return ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="2,3,4,6,8,12,16")
    ap.add_argument("--fused-max", type=int, default=16, help="rows the fused layer may take in the 'fused' runs")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    print(machine_header(), flush=True)
    llm = LLM(dtype=args.dtype, max_num_seqs=256)
    engine, model = llm.engine, llm.engine.runner.model
    batches = [int(b) for b in args.batches.split(",")]
    limits = {"fused": args.fused_max, "per-op": 0}
    times: dict[tuple[int, str], list[float]] = {}
    for rnd in range(args.rounds):
        for b in batches:
            for name, limit in limits.items():
                llama.FUSED_DENSE_MAX_M = limit
                model.reset_fused()
                times.setdefault((b, name), []).append(decode_ms(engine, b, args.steps, f"{rnd}-{b}-{name}"))
    print(f"\ndtype {engine.dtype}; decode step ms, median of {args.rounds} rounds")
    print(f"{'B':>4} {'fused':>9} {'per-op':>9} {'fused/per-op':>13}")
    rows = []
    for b in batches:
        f, p = statistics.median(times[(b, "fused")]), statistics.median(times[(b, "per-op")])
        rows.append({"batch": b, "fused_ms": f, "per_op_ms": p})
        print(f"{b:>4} {f:>9.1f} {p:>9.1f} {f / p:>12.2f}x")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"dtype": str(engine.dtype), "rows": rows}, fh, indent=2)


if __name__ == "__main__":
    main()
