"""Decode-sized quantized linears on the CPU: our int8 / int4 GEMVs vs our dense GEMV on the same matrices.

For every projection of SmolLM2's layer (30 copies each, so the weights stream from memory as in a real step,
not from cache) and the LM head, and for M = 1..max activation rows: the dense GEMV on the activation dtype's
weights (`dense_linear`, what `quantization=none` runs), `int8_linear` (per-row int8) and `int4_linear`
(group-wise int4). Rounds alternate the paths; the table shows each one's best time, the bytes per second its
weights imply, and the ratio to dense. At batch 1 a decode step's linears are these products, so the ratios
are what `quantization=int8/int4` can gain over `none` at most.

    flock /tmp/pagedserve-bench.lock python benchmarks/kernels/bench_quant_linear.py [--dtypes bfloat16,float32]
        [--group 64] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.kernels.bench_dense_linear import SMOLLM2  # noqa: E402
from benchmarks.machine import machine_header  # noqa: E402
from engine import cpu_kernels  # noqa: E402
from engine.quant.formats import Int4Weight, Int8Weight  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--ms", default="1,2,4")
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json")
    args = ap.parse_args()
    assert cpu_kernels.load(), "the C++ kernels did not build"
    print(machine_header(), flush=True)
    torch.manual_seed(0)
    rows = []
    totals: dict[tuple[str, int], dict[str, float]] = {}
    print(f"{'dtype':9} {'matrix':8} {'N x K':>11} {'M':>2} | {'dense':>17} | {'int8':>17} | {'int4':>17} | "
          f"int8/dense int4/dense")
    for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
        for name, (n, k) in SMOLLM2.items():
            copies = 1 if name == "lm_head" else args.layers
            ws = [torch.randn(n, k) * 0.02 for _ in range(copies)]
            dense = [w.to(dtype) for w in ws]
            q8 = [Int8Weight.quantize(w) for w in ws]
            q4 = [Int4Weight.quantize(w, args.group) for w in ws]
            for q in q8 + q4:
                q.prepare(torch.device("cpu"), dtype)
            del ws
            for m in map(int, args.ms.split(",")):
                x = torch.randn(m, k).to(dtype)
                paths = {
                    "dense": [lambda w=w: torch.ops.pagedserve.dense_linear(x, w, None) for w in dense],
                    "int8": [lambda q=q: q.matmul(x) for q in q8],
                    "int4": [lambda q=q: q.matmul(x) for q in q4],
                }
                nbytes = {"dense": dense[0].numel() * dense[0].element_size(), "int8": q8[0].nbytes,
                          "int4": q4[0].nbytes}
                best = {p: float("inf") for p in paths}
                for _ in range(args.rounds):
                    for p, fns in paths.items():
                        t0 = time.perf_counter()
                        for fn in fns:
                            fn()
                        best[p] = min(best[p], (time.perf_counter() - t0) / copies)
                cells = " | ".join(f"{best[p] * 1e6:7.1f}us {nbytes[p] / best[p] / 1e9:4.1f}GB/s" for p in paths)
                print(f"{str(dtype).removeprefix('torch.'):9} {name:8} {n:>5}x{k:<5} {m:>2} | {cells} | "
                      f"{best['int8'] / best['dense']:10.2f} {best['int4'] / best['dense']:9.2f}", flush=True)
                rows.append({"dtype": str(dtype), "matrix": name, "n": n, "k": k, "m": m,
                             **{f"{p}_us": best[p] * 1e6 for p in paths}})
                tot = totals.setdefault((str(dtype).removeprefix("torch."), m), {p: 0.0 for p in paths})
                for p in paths:  # one step's linears: 30 layers of each projection plus the LM head once
                    tot[p] += best[p] * (args.layers if name != "lm_head" else 1)
    print("\nper decode step (30 layers + LM head):")
    for (dt, m), tot in totals.items():
        print(f"  {dt:9} M={m}: dense {tot['dense'] * 1e3:6.2f} ms  int8 {tot['int8'] * 1e3:6.2f} ms "
              f"({tot['int8'] / tot['dense']:.2f}x)  int4 {tot['int4'] * 1e3:6.2f} ms ({tot['int4'] / tot['dense']:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_header(), "group": args.group, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
