"""GGUF quant types served at their own bits: load time, resident memory and batch-1 decode speed of a 1B-shaped
model written as Q4_K_M (llama.cpp's default download), Q5_K_M, Q6_K and Q8_0, against the same model as Q4_0.

The files are written here with gguf's writer, as llama.cpp's quantizer lays them out (its per-tensor type mix:
Q4_K_M keeps the LM head and about half the layers' attn_v/ffn_down in Q6_K), with random blocks (random codes,
small fp16 scales): speed and memory do not depend on the values. Each load runs in a fresh process and reports
the resident memory it added (RSS), the weight bytes held, and the median time per token of one greedy stream.
Rounds alternate the files (and the trees: this one and each --baseline-ref commit's, on the same files); medians
are reported. The bars: Q4_K_M resident <= 1.15x its file, TPOT <= 1.1x Q4_0's.

    python benchmarks/gguf_quants.py [--shape tinyllama-1.1b] [--types Q4_0,Q4_K_M,...] [--rounds 3]
        [--baseline-ref GIT_REF] [--json out]
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import numpy as np

from pagedserve.benchmarks import common

SHAPES = {  # llama-architecture shapes whose matrices all tile by 256 (K-quant super-blocks)
    "tinyllama-1.1b": dict(vocab=32000, hidden=2048, inter=5632, layers=22, heads=32, kv_heads=4),
    # Llama-3.2-1B's layers at SmolLM2's vocabulary, so the bundled tokenizer can drive it (--tokenizer)
    "llama-3.2-1b-smolvocab": dict(vocab=49152, hidden=2048, inter=8192, layers=16, heads=32, kv_heads=8),
    # Llama-3.1-8B's layers, likewise at SmolLM2's vocabulary: its embedding and LM head are 49152 rows, not 128256
    "llama-3.1-8b-smolvocab": dict(vocab=49152, hidden=4096, inter=14336, layers=32, heads=32, kv_heads=8),
    "tiny": dict(vocab=512, hidden=256, inter=512, layers=2, heads=4, kv_heads=2),
}
# a typical |weight| of ~0.02 from random codes: each type's fp16 factors drawn at this scale
FACTOR = {"Q4_0": 4e-3, "Q4_1": 4e-3, "Q5_0": 2e-3, "Q5_1": 2e-3, "Q8_0": 2e-4, "Q4_K": 1e-4, "Q5_K": 5e-5,
          "Q6_K": 2e-5}
FP16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2),
               "Q5_K": (0, 2), "Q6_K": (208,)}  # byte offsets of each block's fp16 factors
FTYPES = ("Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")


def random_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, bytes per row] of `kind` blocks: random codes and sub-block scales, small fp16 factors."""
    from pagedserve.engine.quant.gguf_blocks import BLOCK_BYTES, BLOCK_WEIGHTS

    n = rows * cols // BLOCK_WEIGHTS[kind]
    raw = rng.integers(0, 256, size=(n, BLOCK_BYTES[kind]), dtype=np.uint8)
    for at in FP16_FIELDS[kind]:
        f = (rng.standard_normal(n) * FACTOR[kind]).astype(np.float16)
        raw[:, at:at + 2] = f.view(np.uint8).reshape(n, 2)
    return raw.reshape(rows, -1)


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers, and every third one between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def llama_cpp_type(name: str, ftype: str, layer: int, layers: int) -> str:
    """The block type llama.cpp's quantizer gives tensor `name` (GGUF naming) in file type `ftype`."""
    if ftype in ("Q8_0", "Q6_K"):
        return ftype
    if name == "output.weight":
        return "Q6_K"
    if ftype in ("Q4_0", "Q4_1"):
        return ftype
    base = {"Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K"}[ftype]
    if (name.endswith("attn_v.weight") or name.endswith("ffn_down.weight")) and _more_bits(layer, layers):
        return "Q6_K"
    return base


def write_gguf(path: str, shape: dict, ftype: str, seed: int = 0, tokenizer_from: str | None = None) -> dict[str, int]:
    """A llama-architecture GGUF of `shape` with random blocks in `ftype`'s mix; returns {type: tensor count}.
    `tokenizer_from`: a GGUF whose `tokenizer.*` metadata is copied in, so that other engines (llama.cpp refuses a
    file without a vocabulary) can serve the file with the same tokenizer; its vocabulary must be `shape`'s."""
    import gguf

    rng = np.random.default_rng(seed)
    h, inter, heads, kv = shape["hidden"], shape["inter"], shape["heads"], shape["kv_heads"]
    head_dim, layers = h // heads, shape["layers"]
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(layers)
    w.add_context_length(4096)
    w.add_embedding_length(h)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(shape["vocab"])
    if tokenizer_from:
        for key, f in gguf.GGUFReader(tokenizer_from).fields.items():
            if key.startswith("tokenizer."):
                w.add_key_value(key, f.contents(), f.types[0], f.types[-1] if len(f.types) > 1 else None)
    counts: dict[str, int] = {}

    def matrix(name: str, rows: int, cols: int, layer: int = 0) -> None:
        kind = llama_cpp_type(name, ftype, layer, layers)
        counts[kind] = counts.get(kind, 0) + 1
        w.add_tensor(name, random_blocks(kind, rows, cols, rng),
                     raw_dtype=gguf.GGMLQuantizationType[kind])

    matrix("token_embd.weight", shape["vocab"], h)
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(h, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(h, dtype=np.float32))
        for name, rows, cols in (("attn_q", h, h), ("attn_k", kv * head_dim, h), ("attn_v", kv * head_dim, h),
                                 ("attn_output", h, h), ("ffn_gate", inter, h), ("ffn_up", inter, h),
                                 ("ffn_down", h, inter)):
            matrix(f"blk.{i}.{name}.weight", rows, cols, i)
    w.add_tensor("output_norm.weight", np.ones(h, dtype=np.float32))
    matrix("output.weight", shape["vocab"], h)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return counts


