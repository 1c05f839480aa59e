"""Start-up: seconds from launching `pagedserve serve` to its engine built (the engine's "KV cache:" log line) and to
/ready answering 200 (after the warm-up), for the bundled model and for a GGUF carrying Llama 3's vocabulary
(128,256 tokens, 280,147 merges) over a one-layer network. That file is written here with gguf's writer (random
weights; the bundled tokenizer drives it, so only reading its metadata depends on its vocabulary). This tree and
each --baseline-ref commit start in turn, round after round; medians are reported.

    python benchmarks/startup.py [--baseline-ref GIT_REF] [--rounds 3] [--json out]
"""

from __future__ import annotations

import os
import tempfile
import time
from datetime import datetime

import numpy as np

from pagedserve.benchmarks import common


def write_llama3_vocab_gguf(path: str) -> None:
    import gguf

    rng = np.random.default_rng(0)
    vocab, hidden = 128256, 64
    w = gguf.GGUFWriter(path, "llama")
    for add, value in ((w.add_block_count, 1), (w.add_context_length, 4096), (w.add_embedding_length, hidden),
                       (w.add_feed_forward_length, 128), (w.add_head_count, 4), (w.add_head_count_kv, 4),
                       (w.add_layer_norm_rms_eps, 1e-5), (w.add_vocab_size, vocab)):
        add(value)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"tok{i}" for i in range(vocab)])
    w.add_token_types([1] * vocab)
    w.add_token_merges([f"t{i} k{i}" for i in range(280147)])
    tensors = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,),
               "blk.0.attn_norm.weight": (hidden,), "blk.0.ffn_norm.weight": (hidden,),
               "blk.0.attn_q.weight": (hidden, hidden), "blk.0.attn_k.weight": (hidden, hidden),
               "blk.0.attn_v.weight": (hidden, hidden), "blk.0.attn_output.weight": (hidden, hidden),
               "blk.0.ffn_gate.weight": (128, hidden), "blk.0.ffn_up.weight": (128, hidden),
               "blk.0.ffn_down.weight": (hidden, 128)}
    for name, shape in tensors.items():
        w.add_tensor(name, (rng.standard_normal(shape) * 0.02).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def start(tree, serve_args: list[str]) -> dict:
    """Launch `tree`'s server, time it to the engine built and to healthy, stop it."""
    with tempfile.TemporaryFile("w+") as log:
        t0 = time.time()
        server, _ = common.serve(tree, serve_args, log, bound_s=600)
        ready = time.time() - t0
        common.stop(server)
        log.seek(0)
        line = next(x for x in log if "KV cache:" in x)  # "2026-12-06 14:00:18,874 INFO ...": the log's clock
    built = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp() - t0
    return {"engine_built_s": built, "ready_s": ready}


def main(argv: list[str] | None = None) -> dict:
    ap = common.parser(__doc__)
    args = ap.parse_args(argv)
    from pagedserve.engine.config import bundled_model_path

    bundled = bundled_model_path()
    with tempfile.TemporaryDirectory() as tmp:
        big = os.path.join(tmp, "llama3-vocab.gguf")
        write_llama3_vocab_gguf(big)
        models = {"SmolLM2-135M (bundled)": [], "Llama 3 vocabulary, 1 layer": ["--model", big, "--tokenizer",
                                                                                   bundled]}
        contestants = {(label, name): (lambda tree=tree, a=a: start(tree, a))
                       for label, tree in common.trees(args.baseline_ref).items() for name, a in models.items()}
        runs = common.interleaved(args.rounds, contestants)
    rows = {key: common.medians(r) for key, r in runs.items()}
    table = []
    for (label, name), m in rows.items():
        this = rows[("this", name)]["ready_s"]
        table.append([label, name, f"{m['engine_built_s']:.2f}", f"{m['ready_s']:.2f}",
                      common.ratio(this, m["ready_s"]) if label != "this" else ""])
    common.table(["tree", "model", "engine built s", "ready s", "this / tree (ready)"], table,
                 title=f"pagedserve serve start-up, medians of {args.rounds} rounds")
    record = {"rows": [{"tree": label, "model": name, **m, "rounds": runs[(label, name)]}
                       for (label, name), m in rows.items()]}
    common.write_json(args.json, record)
    return record


if __name__ == "__main__":
    main()
