"""Quantized weights: single-stream decode TPOT, weight MiB and 64-request offline throughput per format, for this
tree and any --baseline-ref commit, same run.

For the machine's best unquantized dtype (`auto`: bf16 on CPUs where it is fast) and for fp32 (what a CPU without
native bf16 runs). Every format is loaded from the same file the way a user would (`LLM(quantization=...)`), in its
own process with that tree's engine, and timed through the public API: TPOT = (end - first token) / (n - 1) of one
greedy request (64-token prompt), then the 64 requests (prompts of 64-255 tokens) submitted at once. Rounds
alternate every (tree, dtype, format); medians are reported, with ratios against `none` in the same dtype and tree,
and against each baseline commit. `--formats none --dtypes auto --baseline-ref REF` is the single-stream TPOT of
this tree against REF.

    python benchmarks/quantization.py [--formats none,int8,int4,nf4] [--dtypes auto,float32] [--baseline-ref REF]
        [--rounds 3] [--json out.json]

Bars (issue 10): int8 TPOT <= 0.6x unquantized, int4 <= 0.45x; batched throughput with int8 >= 0.9x.
"""

from __future__ import annotations

import json

import torch

from pagedserve.benchmarks import common, workloads

# Runs in the tree under test (this one or a baseline commit's worktree): public API only. The weight bytes come
# from an internal helper where the tree has one (else they are not reported).
WORKER = r"""
import json, sys, time
from engine import LLM, SamplingParams
job = json.load(sys.stdin)
llm = LLM(job["model"], dtype=job["dtype"], quantization=job["format"], memory_gib=0.5, enable_prefix_caching=False)
book = list(llm.tokenizer.encode(job["text"], add_special_tokens=False))
n, tokens = job["requests"], job["tokens"]
prompt = book[:64]
batch = [book[1000 + 300 * i:1000 + 300 * i + 64 + (37 * i) % 192] for i in range(n)]  # 64..255 tokens
params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
llm.generate(batch[:4], params)  # warm-up
llm.generate(prompt, params)
out = llm.generate(prompt, SamplingParams(max_tokens=tokens + 1, temperature=0.0, ignore_eos=True))[0]
end = time.monotonic()
tpot = (end - out.metrics.first_token_time) / (len(out.token_ids) - 1)
t0 = time.perf_counter()
outs = llm.generate(batch, params)
wall = time.perf_counter() - t0
n_out = sum(len(o.token_ids) for o in outs)
try:
    try:
        from engine.models.loader import weight_bytes
    except ImportError:
        from engine.quant.modules import weight_bytes_by_format as weight_bytes
    sizes = weight_bytes(llm.engine.runner.model)
except Exception:
    sizes = None
print(json.dumps({"tpot_ms": tpot * 1e3, "batch_tok_s": n_out / wall, "batch_output_tokens": n_out,
                  "weight_mib": None if sizes is None else sum(sizes.values()) / 2**20,
                  "weight_mib_by_format": None if sizes is None else {k: v / 2**20 for k, v in sizes.items()}}))
"""


def main(argv: list[str] | None = None) -> dict:
    ap = common.parser(__doc__, rounds=3)
    ap.add_argument("--model", default=None)
    ap.add_argument("--formats", default="none,int8,int4,nf4")
    ap.add_argument("--dtypes", default="auto,float32")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64, help="decode steps of the single stream, outputs in the batch")
    args = ap.parse_args(argv)
    from pagedserve.engine.config import resolve_dtype

    formats = [f.strip() for f in args.formats.split(",")]
    dtypes = []  # resolved here, so every tree runs the same dtype
    for d in args.dtypes.split(","):
        name = str(resolve_dtype(d.strip(), torch.device("cpu"))).removeprefix("torch.")
        if name not in dtypes:
            dtypes.append(name)
    text = " ".join(workloads.load_words()[:20000])
    trees = common.trees(args.baseline_ref)

    def contestant(tree, dtype: str, fmt: str):
        job = json.dumps({"model": args.model, "dtype": dtype, "format": fmt, "text": text,
                          "requests": args.requests, "tokens": args.tokens})
        return lambda: common.run_worker(tree, WORKER, input=job)

    runs = common.interleaved(args.rounds, {(label, dtype, fmt): contestant(tree, dtype, fmt)
                                            for label, tree in trees.items() for dtype in dtypes for fmt in formats})
    rows = {key: common.medians(rounds) for key, rounds in runs.items()}
    for key, r in rows.items():
        r["tpot_ms_rounds"] = [x["tpot_ms"] for x in runs[key]]
        r["batch_tok_s_rounds"] = [x["batch_tok_s"] for x in runs[key]]
    bases = [label for label in trees if label != "this"]

    def line(key: tuple[str, str, str]) -> list:
        label, dtype, fmt = key
        r, none = rows[key], rows.get((label, dtype, "none"))
        mib = "-" if r["weight_mib"] is None else f"{r['weight_mib']:.1f}"
        return ([label, dtype, fmt, mib, f"{r['tpot_ms']:.1f}", common.ratio(r["tpot_ms"], none and none["tpot_ms"])]
                + [common.ratio(r["tpot_ms"], rows[(b, dtype, fmt)]["tpot_ms"]) for b in bases]
                + [f"{r['batch_tok_s']:.0f}", common.ratio(r["batch_tok_s"], none and none["batch_tok_s"])]
                + [common.ratio(r["batch_tok_s"], rows[(b, dtype, fmt)]["batch_tok_s"]) for b in bases])

    common.table(["tree", "activations", "weights", "weight MiB", "TPOT ms", "vs none"] + [f"vs {b}" for b in bases]
                 + ["batch tok/s", "vs none"] + [f"vs {b}" for b in bases], [line(key) for key in rows],
                 f"Quantized weights: single stream (64-token prompt, {args.tokens} decode steps) and "
                 f"{args.requests} requests x {args.tokens} output tokens at once; median of {args.rounds} rounds")
    bars = []
    for (label, dtype, fmt), r in rows.items():
        none = rows.get((label, dtype, "none"))
        if label != "this" or none is None:
            continue
        tpot, tok_s = r["tpot_ms"] / none["tpot_ms"], r["batch_tok_s"] / none["batch_tok_s"]
        if fmt == "int8":
            bars += [(f"{dtype} int8 TPOT <= 0.6x", tpot <= 0.6, tpot), (f"{dtype} int8 batch tok/s >= 0.9x",
                                                                         tok_s >= 0.9, tok_s)]
        elif fmt == "int4":
            bars.append((f"{dtype} int4 TPOT <= 0.45x", tpot <= 0.45, tpot))
    for name, ok, value in bars:
        print(f"bar {'PASS' if ok else 'FAIL'}  {name}: {value:.2f}x")
    result = {"rows": [{"tree": k[0], "dtype": k[1], "format": k[2], **r} for k, r in rows.items()],
              "bars": {name: {"ok": ok, "ratio": value} for name, ok, value in bars}}
    common.write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
