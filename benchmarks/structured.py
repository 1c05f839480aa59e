"""Structured-output cost: grammar mask time per token, and end-to-end throughput with 0 %, 50 % and 100 %
of the 64 prose requests constrained, same engine, same run.

Constrained requests follow a JSON-lines grammar (one person object per line, forever: keys, strings
and bounded integers, so every kind of JSON mask is exercised) and EOS is biased away (-100), so they
produce exactly as many tokens as the unconstrained ones (greedy, ignore_eos): throughputs compare 1:1.

    flock /tmp/pagedserve-bench.lock python benchmarks/structured.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import workloads  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.structured import JSON_STYLE, StructuredSpec, apply_constraints  # noqa: E402

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0,
                                                                             "maximum": 120},
                         "city": {"type": "string", "maxLength": 16}}, "x-guidance": JSON_STYLE}
JSON_LINES = StructuredSpec("lark", f'start: obj ("\\n" obj)*\nobj: %json {json.dumps(PERSON)}\n')


def params(max_tokens: int, constrained: bool, eos: int) -> SamplingParams:
    if not constrained:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, structured=JSON_LINES,
                          logit_bias={eos: -100.0})


def run(llm: LLM, prompts: list[list[int]], max_tokens: list[int], fraction: float) -> dict:
    eos = llm.tokenizer.eos_token_id
    k = round(len(prompts) * fraction)
    # spread the constrained ones evenly over the arrival order
    constrained = {round(i * len(prompts) / k) for i in range(k)} if k else set()
    ps = [params(m, i in constrained, eos) for i, m in enumerate(max_tokens)]
    t0 = time.perf_counter()
    results = llm.generate(prompts, ps)
    wall = time.perf_counter() - t0
    out = sum(len(r.token_ids) for r in results)
    valid = sum(1 for i, r in enumerate(results) if i in constrained and _json_lines_ok(r.text))
    return {"fraction": fraction, "constrained": len(constrained), "valid_prefix": valid, "wall_s": wall,
            "output_tokens": out, "output_tok_s": out / wall,
            "texts": [r.text for i, r in enumerate(results) if i in constrained][:4],
            "token_ids": [r.token_ids for i, r in enumerate(results) if i in constrained]}


def _json_lines_ok(text: str) -> bool:
    """Every complete line parses as a person; the last may be cut by max_tokens."""
    lines = text.split("\n")
    try:
        return all(set(json.loads(line)) == {"name", "age", "city"} for line in lines[:-1])
    except json.JSONDecodeError:
        return False


def mask_cost(llm: LLM, token_lists: list[list[int]]) -> dict:
    """Replay constrained outputs: time the per-step mask fill (batched, as the engine does) and apply."""
    so = llm.engine.structured
    vocab = llm.engine.model_config.vocab_size
    cons = [so.constraint_for(params(len(t), True, llm.tokenizer.eos_token_id)) for t in token_lists]

    class _Seq:  # what begin_step reads from a Sequence
        def __init__(self) -> None:
            self.output_token_ids: list[int] = []

        @property
        def num_output_tokens(self) -> int:
            return len(self.output_token_ids)

    seqs = [_Seq() for _ in cons]
    fill_s = apply_s = 0.0
    rows = 0
    for step in range(max(map(len, token_lists))):
        live = [i for i, t in enumerate(token_lists) if step < len(t)]
        t0 = time.perf_counter()
        so.begin_step([(cons[i], seqs[i]) for i in live])
        cons[live[0]].pending.blocked(vocab)  # waits for the worker, unpacks
        t1 = time.perf_counter()
        logits = torch.zeros(len(live), vocab)
        apply_constraints(logits, [cons[i] for i in live])
        t2 = time.perf_counter()
        fill_s, apply_s, rows = fill_s + t1 - t0, apply_s + t2 - t1, rows + len(live)
        for i in live:
            tok = token_lists[i][step]
            cons[i].matcher.accept(tok)
            seqs[i].output_token_ids.append(tok)
    return {"tokens": rows, "fill_us_per_token": fill_s / rows * 1e6, "apply_us_per_token": apply_s / rows * 1e6}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--fractions", default="0,1,0.5,1,0",
                    help="constrained fractions in run order (repeats expose drift on a shared machine)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    reqs = workloads.prose(args.num_requests)
    llm = LLM(args.model, dtype=args.dtype)
    prompts = [llm.engine.tokenize(r.prompt) for r in reqs]
    max_tokens = [r.max_tokens for r in reqs]
    llm.generate(prompts[:2], [params(4, True, llm.tokenizer.eos_token_id)] * 2)  # warm-up, grammar compile
    runs = []
    for f in map(float, args.fractions.split(",")):
        runs.append(run(llm, prompts, max_tokens, f))
        print(f"{f * 100:.0f} % constrained: {runs[-1]['output_tok_s']:.1f} tok/s, load {os.getloadavg()[0]:.2f}",
              flush=True)
    full = next(r for r in runs if r["fraction"] == 1.0)
    cost = mask_cost(llm, full["token_ids"])

    flags = subprocess.run("lscpu | grep -i '^flags' | tr ' ' '\\n' | grep -E 'avx512_bf16|amx_bf16|avx512f$' "
                           "| tr '\\n' ' '", shell=True, capture_output=True, text=True).stdout.strip()
    print(f"\nWorkload: {len(reqs)} prose requests at once, outputs {sum(max_tokens)} tokens (greedy, ignore_eos); "
          f"dtype {llm.engine.dtype}; threads {torch.get_num_threads()}; CPU flags: {flags}; "
          f"load {os.getloadavg()[0]:.2f}")
    mean = lambda f: sum(r["output_tok_s"] for r in runs if r["fraction"] == f) / sum(  # noqa: E731
        1 for r in runs if r["fraction"] == f)
    base = mean(0.0)
    print(f"{'constrained':>12}{'wall s':>9}{'out tok':>9}{'out tok/s':>11}{'vs 0 %':>8}{'JSON ok':>9}")
    for r in runs:
        print(f"{r['fraction'] * 100:>11.0f}%{r['wall_s']:>9.2f}{r['output_tokens']:>9}{r['output_tok_s']:>11.1f}"
              f"{r['output_tok_s'] / base:>7.2f}x{r['valid_prefix']:>5}/{r['constrained']:<3}")
    print(f"mask cost (llguidance, batched as in the engine, {cost['tokens']} tokens replayed): fill "
          f"{cost['fill_us_per_token']:.1f} us/token, apply {cost['apply_us_per_token']:.1f} us/token")
    print("sample constrained output:", json.dumps(full["texts"][0][:160]))
    result = {"runs": [{k: v for k, v in r.items() if k != "token_ids"} for r in runs], "mask_cost": cost,
              "ratio_100_vs_0": mean(1.0) / base,
              "cpu_flags": flags, "load": os.getloadavg()[0]}
    print(f"100 % constrained / unconstrained throughput: {result['ratio_100_vs_0']:.2f}x (bar: >= 0.8x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
