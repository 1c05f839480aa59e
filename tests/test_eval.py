"""`pagedserve eval` pieces on the bundled model: perplexity through prompt logprobs, the battery, agreement,
weight errors (GGUF Q4_1 -> int4 group 32 is exact), and the table/JSON shape."""

from __future__ import annotations

import math

import pytest

from pagedserve.engine import LLM
from pagedserve.engine.config import bundled_text_path
from pagedserve.tools import eval as qeval


def test_evaluate_on_the_reference_engine(make_engine, smollm):
    llm = LLM(engine=make_engine(max_num_batched_tokens=2048))
    text_ids = smollm.tokenizer.encode(open(bundled_text_path()).read()[:4000], add_special_tokens=False)[:256]
    prompts = qeval.battery_prompts(smollm.tokenizer)
    assert len(prompts) == len(qeval.BATTERY) == 16
    ppl, score, paths, agree = qeval.evaluate(llm, text_ids, prompts, None)
    assert 1 < ppl < 200 and 0 <= score <= 16 and agree is None
    assert sum(len(p) for p in paths) == 16 * qeval.AGREEMENT_TOKENS == 144
    # the reference agrees with itself at every one of the 144 teacher-forced positions
    _, _, _, (same, total) = qeval.evaluate(llm, text_ids[:32], prompts, paths)
    assert (same, total) == (144, 144)


def test_weight_errors_gguf_q4_maps_exactly(smollm):
    mean, worst, bits = qeval.weight_errors(smollm.path, "int4", 32)
    assert mean == 0 and worst == 0 and bits == pytest.approx(4 + 32 / 32)  # Q4_1: fp16 scale + fp32 zero / 32
    mean8, worst8, bits8 = qeval.weight_errors(smollm.path, "int8", 64)
    assert 0 < mean8 <= worst8 < 0.02 and bits8 == pytest.approx(8 + 16 / 1152, rel=0.2)


def test_battery_matching_and_table():
    assert qeval.correct("The capital is Paris.", ("Paris",))
    assert not qeval.correct("Parisian", ("Paris",)) and qeval.correct("It has 8 legs", ("eight", "8"))
    rows = [qeval.Row("none", 32, 513.1, 0, 0, 22.1, 9, 1.0, 144), qeval.Row("int4-tensor", 4, 70, 0.9, 0.99,
                                                                           3.6e8, 0, 0.01, 144)]
    table = qeval.format_table(rows, 2048)
    assert "| none | 32.000 | 513.1 |" in table and "3.6e+08" in table and "144/144" in table
    assert not math.isnan(rows[1].perplexity)
