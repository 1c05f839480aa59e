"""The chapter's experiments (benchmarks/seed/*) in --quick mode: each asserts the property it shows.

Run in-process so the SmolLM2 weights are loaded once per dtype and shared (benchmarks.seed.common
caches them). Timing checks are reported but not asserted (--no-timing-checks): a test must pass on a
loaded machine, and speed claims belong to the scripts' own CHECK lines when run as benchmarks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from pagedserve.benchmarks.seed import (
    batching,
    kv_cache,
    kv_memory,
    outliers,
    prefill_decode,
    prefix_caching,
    static_vs_continuous,
)

pytestmark = pytest.mark.slow

QUICK = ["--quick", "--threads", "1", "--no-timing-checks"]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _run(module, tmp_path, *extra: str) -> dict:
    path = tmp_path / "out.json"
    result = module.main([*QUICK, "--json", str(path), *extra])
    assert result["ok"], result["checks"]
    assert all(c["ok"] for c in result["checks"].values() if not c["timing"])
    on_disk = json.loads(path.read_text())
    assert on_disk["ok"] and on_disk["checks"].keys() == result["checks"].keys()
    return result


def test_kv_memory(tmp_path):
    r = _run(kv_memory, tmp_path)
    qwen = next(row for row in r["shapes"] if row["model"] == "qwen2.5-0.5b")
    assert qwen["measured_bytes_per_token"] == qwen["formula_bytes_per_token"] == 12288
    assert {row["blocks"] for row in r["same_total"]["rows"]} == {4096}


def test_outliers(tmp_path):
    r = _run(outliers, tmp_path)
    assert r["tokens"] == 24 and sum(b["count"] for b in r["histogram"]["bins"]) == r["hidden"]
    ex = r["int8"]["examples"][0]
    assert ex["levels_without_top_k"] >= ex["levels"]
    assert r["weight_outliers"]["max_over_std"] > 6


def test_kv_cache(tmp_path):
    r = _run(kv_cache, tmp_path)
    assert r["identity"]["ok"] and r["identity"]["dtype"] == "float32"


def test_prefill_decode(tmp_path):
    r = _run(prefill_decode, tmp_path)
    s = r["summary"]
    assert s["reference_P"] == 256 and s["prefill_per_token_s"] > 0 and s["decode_step_s"] > 0


def test_batching(tmp_path):
    r = _run(batching, tmp_path)
    by = {row["batch"]: row for row in r["rows"]}
    assert set(by) == {1, 2, 4, 8} and all(row["tokens_per_s"] > 0 for row in by.values())


def test_static_vs_continuous(tmp_path):
    r = _run(static_vs_continuous, tmp_path)
    e = r["engine"]
    assert e["continuous"]["steps"] < e["static"]["steps"]  # deterministic, unlike the timings
    assert e["continuous"]["output_tokens"] == e["static"]["output_tokens"]


def test_prefix_caching(tmp_path):
    r = _run(prefix_caching, tmp_path)
    first = r["runs"][0]
    assert first["first_request_cached_tokens"] == 0 and first["cached_tokens"] > 0
    assert r["runs"][-1]["ok"]


def test_chapter_lengths_exact():
    import statistics

    lengths = static_vs_continuous.make_lengths(**static_vs_continuous.CHAPTER)
    assert len(lengths) == 64 and statistics.median(lengths) == 18
    assert max(lengths) == 231 and sum(lengths) == 1874
    assert lengths == static_vs_continuous.make_lengths(**static_vs_continuous.CHAPTER)  # deterministic


def test_failed_check_exits_nonzero(tmp_path):
    """A failed check ends the script with a non-zero exit status; a failed timing check only does so when
    timing checks are enforced (the default for a benchmark run)."""
    import argparse

    from pagedserve.benchmarks.seed import common

    out = str(tmp_path / "out.json")
    with pytest.raises(SystemExit) as e:
        common.finish({}, {"forced": (False, "a failing check")}, argparse.Namespace(json=out))
    assert e.value.code == 1
    slow = {"slow": (False, "a slow run", common.TIMING)}
    with pytest.raises(SystemExit):
        common.finish({}, slow, argparse.Namespace(json=out, no_timing_checks=False))
    r = common.finish({}, slow, argparse.Namespace(json=out, no_timing_checks=True))
    assert r["ok"] and not r["checks"]["slow"]["enforced"]


def test_runs_as_script_and_module():
    for cmd in ([sys.executable, "benchmarks/seed/kv_memory.py", "--quick"],
                [sys.executable, "-m", "pagedserve.benchmarks.seed.kv_memory", "--quick"]):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "CHECK PASS" in proc.stdout
