"""Quantized weights: single-stream decode TPOT, weight MiB and 64-request offline throughput per format.

Same run, same machine, for the machine's best unquantized dtype (`auto`: bf16 on CPUs with AVX512-BF16/AMX)
and for fp32 (what a CPU without native bf16 runs). Every format is loaded from the same file the way a user
would (`LLM(quantization=...)`). Ratios are against `none` in the same dtype.

    flock /tmp/pagedserve-bench.lock python benchmarks/quantization.py [--formats none,int8,int4,nf4]
        [--dtypes auto,float32] [--json out.json]

Bars (issue 10): int8 TPOT <= 0.6x unquantized, int4 <= 0.45x; batched throughput with int8 >= 0.9x.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

# OpenMP keeps its default (spinning) wait policy, as a server runs: PASSIVE nearly doubled the batch-1 step
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.seed import common  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.config import resolve_dtype  # noqa: E402
from engine.quant.modules import weight_bytes_by_format  # noqa: E402

TIMING = common.TIMING


def cpu_flags() -> str:
    try:
        flags = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    line = next((x for x in flags.splitlines() if x.startswith("Flags:")), "")
    keep = [f for f in line.split() if f.startswith(("avx512", "amx", "avx2", "fma"))]
    model = next((x.split(":", 1)[1].strip() for x in flags.splitlines() if x.startswith("Model name")), "?")
    return f"{model}; {' '.join(keep)}"


def measure(model: str | None, formats: list[str], dtype: str, prompt: list[int], decode_steps: int,
            batch_prompts: list[list[int]], batch_tokens: int, rounds: int) -> list[dict]:
    """Every format of one dtype loaded side by side and timed in interleaved rounds (TPOT and batch); each
    figure is the median over rounds, so the VM's drift (10-30 % over minutes here) hits all formats alike."""
    llms = {fmt: LLM(model, quantization=fmt, dtype=dtype, memory_gib=0.5, enable_prefix_caching=False)
            for fmt in formats}
    params = SamplingParams(max_tokens=batch_tokens, temperature=0, ignore_eos=True)
    tpot: dict[str, list[float]] = {fmt: [] for fmt in formats}
    tok_s: dict[str, list[float]] = {fmt: [] for fmt in formats}
    n_out = {}
    for llm in llms.values():
        llm.generate(batch_prompts[:4], params)  # warm-up
    for _ in range(rounds):
        for fmt, llm in llms.items():
            tpot[fmt].append(statistics.median(common.decode_times(llm.engine, prompt, decode_steps)))
            t0 = time.perf_counter()
            outs = llm.generate(batch_prompts, params)
            wall = time.perf_counter() - t0
            n_out[fmt] = sum(len(o.token_ids) for o in outs)
            tok_s[fmt].append(n_out[fmt] / wall)
    rows = []
    for fmt, llm in llms.items():
        sizes = weight_bytes_by_format(llm.engine.runner.model)
        rows.append({"format": fmt, "dtype": str(llm.engine.dtype).removeprefix("torch."),
                     "weight_mib": sum(sizes.values()) / 2**20,
                     "weight_mib_by_format": {k: v / 2**20 for k, v in sizes.items()},
                     "tpot_ms_median": statistics.median(tpot[fmt]) * 1e3,
                     "tpot_ms_rounds": [t * 1e3 for t in tpot[fmt]],
                     "batch_requests": len(batch_prompts), "batch_output_tokens": n_out[fmt],
                     "batch_tok_s": statistics.median(tok_s[fmt]), "batch_tok_s_rounds": tok_s[fmt]})
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = common.base_parser(__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--formats", default="none,int8,int4,nf4")
    ap.add_argument("--dtypes", default="auto,float32")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds (default 3; --quick: 1)")
    args = ap.parse_args(argv)
    result = common.setup(args)
    result["cpu"] = cpu_flags()
    formats = [f.strip() for f in args.formats.split(",")]
    dtypes = []
    for d in args.dtypes.split(","):
        name = str(resolve_dtype(d.strip(), torch.device("cpu"))).removeprefix("torch.")
        if name not in dtypes:
            dtypes.append(name)
    steps, out_tokens, n_req = (8, 8, 8) if args.quick else (64, 64, args.requests)
    rounds = args.rounds or (1 if args.quick else 3)
    loaded_tok = common.text_tokenizer()
    book = list(loaded_tok.encode(" ".join(__import__("benchmarks.workloads", fromlist=["x"]).load_words()[:20000]),
                                  add_special_tokens=False))
    prompt = book[:64]
    lens = [64 + (37 * i) % 192 for i in range(n_req)]  # 64..255 prompt tokens
    batch_prompts = [book[1000 + 300 * i:1000 + 300 * i + n] for i, n in enumerate(lens)]
    print(f"CPU: {result['cpu']}\nload average (1 min) at start: {os.getloadavg()[0]:.2f}; "
          f"torch threads {torch.get_num_threads()}\nsingle stream: 64-token prompt, {steps} decode steps; "
          f"batch: {n_req} requests x {out_tokens} output tokens (prompts 64-255 tokens), submitted at once; "
          f"median of {rounds} interleaved rounds")
    rows = []
    for dtype in dtypes:
        for r in measure(args.model, formats, dtype, prompt, steps, batch_prompts, out_tokens, rounds):
            rows.append(r)
            print(f"  {dtype} {r['format']}: TPOT {r['tpot_ms_median']:.1f} ms (rounds "
                  f"{', '.join(f'{t:.1f}' for t in r['tpot_ms_rounds'])}), {r['batch_tok_s']:.0f} tok/s", flush=True)
    base = {r["dtype"]: r for r in rows if r["format"] == "none"}
    table = []
    for r in rows:
        b = base.get(r["dtype"])
        r["tpot_ratio"] = r["tpot_ms_median"] / b["tpot_ms_median"] if b else None
        r["throughput_ratio"] = r["batch_tok_s"] / b["batch_tok_s"] if b else None
        table.append([r["dtype"], r["format"], f"{r['weight_mib']:.1f}", f"{r['tpot_ms_median']:.1f}",
                      f"{r['tpot_ratio']:.2f}x" if b else "-", f"{r['batch_tok_s']:.0f}",
                      f"{r['throughput_ratio']:.2f}x" if b else "-"])
    common.table(["activations", "weights", "weight MiB", "TPOT ms (median)", "TPOT vs none", "batch tok/s",
                  "tok/s vs none"], table, "Quantized weights, same run")
    result["rows"] = rows
    result["load_avg_end"] = os.getloadavg()[0]
    print(f"load average (1 min) at end: {result['load_avg_end']:.2f}")
    checks = {}
    for r in rows:
        if r["tpot_ratio"] is None:
            continue
        if r["format"] == "int8":
            checks[f"{r['dtype']} int8 TPOT <= 0.6x"] = (r["tpot_ratio"] <= 0.6, f"{r['tpot_ratio']:.2f}x", TIMING)
            checks[f"{r['dtype']} int8 batched tok/s >= 0.9x"] = (
                r["throughput_ratio"] >= 0.9, f"{r['throughput_ratio']:.2f}x", TIMING)
        if r["format"] == "int4":
            checks[f"{r['dtype']} int4 TPOT <= 0.45x"] = (r["tpot_ratio"] <= 0.45, f"{r['tpot_ratio']:.2f}x", TIMING)
        if r["format"] != "none":
            checks[f"{r['dtype']} {r['format']} uses less weight memory"] = (
                r["weight_mib"] < base[r["dtype"]]["weight_mib"], f"{r['weight_mib']:.1f} MiB")
    return common.finish(result, checks, args)


if __name__ == "__main__":
    main()
