"""Decode-sized quantized linears on the CPU: int8 / int4 projections vs our dense GEMV on the same matrices.

For every projection of SmolLM2's layer (30 copies each, so the weights stream from memory as in a real step, not
from cache) and the LM head, and for M = 1..max activation rows: the dense GEMV on the activation dtype's weights
(`dense_linear`), and an `engine.layers.linear.Linear` holding the per-row int8 and the group-wise int4 weight
(`quantize_to` + `select_kernels` with this machine's dispatch table: what `quantization=int8/int4` runs). Rounds
alternate the paths; the table shows each one's best time, the bytes per second its weights imply, and the ratio
to dense. At batch 1 a decode step's linears are these products, so the ratios are what `quantization=int8/int4`
can gain over `none` at most.

    python benchmarks/kernels/bench_quant_linear.py [--dtypes bfloat16,float32] [--ms 1,2,4] [--group 64] [--json OUT]
"""

from __future__ import annotations

import sys

import torch

from pagedserve.benchmarks import common
from pagedserve.benchmarks.kernels.bench_dense_linear import SMOLLM2, best_us
from pagedserve.engine import cpu_kernels
from pagedserve.engine.layers.dispatch import kernel_table
from pagedserve.engine.layers.linear import Linear
from pagedserve.engine.quant.int4 import Int4Weight
from pagedserve.engine.quant.int8 import Int8Weight

CPU = torch.device("cpu")


def quantized(w: torch.Tensor, qweight, table, dtype: torch.dtype) -> Linear:
    lin = Linear(w.shape[1], w.shape[0])
    lin.quantize_to(qweight)
    lin.select_kernels(table, CPU, dtype)
    return lin


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(__doc__, rounds=7, baseline=False)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--ms", default="1,2,4")
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--layers", type=int, default=30)
    args = ap.parse_args(argv)
    if not cpu_kernels.load():
        sys.exit("the C++ kernels did not build")
    torch.manual_seed(0)
    rows = []
    totals: dict[tuple[str, int], dict[str, float]] = {}
    print(common.machine_header())
    print(f"{'dtype':9} {'matrix':8} {'N x K':>11} {'M':>2} | {'dense':>17} | {'int8':>17} | {'int4':>17} | "
          f"int8/dense int4/dense", flush=True)
    for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
        table = kernel_table(CPU, dtype)
        for name, (n, k) in SMOLLM2.items():
            copies = 1 if name == "lm_head" else args.layers
            ws = [torch.randn(n, k) * 0.02 for _ in range(copies)]
            dense = [w.to(dtype) for w in ws]
            q8 = [quantized(w, Int8Weight.quantize(w), table, dtype) for w in ws]
            q4 = [quantized(w, Int4Weight.quantize(w, args.group), table, dtype) for w in ws]
            del ws
            nbytes = {"dense": dense[0].numel() * dense[0].element_size(), "int8": q8[0].qweight.nbytes,
                      "int4": q4[0].qweight.nbytes}
            for m in map(int, args.ms.split(",")):
                x = torch.randn(m, k).to(dtype)
                paths = {
                    "dense": lambda x=x, dense=dense: [torch.ops.pagedserve.dense_linear(x, w, None) for w in dense],
                    "int8": lambda x=x, q8=q8: [lin(x) for lin in q8],
                    "int4": lambda x=x, q4=q4: [lin(x) for lin in q4],
                }
                best = best_us(args.rounds, paths, copies)
                cells = " | ".join(f"{best[p]:7.1f}us {nbytes[p] / best[p] / 1e3:4.1f}GB/s" for p in paths)
                print(f"{str(dtype).removeprefix('torch.'):9} {name:8} {n:>5}x{k:<5} {m:>2} | {cells} | "
                      f"{best['int8'] / best['dense']:10.2f} {best['int4'] / best['dense']:9.2f}", flush=True)
                rows.append({"dtype": str(dtype), "matrix": name, "n": n, "k": k, "m": m,
                             "routes": {p: lins[0].describe_routes() for p, lins in (("int8", q8), ("int4", q4))},
                             **{f"{p}_us": best[p] for p in paths}})
                tot = totals.setdefault((str(dtype).removeprefix("torch."), m), {p: 0.0 for p in paths})
                for p in paths:  # one step's linears: every layer's projections plus the LM head once
                    tot[p] += best[p] * (args.layers if name != "lm_head" else 1)
    print(f"\nper decode step ({args.layers} layers + LM head):")
    for (dt, m), tot in totals.items():
        print(f"  {dt:9} M={m}: dense {tot['dense'] / 1e3:6.2f} ms  int8 {tot['int8'] / 1e3:6.2f} ms "
              f"({tot['int8'] / tot['dense']:.2f}x)  int4 {tot['int4'] / 1e3:6.2f} ms "
              f"({tot['int4'] / tot['dense']:.2f}x)")
    common.write_json(args.json, {"group": args.group, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
