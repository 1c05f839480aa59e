"""Prefill-sized GEMMs on quantized panels: bf16 tiles through oneDNN against the int8 GEMM (VNNI, AMX-INT8).

One prompt's worth of rows (--rows) through each projection of a decoder layer (Llama-3.2-1B's shapes, or
SmolLM2-135M's with --model 135m), the weights int4 with a scale and a bias per 32 (llama.cpp's Q4_1, random
values), bf16 activations; gate|up with the MLP's SiLU(gate) * up after it (the AMX GEMM computes it in its epilogue).
Rounds alternate the routes; the table shows each one's best time, the rate it
implies (2 M N K operations) and the speed-up over the bf16 tiles, and the relative error of each against
x @ dequantize(W)^T. The VNNI column needs AVX512-VNNI, the AMX one AMX-INT8 (each is left out elsewhere).

    python benchmarks/kernels/bench_quant_gemm.py [--model 1b|135m] [--rows 2048] [--rounds 5] [--threads 2]
"""

from __future__ import annotations

import sys

import torch

from pagedserve.benchmarks import common
from pagedserve.benchmarks.kernels.bench_dense_linear import best_us
from pagedserve.engine import cpu_kernels
from pagedserve.engine.quant.int4 import Int4Weight
from pagedserve.engine.quant.layouts import pack_nibbles

# (N, K) of a layer's fused q|k|v, o, gate|up and down projections
SHAPES = {"1b": {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)},
          "135m": {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}}


def q4_1(n: int, k: int, gen: torch.Generator) -> Int4Weight:
    """Random int4 codes with an fp16 scale and bias per 32, laid out in our panels."""
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scale = (torch.rand(n, k // 32, generator=gen) * 0.004 + 0.001).half()
    bias = (-8 * scale.float() + torch.randn(n, k // 32, generator=gen) * 0.002).half()
    w = Int4Weight(pack_nibbles(codes), scale, bias, "int4", 32)
    w.lay_out(torch.device("cpu"), "panels")
    return w


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(__doc__, rounds=5, baseline=False)
    ap.add_argument("--model", choices=sorted(SHAPES), default="1b")
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if not cpu_kernels.load():
        sys.exit("the C++ kernels did not build")
    engines = [e for e, has in (("VNNI", cpu_kernels.vnni_int8()), ("AMX", cpu_kernels.amx_int8())) if has]
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    rows, results = [], {}
    for name, (n, k) in SHAPES[args.model].items():
        w = q4_1(n, k, gen)
        w.column_max = w.column_absmax()
        x = torch.randn(args.rows, k, generator=gen).bfloat16()
        gated = name == "gate_up"  # with the MLP's SiLU(gate) * up, as the model runs it
        act = torch.ops.pagedserve.silu_and_mul if gated else (lambda y: y)
        paths = {"bf16 tiles": lambda w=w, x=x, act=act: act(w.gemm(x))}
        for e in engines:
            paths[e] = lambda w=w, x=x, g=gated, amx=e == "AMX": w.int8_gemm(x, silu_mul=g, amx=amx)
        best = best_us(args.rounds, paths, 1)
        ref = x.float() @ w.dequantize(torch.float32).t()
        if gated:
            gate, up = ref.chunk(2, dim=1)
            ref = torch.nn.functional.silu(gate) * up
        err = {p: ((fn().float() - ref).norm() / ref.norm()).item() for p, fn in paths.items()}
        ops = 2 * args.rows * n * k
        results[name] = {"shape": [n, k], "best_us": best, "rel_error": err}
        row = [name, f"{n}x{k}", f"{best['bf16 tiles'] / 1e3:.2f}", f"{ops / best['bf16 tiles'] / 1e6:.2f}",
               f"{err['bf16 tiles']:.1e}"]
        for e in engines:
            row += [f"{best[e] / 1e3:.2f}", f"{ops / best[e] / 1e6:.2f}", f"{err[e]:.1e}",
                    common.ratio(best["bf16 tiles"], best[e])]
        rows.append([name + (" + SiLU*up" if gated else "")] + row[1:])
    headers = ["projection", "N x K", "bf16 tiles ms", "TFLOP/s", "rel. error"]
    for e in engines:
        headers += [f"{e} ms", "TOPS", "rel. error", "speed-up"]
    text = common.table(headers, rows, f"{args.model} projections at {args.rows} rows, {args.threads} threads, best "
                        f"of {args.rounds} interleaved rounds; int8 GEMMs: {', '.join(engines) or 'none on this CPU'}")
    common.write_json(args.json, {"model": args.model, "rows": args.rows, "engines": engines, "results": results,
                                  "table": text})
    return 0


if __name__ == "__main__":
    sys.exit(main())
