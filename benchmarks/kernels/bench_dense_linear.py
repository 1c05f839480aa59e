"""Decode-sized dense linears on the CPU: our GEMV (engine/csrc/dense_linear.cpp) vs the library paths.

For every projection of a model's layer (30 copies each, so the weights stream from memory as in a real step, not
from cache) and the LM head, and for M = 1..max activation rows: `F.linear` on the plain weight, oneDNN's prepacked
linear (what bf16 uses on a CPU with native bf16), and ours. Rounds alternate the three and the table shows each
one's best (least disturbed) time and the bytes per second it implies.

    python benchmarks/kernels/bench_dense_linear.py [--dtypes float32,bfloat16] [--ms 1,2,4,8] [--rounds 7] [--json OUT]
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from pagedserve.benchmarks import common
from pagedserve.engine import cpu_kernels

SMOLLM2 = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def best_us(rounds: int, paths: dict, copies: int) -> dict[str, float]:
    """Each path's best time per copy over interleaved rounds, in us."""
    runs = common.interleaved(rounds, {p: lambda fn=fn: {"s": common.timed(fn)} for p, fn in paths.items()},
                              log=lambda *a, **k: None)
    return {p: min(r["s"] for r in rs) / copies * 1e6 for p, rs in runs.items()}


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(__doc__, rounds=7, baseline=False)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--ms", default="1,2,4,8")
    ap.add_argument("--layers", type=int, default=30)
    args = ap.parse_args(argv)
    if not cpu_kernels.load():
        sys.exit("the C++ kernels did not build")
    torch.manual_seed(0)
    rows = []
    print(common.machine_header())
    print(f"{'dtype':9} {'matrix':8} {'N x K':>11} {'M':>3} | {'F.linear':>16} | {'oneDNN packed':>16} | "
          f"{'ours':>16} | ours vs best other", flush=True)
    for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
        for name, (n, k) in SMOLLM2.items():
            copies = 1 if name == "lm_head" else args.layers
            ws = [torch.randn(n, k).to(dtype) for _ in range(copies)]
            packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in ws]
            for m in map(int, args.ms.split(",")):
                x = torch.randn(m, k).to(dtype)
                paths = {
                    "F.linear": lambda x=x, ws=ws: [F.linear(x, w) for w in ws],
                    "oneDNN packed": lambda x=x, packed=packed: [
                        torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in packed],
                    "ours": lambda x=x, ws=ws: [torch.ops.pagedserve.dense_linear(x, w, None) for w in ws],
                }
                best = best_us(args.rounds, paths, copies)
                nbytes = n * k * ws[0].element_size()
                cells = " | ".join(f"{best[p]:7.1f} us {nbytes / best[p] / 1e3:4.1f}GB/s" for p in paths)
                other = min(best["F.linear"], best["oneDNN packed"])
                print(f"{str(dtype).removeprefix('torch.'):9} {name:8} {n:>5}x{k:<5} {m:>3} | {cells} | "
                      f"{best['ours'] / other:.2f}x", flush=True)
                rows.append({"dtype": str(dtype), "matrix": name, "n": n, "k": k, "m": m,
                             **{f"{p}_us": best[p] for p in paths}})
    common.write_json(args.json, {"rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
