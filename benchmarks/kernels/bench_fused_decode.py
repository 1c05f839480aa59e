"""CPU decode step time by batch size, the fused decode layer vs the per-op path, one model load.

For each batch size B, B prose prompts are prefilled, then --steps decode steps are timed through the engine API,
once with the fused layer (engine/layers/fused_decode.py, engine/csrc/decode_layer.cpp: our GEMV throughout)
serving up to --fused-max rows, and once without it (the per-op path: oneDNN or F.linear past the dispatch
table's `dense_gemv_max_rows`, one Python call per op). Rounds alternate the two; the table shows each one's
median. This is what the dispatch table's `fused_decode_max_rows` (engine/layers/dispatch.py) rests on: where
fused stops being faster.

    python benchmarks/kernels/bench_fused_decode.py [--batches 2,3,4,6,8,12,16] [--dtype auto] [--rounds 3]
        [--json OUT]
"""

from __future__ import annotations

import itertools
import statistics
import sys

from pagedserve.benchmarks import common, workloads
from pagedserve.engine import LLM, SamplingParams


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
    ms = common.timed(lambda: [engine.step() for _ in range(steps)]) / steps * 1e3
    while engine.has_unfinished():
        engine.step()
    return ms


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(__doc__, rounds=3, baseline=False)
    ap.add_argument("--batches", default="2,3,4,6,8,12,16")
    ap.add_argument("--fused-max", type=int, default=16, help="rows the fused layer may take in the 'fused' runs")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args(argv)
    llm = LLM(dtype=args.dtype, max_num_seqs=256, kernel_policy=f"fused_decode_max_rows={args.fused_max}")
    engine, runner = llm.engine, llm.engine.runner
    fused = runner.fused
    if fused is None:
        sys.exit(f"no fused decode layer for this model on this machine (attention {runner.backend.name})")
    batches = [int(b) for b in args.batches.split(",")]
    layers = {"fused": fused, "per-op": None}
    calls = itertools.count()

    def contestant(b: int, name: str):
        def run() -> dict:
            runner.fused = layers[name]
            return {"ms": decode_ms(engine, b, args.steps, f"{next(calls)}-{b}-{name}")}
        return run

    runs = common.interleaved(args.rounds, {(b, name): contestant(b, name) for b in batches for name in layers},
                              log=lambda *a, **k: None)
    rows = []
    for b in batches:
        f, p = (statistics.median(r["ms"] for r in runs[(b, name)]) for name in layers)
        rows.append({"batch": b, "fused_ms": f, "per_op_ms": p})
    common.table(["B", "fused ms", "per-op ms", "fused/per-op"],
                 [[r["batch"], f"{r['fused_ms']:.1f}", f"{r['per_op_ms']:.1f}",
                   common.ratio(r["fused_ms"], r["per_op_ms"])] for r in rows],
                 f"dtype {engine.dtype}; decode step ms, median of {args.rounds} rounds")
    common.write_json(args.json, {"dtype": str(engine.dtype), "fused_max": args.fused_max, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
