"""Single-stream (batch 1) time per output token, this tree vs other source trees, same run.

Each tree runs in its own process (PYTHONPATH = the tree) through the offline API on the bundled model:
one ~200-token prose prompt, 128 greedy tokens ignoring EOS, best of --reps; TPOT = (E2E - TTFT) / (n - 1).

    flock /tmp/pagedserve-bench.lock python benchmarks/batch1_tpot.py --trees /work/main,. [--dtype auto]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.machine import machine_header  # noqa: E402

WORKER = r"""
import json, sys, time
from engine import LLM, SamplingParams
dtype, reps, words = sys.argv[1], int(sys.argv[2]), sys.argv[3]
llm = LLM(dtype=dtype)
params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
llm.generate([words], [SamplingParams(max_tokens=8, temperature=0.0)])  # warm-up
best = None
for _ in range(reps):
    t0 = time.monotonic()
    out = llm.generate([words], [params])[0]
    e2e = time.monotonic() - t0
    ttft = out.metrics.first_token_time - t0
    tpot = (e2e - ttft) / (len(out.token_ids) - 1)
    best = tpot if best is None else min(best, tpot)
print(json.dumps({"dtype": str(llm.engine.dtype), "backend": llm.engine.runner.backend.name, "tpot_ms": best * 1e3}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trees", default=".", help="comma-separated source trees; the first is the reference")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    from benchmarks import workloads

    words = " ".join(workloads.load_words()[1000:1150])
    print(machine_header(), flush=True)
    rows = []
    for tree in args.trees.split(","):
        tree = os.path.abspath(tree)
        out = subprocess.run([sys.executable, "-c", WORKER, args.dtype, str(args.reps), words], cwd=tree,
                             env=dict(os.environ, PYTHONPATH=tree), capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append({"tree": tree, **r})
        ratio = r["tpot_ms"] / rows[0]["tpot_ms"]
        print(f"{tree:40} dtype={args.dtype} -> {r['dtype']:15} backend {r['backend']:6} TPOT {r['tpot_ms']:7.2f} ms"
              f"  ({ratio:.2f}x of the first)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_header(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
