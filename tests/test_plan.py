"""`pagedserve plan` reproduces the chapter's memory tables (they are arithmetic)."""

from __future__ import annotations

import json

import pytest

from pagedserve.tools.plan import SHAPES, main, parse_memory, plan, shape_from_model


@pytest.mark.parametrize("shape,fmt,memory,tokens", [
    ("7b", "int8", 16, 65_378),  # "7B gets 65,378 tokens" (16 GB, int8)
    ("13b", "int8", 16, 3_136),  # "and 13B gets 3,136"
    ("13b", "int4", 8, 337),  # "13B in the 8 GB table: 337 tokens of context"
    ("7b", "int8", 8, 0),  # 6.5 GiB of weights + 1.5 GiB headroom leave nothing
    ("70b", "int4", 24, 0),
])
def test_chapter_rows(shape, fmt, memory, tokens):
    assert plan(SHAPES[shape], fmt, memory).max_tokens == tokens


def test_chapter_kv_sizes_and_weights():
    assert SHAPES["7b"].kv_bytes_per_token("fp16") == 128 * 1024  # "128 KB per token"
    assert SHAPES["13b"].kv_bytes_per_token("fp16") == 800 * 1024  # "800 KB per token"
    assert round(plan(SHAPES["13b"], "int4", 8).weights_gib, 1) == 6.2  # "6.2 GB of 8"
    extra = plan(SHAPES["13b"], "int8", 16).weights_gib - plan(SHAPES["7b"], "int8", 16).weights_gib
    assert round(extra, 1) == 5.6  # "5.6 GB of extra weights"


def test_grid_and_cli(tmp_path, capsys):
    row = plan(SHAPES["13b"], "int8", 16)
    assert row.fits["1x2k"] and not row.fits["1x8k"]
    out = tmp_path / "plan.json"
    main(["--shape", "7b,13b", "--memory", "8GB,16GB", "--quantization", "int8,int4", "--json", str(out)])
    text = capsys.readouterr().out
    assert "65,378" in text and "3,136" in text and "337" in text and "does not fit" in text
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 * 2 * 2
    assert parse_memory("512MB") == 0.5 and parse_memory("24GiB") == 24


def test_real_model_shape():
    s = shape_from_model(None)  # the bundled SmolLM2-135M
    assert 134e6 < s.params < 136e6 and s.kv_bytes_per_token("fp16") == 2 * 30 * 3 * 64 * 2
