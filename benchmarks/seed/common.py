"""What the chapter's experiments share beyond benchmarks/common.py: one model load per (model, dtype) per process,
engines over shared weights, step timings through the engine, prompts from the book, checks.

Every script here is a `main(argv) -> dict` that prints its tables (benchmarks.common.table), writes `--json PATH`,
and ends with `finish(...)`, which prints each check and exits non-zero when one fails.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import torch

from pagedserve.benchmarks.common import parser, timed, write_json
from pagedserve.engine import LLMEngine, SamplingParams, make_config
from pagedserve.engine.config import ModelConfig, bundled_model_path, resolve_dtype
from pagedserve.engine.models.llama import LlamaModel
from pagedserve.engine.models.loader import build_model, load_config
from pagedserve.engine.tokenizer import load_tokenizer

QWEN = "random:qwen2.5-0.5b"  # the chapter's model (24 layers, 14 q heads, 2 kv heads, head dim 64)

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


# ---- models and engines ---------------------------------------------------------------------------
@dataclass
class Loaded:
    """One set of weights, shared by every engine a script builds."""

    path: str
    config: ModelConfig
    model: LlamaModel
    tokenizer: object  # None for random weights
    dtype: torch.dtype
    device: torch.device
    load_s: float

    @property
    def name(self) -> str:
        return "SmolLM2-135M-Instruct (bundled GGUF)" if self.path == _bundled() else self.path

    @property
    def dtype_name(self) -> str:
        return DTYPE_NAMES.get(self.dtype, str(self.dtype))


_LOADED: dict[tuple[str, torch.dtype, str], Loaded] = {}


def _bundled() -> str:
    return bundled_model_path()


def load(model: str | None = None, dtype: str = "auto", device: str = "auto") -> Loaded:
    """Weights for `model` (None = bundled SmolLM2) in `dtype`; loaded once per process and reused."""
    path = model or _bundled()
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    dt = resolve_dtype(dtype, dev)
    key = (path, dt, str(dev))
    if key not in _LOADED:
        t0 = time.perf_counter()
        cfg = load_config(path)
        weights = build_model(path, cfg, dt, dev, cfg.max_position_embeddings)
        tok = load_tokenizer(path)
        _LOADED[key] = Loaded(path, cfg, weights, tok, dt, dev, time.perf_counter() - t0)
    return _LOADED[key]


def load_dtype(name: str, device: str = "cpu") -> torch.dtype:
    return resolve_dtype(name, torch.device(device))


def engine(loaded: Loaded, **options) -> LLMEngine:
    """A fresh engine (its own KV cache, block manager, scheduler) over the shared weights."""
    if "num_blocks" in options and "max_model_len" not in options:  # small caches: no capping warning
        capacity = options["num_blocks"] * options.get("block_size", 16)
        options["max_model_len"] = min(capacity, loaded.config.max_position_embeddings)
    cfg = make_config(model=loaded.path, dtype=loaded.dtype_name, device=str(loaded.device), **options)
    return LLMEngine(cfg, model=loaded.model, tokenizer=loaded.tokenizer)


def blocks_for(tokens: int, block_size: int = 16, slack: int = 4) -> int:
    return -(-tokens // block_size) + slack


def greedy(max_tokens: int, logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=logprobs)


def run_all(eng: LLMEngine) -> dict[str, dict]:
    """Step until idle; per request id: token ids, logprobs, finish metrics."""
    res: dict[str, dict] = {}
    while eng.has_unfinished():
        for out in eng.step():
            r = res.setdefault(out.request_id, {"tokens": [], "logprobs": []})
            r["tokens"] += out.new_token_ids
            r["logprobs"] += out.logprobs
            if out.finished:
                r["metrics"] = out.metrics
                r["num_cached_tokens"] = out.num_cached_tokens
    return res


def prefill_times(eng: LLMEngine, ids: list[int], repeats: int, warmup: int = 1) -> list[float]:
    """Wall time of one engine step that prefills all of `ids` from nothing and samples a token.

    The engine must have prefix caching off (every repeat is a real, full recompute) and a token
    budget >= len(ids) (one step, no chunking). The first `warmup` runs are not timed.
    """
    assert not eng.config.cache.enable_prefix_caching
    assert eng.config.scheduler.max_num_batched_tokens >= len(ids)
    times = []
    for r in range(warmup + repeats):
        rid = f"prefill-{len(ids)}-{r}-{time.monotonic_ns()}"
        eng.add_request(rid, ids, greedy(1))
        t = timed(eng.step, eng.runner.device)
        assert not eng.has_unfinished(), "the prefill did not finish in one step"
        if r >= warmup:
            times.append(t)
    return times


def decode_times(eng: LLMEngine, ids: list[int], steps: int) -> list[float]:
    """Wall times of `steps` engine steps that each decode one token against a cache of len(ids)+i."""
    assert eng.config.scheduler.max_num_batched_tokens >= len(ids)
    rid = f"decode-{len(ids)}-{time.monotonic_ns()}"
    eng.add_request(rid, ids, greedy(steps + 1))
    eng.step()  # the prefill (and first token): not timed
    times = [timed(eng.step, eng.runner.device) for _ in range(steps)]
    assert not eng.has_unfinished()
    return times


def batch_decode_times(eng: LLMEngine, prompts: list[list[int]], steps: int) -> list[float]:
    """Wall times of `steps` engine steps in which all len(prompts) requests decode one token each."""
    tag = time.monotonic_ns()
    for i, ids in enumerate(prompts):
        eng.add_request(f"batch-{tag}-{i}", ids, greedy(steps + 1))
    eng.step()  # prefill of every prompt + its first token: not timed
    running = eng.scheduler.running
    assert len(running) == len(prompts) and all(s.num_output_tokens == 1 for s in running), \
        "the prefill did not fit one step: raise max_num_batched_tokens / max_num_seqs"
    times = [timed(eng.step, eng.runner.device) for _ in range(steps)]
    assert not eng.has_unfinished()
    return times


# ---- prompts ---------------------------------------------------------------------------------------
_BOOK_IDS: dict[int, list[int]] = {}
_TEXT_TOKENIZER: list = []


def text_tokenizer():
    """The bundled model's tokenizer (cached on disk after its first load): turns the book into ids."""
    if not _TEXT_TOKENIZER:
        _TEXT_TOKENIZER.append(load_tokenizer(_bundled()))
    return _TEXT_TOKENIZER[0]


