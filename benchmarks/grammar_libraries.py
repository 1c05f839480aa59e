"""Grammar engines on SmolLM2's tokenizer: tokenizer set-up, JSON-schema compile time and mask cost per token.

Each library walks the same schema by sampling uniformly among the tokens its mask allows (seeded), so
every step is a real mask computation. llguidance is a dependency; xgrammar and outlines-core are
measured only when importable (e.g. `pip install --target /tmp/xg xgrammar` and PYTHONPATH=/tmp/xg).

    python benchmarks/grammar_libraries.py [--steps 150] [--json out.json]
"""

from __future__ import annotations

import json
import random
import time

import torch

from pagedserve.benchmarks import common
from pagedserve.engine.config import bundled_model_path
from pagedserve.engine.tokenizer import load_tokenizer

S = {"type": "string", "maxLength": 20}
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "email", "tags", "address"],
          "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
                         "tags": {"type": "array", "maxItems": 4, "items": {"enum": ["red", "green", "blue"]}},
                         "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                                     "properties": {"city": S, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}
_BITS = torch.arange(32, dtype=torch.int32)


def allowed(mask: torch.Tensor, vocab: int) -> list[int]:
    return ((mask.view(-1).unsqueeze(-1) >> _BITS) & 1).view(-1)[:vocab].nonzero().flatten().tolist()


def walk(fill, mask, vocab, consume, done, steps: int) -> tuple[float, int]:
    rng, n, spent = random.Random(0), 0, 0.0
    while n < steps and not done():
        spent += common.timed(fill)
        ok = allowed(mask, vocab)
        if not ok:
            break
        consume(rng.choice(ok))
        n += 1
    return spent / max(n, 1) * 1e6, n


def main(argv: list[str] | None = None) -> None:
    ap = common.parser(__doc__, rounds=None, baseline=False)
    ap.add_argument("--steps", type=int, default=150)
    args = ap.parse_args(argv)
    tok = load_tokenizer(bundled_model_path())
    vocab = len(tok)
    rows = []

    import llguidance
    import llguidance.hf

    t0 = time.perf_counter()
    llt = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    t1 = time.perf_counter()
    m = llguidance.LLMatcher(llt, llguidance.LLMatcher.grammar_from_json_schema(SCHEMA))
    t2 = time.perf_counter()
    mask = torch.zeros((vocab + 31) // 32, dtype=torch.int32)
    us, n = walk(lambda: m.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4), mask, vocab,
                 m.consume_token, m.is_stopped, args.steps)
    rows.append(("llguidance " + llguidance.__version__, t1 - t0, t2 - t1, us, n))

    try:
        import xgrammar as xgr
    except ImportError:
        xgr = None
    if xgr is not None:
        t0 = time.perf_counter()
        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
        t1 = time.perf_counter()
        g = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA)))
        t2 = time.perf_counter()
        mask = xgr.allocate_token_bitmask(1, vocab)
        us, n = walk(lambda: g.fill_next_token_bitmask(mask), mask, vocab, g.accept_token, g.is_terminated,
                     args.steps)
        rows.append(("xgrammar " + xgr.__version__, t1 - t0, t2 - t1, us, n))

    try:
        import outlines_core as oc
        from outlines_core.json_schema import build_regex_from_schema
    except ImportError:
        oc = None
    if oc is not None:
        t0 = time.perf_counter()
        words: dict[str, list[int]] = {}
        for s, i in tok.get_vocab().items():
            if i != tok.eos_token_id:
                words.setdefault(s, []).append(i)
        voc = oc.Vocabulary(tok.eos_token_id, words)
        t1 = time.perf_counter()
        guide = oc.Guide(oc.Index(build_regex_from_schema(json.dumps(SCHEMA)), voc))
        t2 = time.perf_counter()
        mask = torch.zeros((vocab + 31) // 32, dtype=torch.int32)
        us, n = walk(lambda: guide.write_mask_into(mask.data_ptr(), mask.numel(), 4), mask, vocab, guide.advance,
                     guide.is_finished, args.steps)
        rows.append(("outlines-core", t1 - t0, t2 - t1, us, n))

    common.table(["library", "tokenizer ms", "compile ms", "mask us/token", "tokens"],
                 [[name, f"{tk * 1e3:.0f}", f"{comp * 1e3:.1f}", f"{us:.1f}", n] for name, tk, comp, us, n in rows],
                 f"JSON schema (nested object, enum array, patterns, bounded integer); vocab {vocab}")
    common.write_json(args.json, {"rows": [dict(zip(("library", "tokenizer_s", "compile_s", "mask_us_per_token",
                                                     "tokens"), row)) for row in rows]})


if __name__ == "__main__":
    main()
