"""Offline throughput: pagedserve (continuous batching) vs HF transformers `generate` (static batches).

Same 64 prose requests, same run. All requests are submitted at once; outputs have skewed lengths
(median ~32, max 256) and ignore EOS, so both sides produce exactly the same number of useful tokens.
HF runs fixed batches, by default sorted by output length (the strongest static baseline: a batch lasts
as long as its longest member), at each of --hf-dtypes; the faster is the baseline.

    flock /tmp/pagedserve-bench.lock python benchmarks/offline_throughput.py [--hf-dtypes float32,bfloat16] \
        [--hf-batch-size 16] [--dtype auto] [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import workloads  # noqa: E402
from benchmarks.machine import machine_header  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.config import bundled_model_path  # noqa: E402


def run_pagedserve(llm: LLM, prompts: list[list[int]], max_tokens: list[int]) -> dict:
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
    llm.generate(prompts[:2], [SamplingParams(max_tokens=4, temperature=0.0)] * 2)  # warm-up
    llm.engine.scheduler.block_manager.reset_prefix_cache()  # every round prefills every prompt
    steps0 = llm.engine.scheduler.stats.num_preemptions
    t0 = time.perf_counter()
    results = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    out_tokens = sum(len(r.token_ids) for r in results)
    ttfts = sorted(r.metrics.ttft for r in results)
    return {"wall_s": wall, "output_tokens": out_tokens, "output_tok_s": out_tokens / wall,
            "ttft_p50_s": ttfts[len(ttfts) // 2],
            "preemptions": llm.engine.scheduler.stats.num_preemptions - steps0}


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
        t0 = time.perf_counter()
        for i in range(0, len(prompts), batch_size):
            batch_generate(prompts[i:i + batch_size], max(max_tokens[i:i + batch_size]))
        wall = time.perf_counter() - t0
    out_tokens = sum(max_tokens)
    return {"wall_s": wall, "output_tokens": out_tokens, "output_tok_s": out_tokens / wall}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file or HF directory (default: bundled SmolLM2)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--text", default=None, help="prompt source (default: the book shipped in benchmarks/data/)")
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--hf-dtypes", default="float32,bfloat16", help="HF runs at each; the fastest is the baseline")
    ap.add_argument("--hf-order", default="sorted", choices=["sorted", "arrival"])
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--max-step-ms", type=float, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--rounds", type=int, default=1, help="alternating rounds of every engine; medians reported")
    ap.add_argument("--json", default=None, help="write results here")
    args = ap.parse_args(argv)

    print(machine_header())
    reqs = workloads.prose(args.num_requests, text_path=args.text)
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, attention_backend=args.attention_backend,
              max_step_ms=args.max_step_ms)
    prompts = [llm.engine.tokenize(r.prompt) for r in reqs]
    max_tokens = [r.max_tokens for r in reqs]
    dtype = llm.engine.dtype
    hf_models = {}
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = args.model or bundled_model_path()
        kw = {"gguf_file": os.path.basename(path)} if path.endswith(".gguf") else {}
        folder = os.path.dirname(path) if path.endswith(".gguf") else path
        tokenizer = AutoTokenizer.from_pretrained(folder, **kw)
        for name in args.hf_dtypes.split(","):
            hf_models[name] = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, name), **kw).eval()
    # Rounds alternate the engines, so the machine's drift (10-30 % within minutes on shared VMs) hits both
    # sides alike; each side's median round is reported.
    our_rounds, hf_rounds = [], {name: [] for name in hf_models}
    for _ in range(args.rounds):
        our_rounds.append(run_pagedserve(llm, prompts, max_tokens))
        for name, model in hf_models.items():
            hf_rounds[name].append(run_hf(model, tokenizer, prompts, max_tokens, args.hf_batch_size,
                                          args.hf_order == "sorted"))

    def median(runs: list[dict]) -> dict:
        run = sorted(runs, key=lambda r: r["output_tok_s"])[(len(runs) - 1) // 2]
        return dict(run, rounds_tok_s=[r["output_tok_s"] for r in runs])

    ours = median(our_rounds)
    ours["attention_backend"] = llm.engine.runner.backend.name
    print(llm.engine.cost_model.describe())
    del llm, hf_models

    hf, hf_runs = None, {name: median(runs) for name, runs in hf_rounds.items()}
    if hf_runs:
        best = max(hf_runs, key=lambda n: hf_runs[n]["output_tok_s"])
        hf = dict(hf_runs[best], dtype=best)

    prompt_tokens = sum(len(p) for p in prompts)
    print(f"\nWorkload: {len(reqs)} prose requests, all at once; prompt tokens {prompt_tokens} "
          f"(min {min(map(len, prompts))}, max {max(map(len, prompts))}); output tokens {sum(max_tokens)} "
          f"(median {sorted(max_tokens)[len(max_tokens) // 2]}, max {max(max_tokens)}); dtype {dtype}; "
          f"threads {torch.get_num_threads()}")
    print(f"{'engine':<34}{'wall s':>9}{'out tok':>9}{'out tok/s':>11}")
    label = f"pagedserve ({str(dtype).removeprefix('torch.')}, {ours['attention_backend']})"

    def rounds(run: dict) -> str:
        return "" if len(run["rounds_tok_s"]) == 1 else "  rounds " + ", ".join(f"{x:.1f}" for x in run["rounds_tok_s"])

    print(f"{label:<34}{ours['wall_s']:>9.2f}{ours['output_tokens']:>9}{ours['output_tok_s']:>11.1f}{rounds(ours)}")
    result = {"workload": {"num_requests": len(reqs), "prompt_tokens": prompt_tokens,
                           "output_tokens": sum(max_tokens), "dtype": str(dtype)}, "pagedserve": ours}
    if hf:
        for name, run in hf_runs.items():
            label = f"HF generate ({name}, static {args.hf_order} b{args.hf_batch_size})"
            print(f"{label:<34}{run['wall_s']:>9.2f}{run['output_tokens']:>9}{run['output_tok_s']:>11.1f}{rounds(run)}")
        result["hf"] = hf
        result["hf_runs"] = hf_runs
        result["ratio"] = ours["output_tok_s"] / hf["output_tok_s"]
        print(f"ratio pagedserve / HF at its best dtype ({hf['dtype']}): {result['ratio']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
