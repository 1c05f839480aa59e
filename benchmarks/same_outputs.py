"""Same outputs as another commit: greedy tokens and their top-5 logprobs, bit for bit, on the bundled model.

For each weight format in fp32 and bf16, a batch of prose prompts whose outputs end at different lengths, so
the steps pass through every route of the dispatch table: prefill GEMMs (chunks of hundreds of rows), decode
steps of 5, 4, 3, 2 and 1 rows (the fused decode layer, the GEMVs) and the LM head at each. Every logprob is
compared as the exact float it is; any difference fails the run.

    python benchmarks/same_outputs.py --baseline-ref 25f1cf5 [--formats none,int8,int4] [--json OUT]

The baseline decides its start-up probes itself; this tree is pinned to the same answers
(PAGEDSERVE_KERNEL_POLICY), so both take the same routes.
"""

from __future__ import annotations

import sys

from pagedserve.benchmarks import common

WORKER = r"""
import json, sys
from engine import LLM, SamplingParams
formats, dtypes, words = sys.argv[1].split(","), sys.argv[2].split(","), sys.argv[3].split()
try:  # the baseline's fp32 packing probe (it has no cache), so this tree can be pinned to the same answer
    from engine.cpu_dtype import cpu_packs_fp32
    packs = cpu_packs_fp32()
except ImportError:
    packs = None
prompts = [" ".join(words[i * 97:i * 97 + 60 + 25 * i]) for i in range(5)]
out = {"prepack_fp32": packs, "runs": {}}
for dtype in dtypes:
    for fmt in formats:
        llm = LLM(dtype=dtype, quantization=fmt, max_step_ms=0)
        params = [SamplingParams(max_tokens=6 + 5 * i, temperature=0.0, ignore_eos=True, logprobs=5)
                  for i in range(len(prompts))]
        res = llm.generate(prompts, params)
        out["runs"][f"{dtype}/{fmt}"] = [[r.token_ids, [[x.logprob, x.top] for x in r.logprobs]] for r in res]
        del llm
print(json.dumps(out))
"""


def difference(base: list, ours: list) -> dict:
    """How far apart two runs are: the prompts whose greedy tokens part and the first step where one does, and the
    largest gap between the two runs' logprobs of the same chosen token before that (after it the contexts
    differ)."""
    parted, first, gap = 0, None, 0.0
    for (ta, la), (tb, lb) in zip(base, ours):
        step = next((i for i, (a, b) in enumerate(zip(ta, tb)) if a != b), None)
        if step is not None:
            parted += 1
            first = step if first is None else min(first, step)
        gap = max([gap] + [abs(pa - pb) for (pa, _), (pb, _) in list(zip(la, lb))[:step]])
    return {"prompts_parted": parted, "first_parting_step": first, "logprob_gap": gap}


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(__doc__, rounds=1)
    ap.add_argument("--formats", default="none,int8,int4,nf4,int8-tensor,int4-tensor")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    args = ap.parse_args(argv)
    if not args.baseline_ref:
        ap.error("--baseline-ref is required: the commit to compare with")
    from pagedserve.benchmarks.workloads import load_words

    words = " ".join(load_words()[2000:2800])
    print(common.machine_header(), flush=True)
    failures, report = 0, {}
    for ref in args.baseline_ref:
        base = common.run_worker(common.worktree(ref), WORKER, args.formats, args.dtypes, words)
        env = {}
        if base["prepack_fp32"] is not None:
            env["PAGEDSERVE_KERNEL_POLICY"] = f"prepack_fp32={'on' if base['prepack_fp32'] else 'off'}"
        ours = common.run_worker(None, WORKER, args.formats, args.dtypes, words, env=env)
        for key, runs in base["runs"].items():
            same = runs == ours["runs"][key]
            tokens = sum(len(t) for t, _ in runs)
            gap = difference(runs, ours["runs"][key])
            if not same:
                failures += 1
            print(f"{common.commit_of(ref)} vs this, {key:22}: {tokens} tokens, "
                  + ("identical (tokens and every logprob)" if same else
                     f"DIFFERENT: {gap['prompts_parted']}/{len(runs)} prompts part (first at step "
                     f"{gap['first_parting_step']}), logprobs of the same token up to {gap['logprob_gap']:.2g} apart"),
                  flush=True)
            report[f"{ref}:{key}"] = {"identical": same, **gap}
    common.write_json(args.json, {"runs": report})
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