def book_ids(loaded: Loaded, n: int, offset: int = 0) -> list[int]:
    """`n` token ids of prose from the shared book (random-weight models get the bundled tokenizer's ids
    of the same text, folded into their vocabulary)."""
    tok = loaded.tokenizer if loaded.tokenizer is not None else text_tokenizer()
    key = id(tok)
    if key not in _BOOK_IDS or len(_BOOK_IDS[key]) < offset + n:
        from pagedserve.benchmarks import workloads

        words = workloads.load_words()
        need_words = int((offset + n) * 1.2) + 200
        _BOOK_IDS[key] = list(tok.encode(" ".join(words[:need_words]), add_special_tokens=False))
        while len(_BOOK_IDS[key]) < offset + n:
            need_words *= 2
            _BOOK_IDS[key] = list(tok.encode(" ".join(words[:need_words]), add_special_tokens=False))
    ids = _BOOK_IDS[key][offset:offset + n]
    return [t % loaded.config.vocab_size for t in ids]


# ---- output and checks ------------------------------------------------------------------------------
def ms(seconds: float, digits: int = 1) -> str:
    return f"{seconds * 1e3:.{digits}f}"


def base_parser(doc: str | None, rounds: int | None = None) -> argparse.ArgumentParser:
    """benchmarks.common's parser (--json, and --rounds where a script has rounds) and the chapter's options."""
    ap = parser(doc, rounds=rounds, baseline=False)
    ap.add_argument("--quick", action="store_true", help="small sizes; asserts the property (for tests)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--no-timing-checks", action="store_true",
                    help="report timing checks without failing on them (tests: a loaded machine is no benchmark)")
    return ap


def setup(args: argparse.Namespace) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    return {"quick": bool(args.quick)}


TIMING = "timing"  # third element of a check tuple: the check compares measured times


def finish(result: dict, checks: dict[str, tuple], args: argparse.Namespace) -> dict:
    """Print the checks, write JSON, exit non-zero if any enforced check failed.

    A check is `(ok, detail)` or `(ok, detail, TIMING)`; with --no-timing-checks the timing ones are only
    reported, so tests on a loaded machine assert the deterministic properties alone."""
    enforce_timing = not getattr(args, "no_timing_checks", False)
    result["checks"] = {}
    for name, (ok, detail, *kind) in checks.items():
        timing = TIMING in kind
        result["checks"][name] = {"ok": bool(ok), "detail": detail, "timing": timing,
                                  "enforced": enforce_timing or not timing}
    failed = [n for n, c in result["checks"].items() if c["enforced"] and not c["ok"]]
    result["ok"] = not failed
    print()
    for name, c in result["checks"].items():
        label = ("PASS" if c["ok"] else "FAIL") if c["enforced"] else "INFO"
        print(f"CHECK {label}  {name}: {c['detail']}")
    write_json(args.json, result)
    if failed:
        print(f"FAILED: {', '.join(failed)}", file=sys.stderr)
        raise SystemExit(1)
    return result


def compare_greedy(ours: list[int], ref: list[int], our_logprobs, tol: float = 1e-3) -> tuple[bool, str]:
    """Token-identical, or the first divergence is a genuine near-tie (both candidates' logits within tol
    in `ours`' top logprobs; logprob differences equal logit differences)."""
    if ours == ref:
        return True, f"identical ({len(ours)} tokens)"
    n = min(len(ours), len(ref))
    i = next((i for i in range(n) if ours[i] != ref[i]), n)
    if i == n:
        return False, f"lengths differ: {len(ours)} vs {len(ref)}"
    top = dict(our_logprobs[i].top) if i < len(our_logprobs) and our_logprobs[i] is not None else {}
    a, b = ours[i], ref[i]
    if a not in top or b not in top:
        return False, f"diverge at {i}: {a} vs {b}, and {b} is not in the top-{len(top)}"
    gap = abs(top[a] - top[b])
    ok = gap <= tol
    return ok, f"first divergence at token {i} ({a} vs {b}) is a near-tie: logit gap {gap:.1e}" + (
        "" if ok else f" > {tol}")
