"""Decode-sized dense linears on the CPU: our GEMV (engine/csrc/dense_linear.cpp) vs the library paths.

For every projection of a model's layer (30 copies each, so the weights stream from memory as in a real
step, not from cache) and the LM head, and for M = 1..max activation rows: `F.linear` on the plain weight,
oneDNN's prepacked linear (what bf16 uses on a CPU with native bf16), and ours. Rounds alternate the three
and the table shows each one's best (lowest) time and the bytes per second it implies.

    flock /tmp/pagedserve-bench.lock python benchmarks/kernels/bench_dense_linear.py [--dtypes float32,bfloat16] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.machine import machine_header  # noqa: E402
from engine import cpu_kernels  # noqa: E402

SMOLLM2 = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--ms", default="1,2,4,8")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json")
    args = ap.parse_args()
    assert cpu_kernels.load(), "the C++ kernels did not build"
    print(machine_header(), flush=True)
    torch.manual_seed(0)
    rows = []
    print(f"{'dtype':9} {'matrix':8} {'N x K':>11} {'M':>3} | {'F.linear':>16} | {'oneDNN packed':>16} | {'ours':>16} | ours vs best other")
    for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
        for name, (n, k) in SMOLLM2.items():
            copies = 1 if name == "lm_head" else args.layers
            ws = [torch.randn(n, k).to(dtype) for _ in range(copies)]
            packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in ws]
            for m in map(int, args.ms.split(",")):
                x = torch.randn(m, k).to(dtype)
                paths = {
                    "F.linear": lambda w, p: F.linear(x, w),
                    "oneDNN packed": lambda w, p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""),
                    "ours": lambda w, p: torch.ops.pagedserve.dense_linear(x, w, None),
                }
                best = {p: float("inf") for p in paths}
                for _ in range(args.rounds):
                    for p, fn in paths.items():
                        t0 = time.perf_counter()
                        for w, pk in zip(ws, packed):
                            fn(w, pk)
                        best[p] = min(best[p], (time.perf_counter() - t0) / copies)
                nbytes = n * k * ws[0].element_size()
                cells = " | ".join(f"{best[p] * 1e6:7.1f} us {nbytes / best[p] / 1e9:4.1f}GB/s" for p in paths)
                other = min(best["F.linear"], best["oneDNN packed"])
                print(f"{str(dtype).removeprefix('torch.'):9} {name:8} {n:>5}x{k:<5} {m:>3} | {cells} | "
                      f"{best['ours'] / other:.2f}x", flush=True)
                rows.append({"dtype": str(dtype), "matrix": name, "n": n, "k": k, "m": m,
                             **{f"{p}_us": best[p] * 1e6 for p in paths}})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_header(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
