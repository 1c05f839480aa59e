"""Batch-1 GEMVs on GGUF block types as our panels hold them, with the weights streaming from memory.

For each type, --copies copies of a 1B model's largest projection (5632x2048, random blocks as
benchmarks/gguf_quants.py writes them), laid out for our kernels; one timed pass multiplies one activation row by
every copy in turn, so each matrix comes from memory as in a decode step, not from cache. Also Q4_K_M's fused
q/k/v of a layer that keeps attn_v in Q6_K (held as 6-bit codes). Rounds alternate the types; the table shows
each one's best time per matrix, the bytes per second its weights imply and the time per weight.

    python benchmarks/kernels/bench_gguf_gemv.py [--types Q4_0,Q4_K,Q6_K,Q8_0] [--copies 24] [--threads 2]
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from pagedserve.benchmarks import common
from pagedserve.benchmarks.gguf_quants import random_blocks
from pagedserve.benchmarks.kernels.bench_dense_linear import best_us
from pagedserve.engine import cpu_kernels
from pagedserve.engine.quant import formats
from pagedserve.engine.quant.gguf_blocks import GGUFBlocks

CPU = torch.device("cpu")


def storage(kind: str, n: int, k: int, rng: np.random.Generator):
    """Random `kind` blocks as our storage (not yet laid out)."""
    return GGUFBlocks(kind, random_blocks(kind, n, k, rng), (n, k)).storage()


def panels(w):
    """`w` laid out in our kernels' panels."""
    w.lay_out(CPU, "panels")
    return w


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(__doc__, rounds=5, baseline=False)
    ap.add_argument("--types", default="Q4_0,Q4_K,Q6_K,Q8_0")
    ap.add_argument("--copies", type=int, default=24, help="matrices per type (together well beyond the caches)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if not cpu_kernels.load():
        sys.exit("the C++ kernels did not build")
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    shape = (5632, 2048)
    sets = {t: [panels(storage(t, *shape, rng)) for _ in range(args.copies)] for t in args.types.split(",")}
    sets["Q4_K_M q/k/v + Q6_K v"] = [
        panels(formats.cat([storage(t, n, 2048, rng) for t, n in (("Q4_K", 2048), ("Q4_K", 256), ("Q6_K", 256))]))
        for _ in range(args.copies)]
    x = torch.randn(1, shape[1], dtype=torch.bfloat16)
    best = best_us(args.rounds, {t: lambda ws=ws: [w.gemv(x) for w in ws] for t, ws in sets.items()}, args.copies)
    rows = []
    for t, ws in sets.items():
        n, k = ws[0].shape
        nbytes = ws[0].storage_bits() / 8
        rows.append([t, f"{n}x{k}", f"{nbytes / 2**20:.2f}", f"{best[t]:.1f}", f"{nbytes / best[t] / 1e3:.1f}",
                     f"{best[t] * 1e6 / (n * k):.1f}"])
    text = common.table(["type", "N x K", "MiB", "us", "GB/s", "ps/weight"], rows,
                        f"batch-1 GEMV from memory ({args.copies} copies a type, {args.threads} threads, best of "
                        f"{args.rounds} interleaved rounds)")
    common.write_json(args.json, {"best_us": best, "table": text})
    return 0


if __name__ == "__main__":
    sys.exit(main())
