"""KV-cache memory: the formula against what the engine actually allocates.

Per token, every layer stores one key and one value vector per key-value head:

    bytes/token = 2 * layers * kv_heads * head_dim * dtype_bytes

Table 1 builds a real engine for each model shape (weights on the meta device: nothing to load, only
the KV cache is allocated, with a handful of blocks) and divides the bytes of its KV tensor by the
tokens it holds (runner.kv_cache_bytes() / runner.kv_capacity_tokens). Hypothetical variants (full
multi-head attention for Qwen2.5-0.5B, a 7B-class model) are measured the same way through a
ModelRunner for a modified shape. Table 2 is the "same total tokens -> same cache" claim: 32 x 2048,
64 x 1024 and 128 x 512 sequences x tokens, each allocated for real in a BlockManager.

    python benchmarks/seed/kv_memory.py [--quick] [--json out.json]
"""

from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from pagedserve.benchmarks.common import table  # noqa: E402
from pagedserve.benchmarks.seed import common  # noqa: E402
from pagedserve.engine import LLMEngine, SamplingParams, make_config  # noqa: E402
from pagedserve.engine.block_manager import BlockManager  # noqa: E402
from pagedserve.engine.config import ModelConfig, bundled_model_path  # noqa: E402
from pagedserve.engine.model_runner import ModelRunner  # noqa: E402
from pagedserve.engine.models.llama import LlamaModel  # noqa: E402
from pagedserve.engine.models.loader import RANDOM_SHAPES, load_config  # noqa: E402
from pagedserve.engine.sequence import Sequence  # noqa: E402

SHAPES = ["smollm2-135m", "qwen2.5-0.5b", "qwen3-0.6b", "llama-3.2-1b"]
BLOCK = 16
NUM_BLOCKS = 4  # a few blocks are enough to measure bytes per token


def formula(cfg: ModelConfig, dtype: torch.dtype) -> int:
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize


def engine_without_weights(shape: str, dtype: str) -> LLMEngine:
    """A real LLMEngine over a meta-device model: the KV cache is allocated for real, weights are not."""
    path = f"random:{shape}"
    cfg = load_config(path)
    capacity = NUM_BLOCKS * BLOCK
    with torch.device("meta"):
        model = LlamaModel(cfg, capacity)
    config = make_config(model=path, dtype=dtype, device="cpu", num_blocks=NUM_BLOCKS, block_size=BLOCK,
                         max_model_len=capacity)
    return LLMEngine(config, model=model)