def cached_gguf(shape: str, ftype: str, tokenizer_from: str | None = None, seed: int = 0) -> str:
    """`write_gguf`'s file, written once into the cache directory and reused: an 8B file is gigabytes and takes
    minutes. The name carries a digest of this module and the tokenizer's file, so a change to either writes anew."""
    from pagedserve.engine.machine import cache_dir

    digest = hashlib.sha256(Path(__file__).read_bytes())
    if tokenizer_from:
        st = os.stat(tokenizer_from)
        digest.update(f"{os.path.abspath(tokenizer_from)}:{st.st_size}:{st.st_mtime_ns}".encode())
    path = cache_dir() / "gguf" / f"{shape}-{ftype}-seed{seed}-{digest.hexdigest()[:12]}.gguf"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        try:  # written beside, then renamed: an interrupted write never passes for a whole file
            write_gguf(str(tmp), SHAPES[shape], ftype, seed, tokenizer_from)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    return str(path)


# Runs in a fresh process: what loading the file added to the resident set, and one greedy stream's TPOT.
WORKER = r"""
import gc, json, sys, time
import torch
from pagedserve.engine import LLM, SamplingParams, cpu_kernels
from pagedserve.engine.config import resolve_dtype
from pagedserve.engine.models.loader import build_model, load_config, resident_bytes, weight_bytes
from pagedserve.engine.quant.loading import QuantSpec
job = json.loads(sys.argv[1])
cpu_kernels.load()
cfg = load_config(job["path"])
dtype = resolve_dtype("auto", torch.device("cpu"))  # the engine's default here
before = resident_bytes()
t0 = time.perf_counter()
model = build_model(job["path"], cfg, dtype, torch.device("cpu"), 1024, quant=QuantSpec("auto"))
load_s = time.perf_counter() - t0
resident = resident_bytes() - before
weights = sum(weight_bytes(model).values())
del model
gc.collect()
llm = LLM(job["path"], tokenizer=job["no_tokenizer"], memory_gib=0.25, max_model_len=1024)
prompt = [(7 * i + 3) % 500 for i in range(32)]
params = SamplingParams(max_tokens=job["tokens"], temperature=0, ignore_eos=True)
llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up
r = llm.generate([prompt], params)[0]
tpot = (r.metrics.finish_time - r.metrics.first_token_time) / max(len(r.token_ids) - 1, 1)
print(json.dumps({"load_s": load_s, "resident_mib": resident / 2**20, "weight_mib": weights / 2**20,
                  "tpot_ms": tpot * 1e3, "dtype": str(dtype).removeprefix("torch.")}))
"""


def main(argv: list[str] | None = None) -> None:
    ap = common.parser(__doc__, rounds=3)
    ap.add_argument("--shape", default="tinyllama-1.1b", choices=list(SHAPES))
    ap.add_argument("--types", default=",".join(FTYPES), help=f"file types ({', '.join(FTYPES)})")
    ap.add_argument("--tokens", type=int, default=48, help="decoded tokens per timed stream")
    args = ap.parse_args(argv)
    types = [t.strip() for t in args.types.split(",") if t.strip()]
    trees = common.trees(args.baseline_ref)
    with tempfile.TemporaryDirectory() as tmp:
        files, mixes = {}, {}
        for t in types:
            files[t] = os.path.join(tmp, f"{args.shape}-{t}.gguf")
            mixes[t] = write_gguf(files[t], SHAPES[args.shape], t)
            print(f"wrote {files[t]}: {os.path.getsize(files[t]) / 2**20:.0f} MiB, {mixes[t]}", flush=True)
        no_tok = os.path.join(tmp, "no-tokenizer")
        os.makedirs(no_tok)

        def contestant(t: str, tree):
            job = {"path": files[t], "no_tokenizer": no_tok, "tokens": args.tokens}
            return lambda: common.run_worker(tree, WORKER, json.dumps(job))

        # each contestant a (tree, type): "Q4_K_M" in this tree, "Q4_K_M @ <commit>" in a baseline's
        names = {(label, t): t if label == "this" else f"{t} @ {label}" for label in trees for t in types}
        results = common.interleaved(args.rounds, {names[label, t]: contestant(t, tree)
                                                   for label, tree in trees.items() for t in types})
        med = {n: common.medians(r) for n, r in results.items()}
        sizes = {t: os.path.getsize(files[t]) / 2**20 for t in types}
    rows = []
    for (label, t), n in names.items():
        m, base, this = med[n], med.get(names.get((label, "Q4_0"))), med[names["this", t]]
        rows.append([n, f"{sizes[t]:.0f}", f"{m['weight_mib']:.0f}", f"{m['resident_mib']:.0f}",
                     f"{m['resident_mib'] / sizes[t]:.2f}x", f"{m['load_s']:.1f}", f"{m['tpot_ms']:.1f}",
                     common.ratio(m["tpot_ms"], base["tpot_ms"] if base else None),
                     common.ratio(m["tpot_ms"], this["tpot_ms"])])
    text = common.table(["type", "file MiB", "weights MiB", "resident +MiB", "resident/file", "load s", "TPOT ms",
                         "TPOT vs Q4_0", "TPOT vs this"], rows,
                        f"GGUF types at their own bits, {args.shape} shape, random blocks "
                        f"(medians of {args.rounds} interleaved rounds)")
    common.write_json(args.json, {"shape": args.shape, "files_mib": sizes, "mixes": mixes, "results": results,
                                  "medians": med, "table": text})


if __name__ == "__main__":
    main()
