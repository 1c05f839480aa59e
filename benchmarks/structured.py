"""Structured-output cost: grammar mask time per token, and end-to-end throughput with 0 %, 50 % and 100 %
of the 64 prose requests constrained, same engine, same run.

Constrained requests follow a JSON-lines grammar (one person object per line, forever: keys, strings
and bounded integers, so every kind of JSON mask is exercised) and EOS is biased away (-100), so they
produce exactly as many tokens as the unconstrained ones (greedy, ignore_eos): throughputs compare 1:1.
Rounds alternate the fractions; each one's median is reported.

    python benchmarks/structured.py [--fractions 0,0.5,1] [--rounds 2] [--json out.json]
"""

from __future__ import annotations

import json
import statistics

import torch

from pagedserve.benchmarks import common, workloads
from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.structured import JSON_STYLE, StructuredSpec, apply_constraints

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
    results = []
    wall = common.timed(lambda: results.extend(llm.generate(prompts, ps)))
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

        def fill(live=live) -> None:
            so.begin_step([(cons[i], seqs[i]) for i in live])
            cons[live[0]].pending.blocked(vocab)  # waits for the worker, unpacks

        fill_s += common.timed(fill)
        logits = torch.zeros(len(live), vocab)
        apply_s += common.timed(lambda live=live, logits=logits: apply_constraints(logits, [cons[i] for i in live]))
        rows += len(live)
        for i in live:
            tok = token_lists[i][step]
            cons[i].matcher.accept(tok)
            seqs[i].output_token_ids.append(tok)
    return {"tokens": rows, "fill_us_per_token": fill_s / rows * 1e6, "apply_us_per_token": apply_s / rows * 1e6}


def main(argv: list[str] | None = None) -> dict:
    ap = common.parser(__doc__, rounds=2, baseline=False)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--fractions", default="0,0.5,1", help="fractions of the requests constrained, one row each")
    args = ap.parse_args(argv)

    reqs = workloads.prose(args.num_requests)
    llm = LLM(args.model, dtype=args.dtype)
    prompts = [llm.engine.tokenize(r.prompt) for r in reqs]
    max_tokens = [r.max_tokens for r in reqs]
    llm.generate(prompts[:2], [params(4, True, llm.tokenizer.eos_token_id)] * 2)  # warm-up, grammar compile
    fractions = [float(f) for f in args.fractions.split(",")]
    runs = common.interleaved(args.rounds, {f: lambda f=f: run(llm, prompts, max_tokens, f) for f in fractions})
    full = runs[1.0][-1] if 1.0 in runs else None
    cost = mask_cost(llm, full["token_ids"]) if full else None
    rows = {f: {"wall_s": statistics.median(r["wall_s"] for r in rs), "output_tokens": rs[0]["output_tokens"],
                "output_tok_s": statistics.median(r["output_tok_s"] for r in rs),
                "rounds_tok_s": [r["output_tok_s"] for r in rs], "constrained": rs[0]["constrained"],
                "valid_prefix": min(r["valid_prefix"] for r in rs), "texts": rs[0]["texts"]}
            for f, rs in runs.items()}
    base = rows[0.0]["output_tok_s"] if 0.0 in rows else None
    common.table(["constrained", "wall s", "out tok", "out tok/s", "vs 0 %", "JSON ok", "rounds tok/s"],
                 [[f"{f * 100:.0f} %", f"{r['wall_s']:.2f}", r["output_tokens"], f"{r['output_tok_s']:.1f}",
                   common.ratio(r["output_tok_s"], base), f"{r['valid_prefix']}/{r['constrained']}",
                   ", ".join(f"{x:.1f}" for x in r["rounds_tok_s"])] for f, r in rows.items()],
                 f"{len(reqs)} prose requests at once, outputs {sum(max_tokens)} tokens (greedy, ignore_eos); "
                 f"dtype {llm.engine.dtype}; median of {args.rounds} rounds")
    result = {"rows": {str(f): r for f, r in rows.items()}, "mask_cost": cost}
    if cost:
        print(f"mask cost (llguidance, batched as in the engine, {cost['tokens']} tokens replayed): fill "
              f"{cost['fill_us_per_token']:.1f} us/token, apply {cost['apply_us_per_token']:.1f} us/token")
        print("sample constrained output:", json.dumps(full["texts"][0][:160]))
    if base and 1.0 in rows:
        result["ratio_100_vs_0"] = rows[1.0]["output_tok_s"] / base
        print(f"100 % constrained / unconstrained throughput: {result['ratio_100_vs_0']:.2f}x (bar: >= 0.8x)")
    common.write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