def measured_row(name: str, cfg: ModelConfig, runner: ModelRunner, note: str = "") -> dict:
    per_token = runner.kv_cache_bytes() / runner.kv_capacity_tokens
    storage = runner.kv_cache.untyped_storage().nbytes()  # what the allocator handed out
    per_block = runner.kv_cache_bytes() // runner.num_blocks
    f = formula(cfg, runner.dtype)
    return {"model": name, "note": note, "dtype": common.DTYPE_NAMES[runner.dtype], "layers": cfg.num_layers,
            "q_heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
            "kv_tensor_shape": list(runner.kv_cache.shape), "allocated_bytes": storage,
            "capacity_tokens": runner.kv_capacity_tokens, "measured_bytes_per_token": per_token,
            "formula_bytes_per_token": f, "bytes_per_block": per_block,
            "bytes_for_295_tokens": -(-295 // runner.block_size) * per_block,
            "gib_at_128k_tokens": f * 131072 / 2**30}


def shape_rows(dtypes: list[str]) -> list[dict]:
    rows = []
    bundled = load_config(bundled_model_path())
    same = all(getattr(bundled, k) == RANDOM_SHAPES["smollm2-135m"][k]
               for k in ("num_layers", "num_kv_heads", "head_dim", "num_heads"))
    for dtype in dtypes:
        for shape in SHAPES:
            eng = engine_without_weights(shape, dtype)
            note = "= bundled GGUF's shape" if shape == "smollm2-135m" and same else ""
            rows.append(measured_row(shape, eng.model_config, eng.runner, note))
        # variants: same model with full multi-head attention (the counterfactual the chapter prices),
        # and a 7B-class shape (32 layers, 8 KV heads of 128)
        qwen = load_config("random:qwen2.5-0.5b")
        variants = [("qwen2.5-0.5b as MHA", dataclasses.replace(qwen, num_kv_heads=qwen.num_heads),
                     "14 KV heads"),
                    ("qwen2.5-0.5b as MQA", dataclasses.replace(qwen, num_kv_heads=1), "1 KV head"),
                    ("7B-class", dataclasses.replace(qwen, num_layers=32, num_heads=32, num_kv_heads=8,
                                                     head_dim=128, hidden_size=4096), "32 L, 8 KV x 128")]
        for name, cfg, note in variants:
            config = make_config(model="random:qwen2.5-0.5b", dtype=dtype, device="cpu", num_blocks=NUM_BLOCKS,
                                 block_size=BLOCK)
            runner = ModelRunner(config, cfg, None, torch.device("cpu"), common.load_dtype(dtype))
            rows.append(measured_row(name, cfg, runner, note))
    return rows


def same_total_rows(splits: list[tuple[int, int]], bytes_per_block: int) -> list[dict]:
    """Allocate every sequence's blocks in a BlockManager and count them."""
    need = max(s * -(-t // BLOCK) for s, t in splits)
    bm = BlockManager(need + 16, BLOCK, enable_prefix_caching=False)
    rows = []
    for num_seqs, tokens in splits:
        seqs = [Sequence(i, f"r{i}", list(range(tokens)), SamplingParams(max_tokens=1), 1) for i in range(num_seqs)]
        for s in seqs:
            assert bm.can_allocate(s, tokens)
            bm.allocate(s, tokens)
        bm.check_integrity(seqs)
        used = bm.num_used_blocks
        rows.append({"sequences": num_seqs, "tokens_each": tokens, "total_tokens": num_seqs * tokens,
                     "blocks": used, "slots": used * BLOCK, "bytes": used * bytes_per_block,
                     "waste_tokens": used * BLOCK - num_seqs * tokens})
        for s in seqs:
            bm.free(s)
        bm.check_integrity([])
        assert bm.num_used_blocks == 0
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = common.base_parser(__doc__)
    ap.add_argument("--dtypes", nargs="+", default=None, help="default: float16 float32 (--quick: float16)")
    args = ap.parse_args(argv)
    result = common.setup(args)
    dtypes = args.dtypes or (["float16"] if args.quick else ["float16", "float32"])

    rows = shape_rows(dtypes)
    result["shapes"] = rows
    table(
        ["model", "dtype", "L", "Hq", "Hkv", "d", "measured B/token", "formula B/token", "295-token request B",
         "GiB @128k tok", "note"],
        [[r["model"], r["dtype"], r["layers"], r["q_heads"], r["kv_heads"], r["head_dim"],
          f"{r['measured_bytes_per_token']:,.0f}", f"{r['formula_bytes_per_token']:,}",
          f"{r['bytes_for_295_tokens']:,}", f"{r['gib_at_128k_tokens']:.2f}", r["note"]] for r in rows],
        title=f"1. KV bytes per token: engine allocation (kv_cache_bytes / capacity, {NUM_BLOCKS} blocks of "
              f"{BLOCK}) vs 2 * layers * kv_heads * head_dim * dtype_bytes. A 295-token request holds "
              f"ceil(295/{BLOCK}) = 19 blocks.")

    qwen16 = next(r for r in rows if r["model"] == "qwen2.5-0.5b" and r["dtype"] == dtypes[0])
    splits = [(32, 2048), (64, 1024), (128, 512)] + ([] if args.quick else [(100, 655), (1000, 65)])
    same = same_total_rows(splits, qwen16["bytes_per_block"])
    result["same_total"] = {"model": "qwen2.5-0.5b", "dtype": qwen16["dtype"], "rows": same}
    table(
        ["sequences", "tokens each", "total tokens", "blocks", "token slots", "bytes", "MiB", "padding tokens"],
        [[r["sequences"], r["tokens_each"], f"{r['total_tokens']:,}", f"{r['blocks']:,}", f"{r['slots']:,}",
          f"{r['bytes']:,}", f"{r['bytes'] / 2**20:,.1f}", r["waste_tokens"]] for r in same],
        title=f"2. Same total tokens -> same cache: blocks allocated in a BlockManager "
              f"(qwen2.5-0.5b, {qwen16['dtype']}, {qwen16['bytes_per_block']:,} bytes per {BLOCK}-token block)")

    mha = next(r for r in rows if r["model"] == "qwen2.5-0.5b as MHA" and r["dtype"] == dtypes[0])
    mismatches = [f"{r['model']} {r['dtype']}" for r in rows
                  if r["measured_bytes_per_token"] != r["formula_bytes_per_token"]]
    even = [r for r in same if r["total_tokens"] == 65536]
    checks = {
        "measured bytes/token == formula for every shape and dtype": (
            not mismatches, f"{len(rows)} rows" + (f"; mismatches: {mismatches}" if mismatches else "")),
        "32x2048 = 64x1024 = 128x512 hold the same blocks and bytes": (
            len({(r["blocks"], r["bytes"]) for r in even}) == 1,
            ", ".join(f"{r['sequences']}x{r['tokens_each']}: {r['blocks']} blocks" for r in even)),
        "GQA saves exactly Hq/Hkv (qwen2.5-0.5b: 7x)": (
            mha["measured_bytes_per_token"] == 7 * qwen16["measured_bytes_per_token"],
            f"{mha['measured_bytes_per_token']:,.0f} vs {qwen16['measured_bytes_per_token']:,.0f} bytes/token"),
    }
    if qwen16["dtype"] in ("float16", "bfloat16"):
        checks["qwen2.5-0.5b in 16-bit: 12,288 bytes/token and 768 MiB for 65,536 tokens"] = (
            qwen16["measured_bytes_per_token"] == 12288 and all(r["bytes"] == 768 * 2**20 for r in even),
            f"{qwen16['measured_bytes_per_token']:,.0f} bytes/token, {even[0]['bytes'] / 2**20:.0f} MiB")
    return common.finish(result, checks, args)


if __name__ == "__main__":
    main()
