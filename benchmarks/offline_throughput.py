"""Offline throughput: pagedserve (continuous batching) vs HF transformers `generate` (static batches), and this
tree vs other commits (--baseline-ref), same requests, same run.

All requests are submitted at once; outputs have skewed lengths (median ~32, max 256) and ignore EOS, so every
row produces exactly the same number of useful tokens. Each pagedserve row (this tree, each baseline commit) runs
in its own process through the public API (`LLM(...).generate`), a warm-up first. HF runs fixed batches, by
default sorted by output length (the strongest static baseline: a batch lasts as long as its longest member), at
each of --hf-dtypes; the faster is the baseline. Rounds alternate every row; each row's median round is reported.

    python benchmarks/offline_throughput.py [--hf-dtypes float32,bfloat16] [--hf-batch-size 16] [--dtype auto]
        [--baseline-ref 25f1cf5] [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import json
import os
import statistics

import torch

from pagedserve.benchmarks import common, workloads

# Runs in the tree under test (this one or a baseline commit's worktree): public API only.
WORKER = r"""
import json, sys, time
from engine import LLM, SamplingParams
job = json.load(sys.stdin)
llm = LLM(job["model"], **job["options"])
prompts, max_tokens = job["prompts"], job["max_tokens"]
llm.generate(prompts[:2], [SamplingParams(max_tokens=4, temperature=0.0)] * 2)  # warm-up
params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
t0 = time.perf_counter()
results = llm.generate(prompts, params)
wall = time.perf_counter() - t0
ttfts = sorted(r.metrics.ttft for r in results)
out = sum(len(r.token_ids) for r in results)
print(json.dumps({"wall_s": wall, "output_tokens": out, "output_tok_s": out / wall,
                  "ttft_p50_s": ttfts[len(ttfts) // 2],
                  "dtype": str(getattr(getattr(llm, "engine", None), "dtype", "?")).removeprefix("torch.")}))
"""


def run_offline(tree, model: str | None, prompts: list[str], max_tokens: list[int], **options) -> dict:
    """One timed `LLM.generate` of every request at once, in a fresh process with `tree`'s engine."""
    job = {"model": model, "options": options, "prompts": prompts, "max_tokens": max_tokens}
    return common.run_worker(tree, WORKER, input=json.dumps(job))


def run_hf(model, tokenizer, prompts: list[list[int]], max_tokens: list[int], batch_size: int,
           sort: bool = True) -> dict:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def batch_generate(batch: list[list[int]], n: int) -> None:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=pad)

    if sort:  # by output length: batch members finish together
        order = sorted(range(len(prompts)), key=max_tokens.__getitem__)
        prompts, max_tokens = [prompts[i] for i in order], [max_tokens[i] for i in order]
    with torch.inference_mode():
        batch_generate(prompts[:2], 4)  # warm-up
        wall = common.timed(lambda: [batch_generate(prompts[i:i + batch_size], max(max_tokens[i:i + batch_size]))
                                     for i in range(0, len(prompts), batch_size)])
    out_tokens = sum(max_tokens)
    return {"wall_s": wall, "output_tokens": out_tokens, "output_tok_s": out_tokens / wall}


def main(argv: list[str] | None = None) -> dict:
    ap = common.parser(__doc__, rounds=1)
    ap.add_argument("--model", default=None, help="GGUF file or HF directory (default: bundled SmolLM2)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--text", default=None, help="prompt source (default: the book the engine ships, engine/data/)")
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--hf-dtypes", default="float32,bfloat16", help="HF runs at each; the fastest is the baseline")
    ap.add_argument("--hf-order", default="sorted", choices=["sorted", "arrival"])
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--max-step-ms", type=float, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args(argv)

    from pagedserve.engine.config import bundled_model_path
    from pagedserve.engine.tokenizer import load_tokenizer

    reqs = workloads.prose(args.num_requests, text_path=args.text)
    path = args.model or bundled_model_path()
    tokenizer = load_tokenizer(path)
    prompts = [r.prompt for r in reqs]
    prompt_ids = [list(tokenizer.encode(p)) for p in prompts]
    max_tokens = [r.max_tokens for r in reqs]
    options = dict(dtype=args.dtype, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                   attention_backend=args.attention_backend, max_step_ms=args.max_step_ms)
    contestants = {f"pagedserve {label}": (lambda tree=tree: run_offline(tree, args.model, prompts, max_tokens,
                                                                          **options))
                   for label, tree in common.trees(args.baseline_ref).items()}
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        kw = {"gguf_file": os.path.basename(path)} if path.endswith(".gguf") else {}
        folder = os.path.dirname(path) if path.endswith(".gguf") else path
        for name in args.hf_dtypes.split(","):
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, name), **kw).eval()
            contestants[f"HF generate {name}"] = lambda model=model: run_hf(
                model, tokenizer, prompt_ids, max_tokens, args.hf_batch_size, args.hf_order == "sorted")
    runs = common.interleaved(args.rounds, contestants)

    def median(rounds: list[dict]) -> dict:
        run = sorted(rounds, key=lambda r: r["output_tok_s"])[(len(rounds) - 1) // 2]
        return dict(run, rounds_tok_s=[r["output_tok_s"] for r in rounds])

    rows = {name: median(rounds) for name, rounds in runs.items()}
    hf = {name: r for name, r in rows.items() if name.startswith("HF")}
    best_hf = max(hf, key=lambda n: hf[n]["output_tok_s"]) if hf else None
    bases = [f"pagedserve {common.commit_of(ref)}" for ref in args.baseline_ref]
    lens = [len(p) for p in prompt_ids]
    dtype = rows["pagedserve this"]["dtype"]
    title = (f"{len(reqs)} prose requests, all at once; prompt tokens {sum(lens)} (min {min(lens)}, max {max(lens)});"
             f" output tokens {sum(max_tokens)} (median {statistics.median_low(max_tokens)}, max {max(max_tokens)}); "
             f"pagedserve dtype {dtype}; HF static {args.hf_order} batches of {args.hf_batch_size}; "
             f"median of {args.rounds} rounds")
    common.table(
        ["engine", "wall s", "out tok", "out tok/s", "rounds tok/s", "vs best HF"] + [f"vs {b}" for b in bases],
        [[name, f"{r['wall_s']:.2f}", r["output_tokens"], f"{r['output_tok_s']:.1f}",
          ", ".join(f"{x:.1f}" for x in r["rounds_tok_s"]),
          common.ratio(r["output_tok_s"], hf[best_hf]["output_tok_s"] if best_hf else None)]
         + [common.ratio(r["output_tok_s"], rows[b]["output_tok_s"]) for b in bases] for name, r in rows.items()],
        title)
    result = {"workload": {"num_requests": len(reqs), "prompt_tokens": sum(lens), "output_tokens": sum(max_tokens),
                           "dtype": dtype},
              "rows": rows, "best_hf": best_hf}
    common.write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
