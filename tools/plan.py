"""`pagedserve plan`: memory = weights + KV bytes/token x resident tokens + activation headroom.

Solved for the resident tokens T that fit a memory size, then a users x context grid (fits when
users x context <= T). The chapter's shapes: 7B and 70B with 8 KV heads of 128 (GQA), 13B with 40 heads
of 128 (full multi-head attention), weights at nominal parameter counts; "8GB" means 8 GiB; the headroom
for activations is 1.5 GiB. These are the chapter's own assumptions, so its tables come out exactly
(docs/performance.md has the rows; tests/test_plan.py holds them).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass

from ..engine.errors import ArgumentParser

GiB = 2**30
# bits per weight, scales included where the format has them (int4: fp16 scale per group of 128)
WEIGHT_BITS = {"fp32": 32.0, "float32": 32.0, "fp16": 16.0, "bf16": 16.0, "float16": 16.0, "bfloat16": 16.0,
               "int8": 8.0, "int8-tensor": 8.0, "int4": 4.125, "int4-tensor": 4.0, "nf4": 4.25}
KV_BYTES = {"fp32": 4, "float32": 4, "fp16": 2, "bf16": 2, "float16": 2, "bfloat16": 2, "fp8": 1, "int8": 1}
DEFAULT_HEADROOM_GIB = 1.5
GRID_USERS = (1, 8, 32)
GRID_CONTEXT = (2048, 8192, 32768)


@dataclass(frozen=True)
class Shape:
    name: str
    params: float
    layers: int
    kv_heads: int
    head_dim: int

    def kv_bytes_per_token(self, kv_dtype: str) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * KV_BYTES[kv_dtype]


SHAPES = {
    "7b": Shape("7B", 7e9, 32, 8, 128),
    "13b": Shape("13B", 13e9, 40, 40, 128),
    "70b": Shape("70B", 70e9, 80, 8, 128),
}


@dataclass
class PlanRow:
    model: str
    format: str
    memory_gib: float
    weights_gib: float
    kv_bytes_per_token: int
    max_tokens: int  # 0: the weights (plus headroom) do not fit
    fits: dict[str, bool]


def plan(shape: Shape, fmt: str, memory_gib: float, kv_dtype: str = "fp16",
         headroom_gib: float = DEFAULT_HEADROOM_GIB) -> PlanRow:
    weights = shape.params * WEIGHT_BITS[fmt] / 8
    per_token = shape.kv_bytes_per_token(kv_dtype)
    free = memory_gib * GiB - weights - headroom_gib * GiB
    tokens = max(0, int(free // per_token))
    fits = {f"{u}x{c // 1024}k": u * c <= tokens for u in GRID_USERS for c in GRID_CONTEXT}
    return PlanRow(shape.name, fmt, memory_gib, weights / GiB, per_token, tokens, fits)


def shape_from_model(path: str | None) -> Shape:
    """A real model's shape: parameter count from its config (tied embeddings counted once)."""
    from ..engine.config import bundled_model_path
    from ..engine.models.loader import load_config

    c = load_config(path or bundled_model_path())
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_layer = c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    params = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2) + c.num_layers * per_layer
    name = (path or "SmolLM2-135M-Instruct").rstrip("/").split("/")[-1]
    return Shape(name, float(params), c.num_layers, c.num_kv_heads, c.head_dim)


def parse_memory(text: str) -> float:
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*(GB|GiB|G|MB|MiB|M)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"memory size {text!r}: use e.g. 8GB, 16GiB, 512MB")
    value, unit = float(m.group(1)), (m.group(2) or "GB").upper()
    return value / 1024 if unit.startswith("M") else value


def format_table(rows: list[PlanRow]) -> str:
    grid = list(rows[0].fits)
    lines = ["| model | weights | weights GiB | KV / token | max resident tokens | " + " | ".join(grid) + " |",
             "|---|---|---:|---:|---:|" + "---|" * len(grid)]
    for r in rows:
        kv = f"{r.kv_bytes_per_token / 1024:,.0f} KiB"
        tokens = f"{r.max_tokens:,}" if r.max_tokens else "does not fit"
        lines.append(f"| {r.model} | {r.format} | {r.weights_gib:.1f} | {kv} | {tokens} | "
                     + " | ".join("fits" if r.fits[g] else "-" for g in grid) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = ArgumentParser(prog="pagedserve plan", description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--shape", default=None,
                     help=f"comma-separated chapter shapes ({', '.join(SHAPES)}); default: all three")
    src.add_argument("--model", default=None, help="a GGUF file or HF directory: its own shape")
    ap.add_argument("--memory", default="8GB,16GB,24GB", help="comma-separated memory sizes (GB = GiB)")
    ap.add_argument("--quantization", default="fp16,int8,int4",
                    help=f"comma-separated weight formats ({', '.join(WEIGHT_BITS)})")
    ap.add_argument("--kv-dtype", default="fp16", choices=sorted(KV_BYTES))
    ap.add_argument("--headroom-gib", type=float, default=DEFAULT_HEADROOM_GIB, help="activations, allocator slack")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not (math.isfinite(args.headroom_gib) and args.headroom_gib >= 0):
        ap.error(f"--headroom-gib must be a number >= 0, got {args.headroom_gib}")
    try:
        memories = [(text.strip(), parse_memory(text)) for text in args.memory.split(",")]
        shapes = [shape_from_model(args.model)] if args.model is not None else []
    except (ValueError, OSError) as e:
        ap.error(str(e))
    if args.model is None:
        names = [s.strip().lower() for s in (args.shape or ",".join(SHAPES)).split(",")]
        unknown = [n for n in names if n not in SHAPES]
        if unknown:
            ap.error(f"unknown shape(s) {unknown}; known: {', '.join(SHAPES)}")
        shapes = [SHAPES[n] for n in names]
    formats = [f.strip() for f in args.quantization.split(",")]
    bad = [f for f in formats if f not in WEIGHT_BITS]
    if bad:
        ap.error(f"unknown format(s) {bad}; known: {', '.join(WEIGHT_BITS)}")
    out = []
    for mem_text, mem in memories:
        rows = [plan(s, f, mem, args.kv_dtype, args.headroom_gib) for s in shapes for f in formats]
        print(f"\n{mem_text} ({mem:g} GiB; KV {args.kv_dtype}; {args.headroom_gib:g} GiB headroom; "
              f"grid = users x context)\n")
        print(format_table(rows))
        out += rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": [asdict(r) for r in out]}, f, indent=2)
