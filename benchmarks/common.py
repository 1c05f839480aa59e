"""What every benchmark shares: its argument parser, the machine header, timing, interleaved rounds, the JSON
record, and A/B runs against another commit (`--baseline-ref GIT_REF`).

An A/B run builds a git worktree of the other commit (reused across runs) and runs a worker there in its own
process, with PYTHONPATH pointing at that tree, so `import engine` is that commit's engine and its C++ kernels
are built from its own sources.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def parser(doc: str | None, *, rounds: int = 3, baseline: bool = True) -> argparse.ArgumentParser:
    """The options every benchmark takes: --json, --rounds and (A/B scripts) --baseline-ref."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    ap.add_argument("--rounds", type=int, default=rounds, help="interleaved rounds; medians are reported")
    if baseline:
        ap.add_argument("--baseline-ref", action="append", default=[], metavar="GIT_REF",
                        help="also run this commit (a git worktree of it), interleaved with this tree (repeatable)")
    return ap


def machine_header() -> str:
    """One line: the CPU and the flags that decide its fast paths, torch's threads, the load average."""
    import torch

    from engine.machine import cpu

    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"machine: {cpu().describe()} | torch {torch.__version__}, {torch.get_num_threads()} threads | load {load}"


def median_ms(fn: Callable[[], Any], reps: int = 7, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def interleaved(rounds: int, contestants: dict[str, Callable[[], dict]], log=print) -> dict[str, list[dict]]:
    """Run every contestant once per round, in turn, so machine drift hits them all alike."""
    out: dict[str, list[dict]] = {name: [] for name in contestants}
    for r in range(rounds):
        for name, run in contestants.items():
            result = run()
            out[name].append(result)
            log(f"  round {r + 1}/{rounds} {name}: " + ", ".join(
                f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in result.items()), flush=True)
    return out


def medians(results: list[dict]) -> dict:
    """Per key, the median over rounds of numeric values (the first round's value otherwise)."""
    return {k: statistics.median(r[k] for r in results) if isinstance(results[0][k], (int, float)) else
            results[0][k] for k in results[0]}


def write_json(path: str | None, payload: dict) -> None:
    if not path:
        return
    record = {"machine": machine_header(), "commit": commit_of("HEAD"), "command": " ".join(sys.argv), **payload}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(record, indent=1, default=str))


# ---- A/B against another commit ---------------------------------------------------------------------------
def commit_of(ref: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short=12", ref], capture_output=True, text=True,
                          check=True).stdout.strip()


def worktree(ref: str) -> Path:
    """A checkout of `ref` beside the repository's temp files, made once and reused."""
    sha = commit_of(ref)
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"pagedserve-ref-{sha}"
    if not (path / "engine").is_dir():
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "--force", str(path), sha],
                       check=True, capture_output=True)
    return path


def run_worker(tree: Path | None, code: str, *args: str, env: dict[str, str] | None = None,
               timeout: float = 3600) -> dict:
    """Run `code` (a Python program printing one JSON line last) with `tree`'s engine (None: this one)."""
    tree = tree or REPO
    environ = dict(os.environ, PYTHONPATH=str(tree), **(env or {}))
    out = subprocess.run([sys.executable, "-c", code, *args], cwd=tree, env=environ, capture_output=True, text=True,
                         timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"worker in {tree} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def trees(baseline_refs: list[str]) -> dict[str, Path | None]:
    """{label: tree} for this tree ("this") and each baseline ref."""
    out: dict[str, Path | None] = {"this": None}
    for ref in baseline_refs:
        out[commit_of(ref)] = worktree(ref)
    return out
