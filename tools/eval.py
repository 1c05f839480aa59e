"""`pagedserve eval`: the chapter's quality table, one row per weight format plus the unquantized reference.

Columns: bits/weight (storage, scales included, mean over the projection matrices), resident weight MiB,
relative weight error ‖W − Ŵ‖/‖W‖ over the projection matrices (mean and worst), perplexity on the first
`tokens` tokens of a text (through the engine's own prompt logprobs), a battery of 16 short factual questions
(greedy, answer substring), and agreement: the reference decodes each battery prompt greedily for 9 tokens
(16 x 9 = 144 positions), and each format, fed the same prefixes, is asked for its top token at each one.

Every format is loaded from the same file the way a user would load it (`quantization=...`). On a GGUF whose
tensors are already quantized (the bundled SmolLM2 is Q4_1 + Q8_0), the "reference" is that GGUF dequantized:
it carries the file's own rounding, and `auto` (the default: the file's blocks as they are) reproduces it
exactly, as int4 with group 32 does for Q4 blocks.
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
from dataclasses import asdict, dataclass

from ..engine.config import bundled_text_path
from ..engine.errors import ArgumentParser
from ..engine.quant.formats import FORMATS

CHOICES = ("auto",) + FORMATS

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AGREEMENT_TOKENS = 9  # per battery prompt: 16 x 9 = 144 positions

# (question, accepted answers); matched case-insensitively as whole words in the greedy reply
BATTERY: list[tuple[str, tuple[str, ...]]] = [
    ("What is the capital of France?", ("Paris",)),
    ("What is the largest planet in our solar system?", ("Jupiter",)),
    ("How many days are there in a week?", ("seven", "7")),
    ("At what temperature in degrees Celsius does water freeze?", ("0", "zero")),
    ("Who wrote Romeo and Juliet?", ("Shakespeare",)),
    ("What is the chemical symbol for gold?", ("Au",)),
    ("What is the capital of Japan?", ("Tokyo",)),
    ("How many legs does a spider have?", ("eight", "8")),
    ("Which planet is known as the Red Planet?", ("Mars",)),
    ("Who was the first president of the United States?", ("Washington",)),
    ("What is the chemical formula of water?", ("H2O", "H₂O")),
    ("How many continents are there on Earth?", ("seven", "7")),
    ("What is the capital of Italy?", ("Rome",)),
    ("What language is mainly spoken in Spain?", ("Spanish",)),
    ("What gas do plants absorb from the air for photosynthesis?", ("carbon dioxide", "CO2")),
    ("What is the boiling point of water at sea level in degrees Celsius?", ("100", "one hundred")),
]


@dataclass
class Row:
    format: str
    bits_per_weight: float
    weight_mib: float
    rel_error_mean: float
    rel_error_max: float
    perplexity: float
    battery: int
    agreement: float
    agreement_positions: int = 0
    seconds: float = 0.0


def weight_errors(model_path: str, fmt: str, group: int) -> tuple[float, float, float]:
    """(mean, worst) relative error and mean storage bits over the checkpoint's projection matrices,
    quantized exactly as loading does (GGUF Q4 blocks map directly where the format allows)."""
    from ..engine.models import loader
    from ..engine.quant.gguf_blocks import GGUFBlocks
    from ..engine.quant.loading import QuantSpec, quantize_tensor

    cfg = loader.load_config(model_path)
    stream = loader.checkpoint_tensors(model_path, cfg, raw=True)
    spec = QuantSpec(fmt, group)
    errs, bits, count = [], 0.0, 0
    for name, t in stream:
        if name.split(".")[-2] not in PROJECTIONS or not name.endswith("weight"):
            continue
        dense = t.dequantize() if isinstance(t, GGUFBlocks) else t.float()
        if fmt == "auto" and not isinstance(t, GGUFBlocks):  # a float tensor stays as it is
            errs.append(0.0)
            bits += 8 * t.element_size() * t.numel()
            count += t.numel()
            continue
        qw = quantize_tensor(t, spec, group)
        diff = (dense - qw.dequantize()).norm().item()
        errs.append(diff / max(dense.norm().item(), 1e-30))
        bits += qw.bits_per_weight * dense.numel()
        count += dense.numel()
    return sum(errs) / len(errs), max(errs), bits / count


def battery_prompts(tokenizer) -> list[list[int]]:
    from ..engine.tokenizer import apply_chat_template

    out = []
    for q, _ in BATTERY:
        msgs = [{"role": "user", "content": q + " Answer in a few words."}]
        if getattr(tokenizer, "chat_template", None):
            out.append(apply_chat_template(tokenizer, msgs))
        else:  # a base model: a plain Q/A prompt
            out.append(tokenizer.encode(f"Question: {q}\nAnswer:", add_special_tokens=False))
    return out


def correct(reply: str, answers: tuple[str, ...]) -> bool:
    return any(re.search(r"(?<!\w)" + re.escape(a.lower()) + r"(?!\w)", reply.lower()) for a in answers)


def evaluate(llm, text_ids: list[int], prompts: list[list[int]], reference_paths: list[list[int]] | None,
             step=lambda stage: None):
    """(perplexity, battery score, greedy continuations, agreement or None) for one loaded engine; `step(stage)`
    is called as each stage starts."""
    from ..engine.sampling_params import SamplingParams

    step("perplexity")
    [scored] = llm.generate([text_ids], SamplingParams(max_tokens=0, prompt_logprobs=0))
    lps = [e.logprob for e in scored.prompt_logprobs[1:]]
    ppl = math.exp(-sum(lps) / len(lps))
    step("battery")
    replies = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0))
    score = sum(correct(r.text, ans) for r, (_, ans) in zip(replies, BATTERY))
    paths = [r.token_ids for r in llm.generate(prompts, SamplingParams(max_tokens=AGREEMENT_TOKENS, temperature=0,
                                                                       ignore_eos=True))]
    step("agreement")
    agreement = None
    if reference_paths is not None:  # teacher-forced: same prefix, does our top-1 match the reference's token?
        outs = llm.generate([p + r for p, r in zip(prompts, reference_paths)],
                            SamplingParams(max_tokens=0, prompt_logprobs=1))
        same = [o.prompt_logprobs[len(p) + j].top[0][0] == tok
                for p, r, o in zip(prompts, reference_paths, outs) for j, tok in enumerate(r)]
        agreement = (sum(same), len(same))
    return ppl, score, paths, agreement


def run(model: str | None, formats: list[str], text_path: str, tokens: int, dtype: str,
        group_size: int | None) -> list[Row]:
    from tqdm import tqdm

    from ..engine.config import check_dtype
    from ..engine.llm import LLM
    from ..engine.models.loader import gguf_has_q4, weight_bytes
    from ..engine.models.resolver import resolve_model
    from ..engine.quant.loading import QuantSpec, resolve_group_size

    check_dtype(dtype)
    model_path = resolve_model(model).path
    with open(text_path, encoding="utf-8") as f:
        text = f.read()
    print(f"pagedserve eval: model {model or 'bundled SmolLM2-135M-Instruct'}, text {text_path}, {tokens} tokens, "
          f"dtype {dtype}", file=sys.stderr)
    rows: list[Row] = []
    reference_paths, text_ids = None, None
    formats = ["none"] + [f for f in formats if f != "none"]
    stages = ("load", "perplexity", "battery", "agreement", "weight error")
    bar = tqdm(total=len(formats) * len(stages), unit="stage", file=sys.stderr, dynamic_ncols=True)

    def step(fmt: str, stage: str) -> None:
        if bar.n or stage != "load":
            bar.update(1)
        bar.set_description(f"{fmt}: {stage}")

    for fmt in formats:
        t0 = time.perf_counter()
        step(fmt, "load")
        llm = LLM(model_path, quantization=fmt, quant_group_size=group_size, dtype=dtype,
                  max_num_batched_tokens=max(2048, tokens), memory_gib=0.5)
        tok = llm.tokenizer
        if text_ids is None:  # the same tokenizer for every format: the text's first `tokens` tokens, once
            text_ids = tok.encode(text[:tokens * 16], add_special_tokens=False)[:tokens]
            if len(text_ids) < tokens:
                raise ValueError(f"{text_path} has only {len(text_ids)} tokens; need {tokens}")
        prompts = battery_prompts(tok)
        ppl, score, paths, agree = evaluate(llm, text_ids, prompts, reference_paths, lambda s, f=fmt: step(f, s))
        step(fmt, "weight error")
        sizes = weight_bytes(llm.engine.runner.model)
        if fmt == "none":
            reference_paths = paths
            bits = 8.0 * llm.engine.dtype.itemsize
            err_mean = err_max = 0.0
            agreement, positions = 1.0, sum(len(p) for p in paths)
        else:
            group = resolve_group_size(QuantSpec(fmt, group_size), llm.engine.runner.model,
                                       gguf_has_q4(model_path))
            err_mean, err_max, bits = weight_errors(model_path, fmt, group)
            agreement, positions = agree[0] / agree[1], agree[1]
        row = Row(fmt, round(bits, 4), round(sum(sizes.values()) / 2**20, 2), round(err_mean, 5), round(err_max, 5),
                  round(ppl, 3), score, round(agreement, 4), positions, round(time.perf_counter() - t0, 1))
        rows.append(row)
        bar.write(f"  {fmt}: bits {row.bits_per_weight:.3f}, {row.weight_mib:.1f} MiB, error "
                  f"{row.rel_error_mean:.4f} / {row.rel_error_max:.4f}, perplexity {row.perplexity:.2f}, "
                  f"battery {row.battery}/16, agreement {row.agreement:.3f} ({row.seconds:.0f} s)")
        del llm
    bar.update(1)
    bar.close()
    return rows


def format_table(rows: list[Row], tokens: int) -> str:
    head = (f"| format | bits/weight | weight MiB | rel. error mean | rel. error worst | perplexity ({tokens} tok) "
            f"| battery /{len(BATTERY)} | agreement |")
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ppl = f"{r.perplexity:,.2f}" if r.perplexity < 1e6 else f"{r.perplexity:.3g}"
        lines.append(f"| {r.format} | {r.bits_per_weight:.3f} | {r.weight_mib:.1f} | {r.rel_error_mean:.4f} | "
                     f"{r.rel_error_max:.4f} | {ppl} | {r.battery} | "
                     f"{round(r.agreement * r.agreement_positions)}/{r.agreement_positions} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = ArgumentParser(prog="pagedserve eval", description=__doc__.split("\n")[0])
    ap.add_argument("--quantization", default=",".join(CHOICES),
                    help=f"comma-separated formats to compare with the unquantized reference ({', '.join(CHOICES)})")
    ap.add_argument("--model", default=None, help="GGUF file or HF directory (default: the bundled SmolLM2)")
    ap.add_argument("--text", default=bundled_text_path(), help="text for perplexity (default: the shipped book)")
    ap.add_argument("--tokens", type=int, default=2048, help="perplexity tokens (256 runs a format in well under a "
                                                             "minute on a 2-core CPU)")
    ap.add_argument("--dtype", default="float32", help="activation/reference dtype (float32 as in the chapter)")
    ap.add_argument("--quant-group-size", type=int, default=None)
    ap.add_argument("--json", default=None, help="write {'rows': [...]} here")
    args = ap.parse_args(argv)
    formats = [f.strip() for f in args.quantization.split(",") if f.strip()]
    bad = [f for f in formats if f not in CHOICES + ("none",)]
    if bad:
        ap.error(f"unknown format(s) {bad}; choose from {', '.join(CHOICES)}")
    if args.tokens < 2:
        ap.error(f"--tokens must be at least 2 (a perplexity scores tokens after the first), got {args.tokens}")
    try:  # a model, text, dtype or group size that cannot be: one line
        rows = run(args.model, formats, args.text, args.tokens, args.dtype, args.quant_group_size)
    except (ValueError, OSError) as e:
        ap.error(str(e))
    print(format_table(rows, args.tokens))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model or "bundled", "tokens": args.tokens, "dtype": args.dtype,
                       "rows": [asdict(r) for r in rows]}, f, indent=2)
