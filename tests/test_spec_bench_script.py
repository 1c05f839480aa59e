"""benchmarks/seed/speculative.py in --quick mode: its deterministic checks (acceptance measured on real
positions, greedy output identical to plain decoding) hold; timing bars are reported, not asserted."""

from __future__ import annotations

import json

import pytest
import torch

from pagedserve.benchmarks.seed import speculative

pytestmark = pytest.mark.slow


def test_speculative_quick(tmp_path):
    threads = torch.get_num_threads()
    try:
        path = tmp_path / "out.json"
        r = speculative.main(["--quick", "--threads", "1", "--no-timing-checks", "--json", str(path)])
    finally:
        torch.set_num_threads(threads)
    assert r["ok"] and all(c["ok"] for c in r["checks"].values() if not c["timing"])
    draft = r["acceptance"]["drafts"]["bf16 self-draft"]
    assert draft["positions"] >= 48 and 0.5 <= draft["alpha"] <= 1.0  # bf16 rounding rarely flips fp32's pick
    assert set(draft["measured"]) == {1, 4} and len(draft["predicted"]) == 8 and r["acceptance"]["r_gamma"][0] == 1.0
    lookup = r["tpot"]["lookup (quote/repeat/edit)"]["ngram"]
    assert lookup["num_drafts"] > 0 and lookup["acceptance_rate"] > 0
    assert json.loads(path.read_text())["checks"].keys() == r["checks"].keys()
