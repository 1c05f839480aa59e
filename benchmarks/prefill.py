"""Prefill tokens/s of one long prompt on an idle server: this tree against other commits, interleaved.

Each round starts each server in turn (`pagedserve serve` from this tree, or from a git worktree of each
--baseline-ref) on the same model and sends it --prompts requests one at a time: PREFILL_WORDS consecutive words
of the bundled book from a different place each time (~1,900 tokens), `max_tokens=1`, timed from request to
response with the official openai client. The table shows each server's median and best over all its requests;
the first request of a server meets every kernel shape for the first time, as a user's first request does.
--size 1b serves the Llama-3.2-1B-shaped file steady_streams.py writes (random weights, --quant blocks).

    python benchmarks/prefill.py [--size 1b|135m] [--quant Q4_1] [--prompts 6] [--rounds 2] [--baseline-ref 25f1cf5]
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import tempfile

from pagedserve.benchmarks import common, gguf_quants, steady_streams, workloads


async def _prefill(url: str, prompts: list[str]) -> list[float]:
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key="none")
    model = (await client.models.list()).data[0].id
    return [rate for rate, _ in await steady_streams.prefill_rates(client, model, prompts)]


def main(argv: list[str] | None = None) -> None:
    from pagedserve.engine.config import bundled_model_path

    ap = common.parser(__doc__, rounds=2)
    ap.add_argument("--size", choices=("1b", "135m"), default="1b")
    ap.add_argument("--quant", default="Q4_1", help="block type of the 1B file")
    ap.add_argument("--prompts", type=int, default=6, help="requests per server per round")
    ap.add_argument("--serve-args", default="", help="extra `serve` options for every server")
    args = ap.parse_args(argv)
    words = workloads.load_words()
    n = steady_streams.PREFILL_WORDS
    starts = [1000 + i * (len(words) - n - 1000) // max(1, args.prompts) for i in range(args.prompts)]
    prompts = [" ".join(words[s:s + n]) for s in starts]
    trees = common.trees(args.baseline_ref)
    with tempfile.TemporaryDirectory() as tmp:
        if args.size == "1b":
            tok = bundled_model_path()
            model = gguf_quants.cached_gguf(steady_streams.ONE_B_SHAPE, args.quant, tokenizer_from=tok)
        else:
            model, tok = bundled_model_path(), None
        log = open(os.path.join(tmp, "servers.log"), "w")

        def contestant(tree):
            def run() -> dict:
                proc, url = common.serve(tree, ["--model", model, "--log-level", "warning",
                                                *(["--tokenizer", tok] if tok else []), *args.serve_args.split()], log)
                try:
                    return {"rates": asyncio.run(_prefill(url + "/v1", prompts))}
                finally:
                    common.stop(proc)
            return run

        results = common.interleaved(args.rounds, {label: contestant(tree) for label, tree in trees.items()})
    rates = {label: [x for r in runs for x in r["rates"]] for label, runs in results.items()}
    base = rates["this"]
    rows = [[label, f"{statistics.median(v):.0f}", common.ratio(statistics.median(v), statistics.median(base)),
             f"{max(v):.0f}", common.ratio(max(v), max(base)), " ".join(f"{x:.0f}" for x in v)]
            for label, v in rates.items()]
    text = common.table(["server", "median tok/s", "vs this", "best tok/s", "vs this", "every request"], rows,
                        f"prefill of one ~{n}-word prompt at a time, {args.size}"
                        f"{' ' + args.quant if args.size == '1b' else ''} ({args.prompts} prompts x {args.rounds} "
                        "interleaved rounds per server)")
    common.write_json(args.json, {"size": args.size, "quant": args.quant, "rates": rates, "table": text})


if __name__ == "__main__":
    sys.exit(main())
