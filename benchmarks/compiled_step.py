"""Compiled step vs eager: decode step time at batch 1 (TPOT) and at batch 64, fp32 and bf16; start-up cost.

One engine per dtype (bundled SmolLM2, compile on); eager steps are the same engine with its compiled
halves switched off, and the two alternate step by step, so machine load drifts hit both alike.

  batch 1:  one request, ~200-token prompt, each timed step decodes one token (scheduling + sampling in)
  batch 64: 64 requests of ~500 tokens decoding together. They share a 480-token prefix (prefilled once,
            then prefix-cache hits) so the set-up stays cheap on a small machine; shared K/V blocks are
            cache-friendlier than distinct ones, so the ratio is an upper bound, the ms saved are not.
  OpenMP keeps its default (spinning) wait policy, as a server runs: PASSIVE slows every small parallel
  region, compiled ones most.
  start-up: warm-up (compile) seconds in a fresh process with an empty inductor cache, then again with
            that cache (a restart), and each process's whole engine start, eager start for reference.

    flock /tmp/pagedserve-bench.lock python benchmarks/compiled_step.py [--quick] [--json out.json]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.machine import machine_header  # noqa: E402
from benchmarks.seed import common  # noqa: E402
from benchmarks.seed.common import ms  # noqa: E402
from engine.config import cpu_has_fast_bf16  # noqa: E402

STARTUP_WORKER = r"""
import json, sys, time
t0 = time.perf_counter()
from engine import LLMEngine, make_config
eng = LLMEngine(make_config(dtype=sys.argv[1], compile=sys.argv[2] == "1", device="cpu"))
print(json.dumps({"start_s": time.perf_counter() - t0, "compile_s": eng.runner.compile_s,
                  "compiled": eng.runner.halves is not None}))
"""


def alternate(eng, steps: int) -> tuple[list[float], list[float]]:
    """Time `steps` pairs of engine steps, eager then compiled; returns (eager times, compiled times)."""
    halves = eng.runner.halves
    eager, comp = [], []
    try:
        for _ in range(steps):
            eng.runner.halves = None
            eager.append(common.timed(eng.step))
            eng.runner.halves = halves
            comp.append(common.timed(eng.step))
    finally:
        eng.runner.halves = halves
    return eager, comp


def measure(dtype: str, batch: int, context: int, steps: int) -> dict:
    loaded = common.load(None, dtype)
    eng = common.engine(loaded, compile=True, num_blocks=common.blocks_for(batch * (context + 2 * steps + 40)),
                        max_num_seqs=max(batch, 1), max_num_batched_tokens=4096)
    if eng.runner.halves is None:
        raise SystemExit("the compiled step did not build (see the warning above)")
    ids = common.book_ids(loaded, context + batch * 16, offset=2000)
    prefix = ids[:context - 16]
    eng.add_request("prefix", prefix, common.greedy(1))
    common.run_all(eng)  # the shared prefix is computed once, then every request hits it
    for i in range(batch):
        eng.add_request(f"r{i}", prefix + ids[context + 16 * i:context + 16 * (i + 1)], common.greedy(2 * steps + 8))
    while any(s.num_output_tokens == 0 for s in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    alternate(eng, 2)  # warm-up
    eager, comp = alternate(eng, steps)
    common.run_all(eng)
    e, c = common.summary(eager), common.summary(comp)
    return {"dtype": loaded.dtype_name, "batch": batch, "context": context, "eager": e, "compiled": c,
            "speedup": e["min_s"] / c["min_s"]}


def startup(dtype: str) -> dict:
    """Fresh processes: eager, compiled with an empty inductor cache, compiled again (restart)."""
    def run(compile_on: bool, cache: str) -> dict:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, PYTHONPATH=REPO)
        out = subprocess.run([sys.executable, "-c", STARTUP_WORKER, dtype, "1" if compile_on else "0"], env=env,
                             capture_output=True, text=True, check=True, cwd=REPO)
        return json.loads(out.stdout.strip().splitlines()[-1])

    with tempfile.TemporaryDirectory(prefix="pagedserve-inductor-") as cache:
        return {"eager": run(False, cache), "first": run(True, cache), "restart": run(True, cache)}


def main(argv: list[str] | None = None) -> dict:
    ap = common.base_parser(__doc__)
    ap.add_argument("--steps", type=int, default=None, help="timed step pairs per measurement")
    ap.add_argument("--no-startup", action="store_true", help="skip the start-up processes")
    args = ap.parse_args(argv)
    result = common.setup(args)
    header = machine_header()
    print(header, flush=True)
    result["machine_header"] = header
    dtypes = ["float32"] + (["bfloat16"] if cpu_has_fast_bf16() else [])
    steps = args.steps or (4 if args.quick else 16)
    shapes = [(1, 200), (8, 100)] if args.quick else [(1, 200), (64, 500)]
    rows, runs = [], []
    for dtype in dtypes:
        for batch, context in shapes:
            r = measure(dtype, batch, context, steps)
            runs.append(r)
            rows.append([r["dtype"], batch, context, ms(r["eager"]["min_s"], 2), ms(r["compiled"]["min_s"], 2),
                         ms(r["eager"]["median_s"], 2), ms(r["compiled"]["median_s"], 2), f"{r['speedup']:.2f}x"])
            print(f"  {dtype} B={batch}: eager {ms(r['eager']['min_s'], 2)} ms, compiled "
                  f"{ms(r['compiled']['min_s'], 2)} ms", flush=True)
    result["steps"] = runs
    common.table(["dtype", "batch", "context", "eager ms", "compiled ms", "eager med", "compiled med", "speed-up"],
                 rows, title=f"Decode step, eager vs compiled (SmolLM2-135M, min / median of {steps} alternating)")
    checks = {f"compiled faster, {r['dtype']} B={r['batch']}": (r["speedup"] > 1.0, f"{r['speedup']:.2f}x",
                                                                 common.TIMING) for r in runs}
    if not args.no_startup:
        result["startup"] = {d: startup(d) for d in dtypes}
        common.table(["dtype", "eager start s", "first start s", "(compile s)", "restart s", "(compile s)"],
                     [[d, f"{s['eager']['start_s']:.1f}", f"{s['first']['start_s']:.1f}",
                       f"{s['first']['compile_s']:.1f}", f"{s['restart']['start_s']:.1f}",
                       f"{s['restart']['compile_s']:.1f}"] for d, s in result["startup"].items()],
                     title="Engine start in a fresh process (compile s: the compiled step's warm-up)")
        for d, s in result["startup"].items():
            checks[f"restart compiles faster, {d}"] = (s["restart"]["compile_s"] < s["first"]["compile_s"],
                                                       f"{s['first']['compile_s']:.1f}s -> "
                                                       f"{s['restart']['compile_s']:.1f}s", common.TIMING)
            checks[f"compiled in the start-up process, {d}"] = (s["first"]["compiled"] and s["restart"]["compiled"],
                                                                "built" if s["first"]["compiled"] else "not built")
    return common.finish(result, checks, args)


if __name__ == "__main__":
    main()
