"""What every benchmark shares: its argument parser, the machine header, timing, interleaved rounds, tables, the
JSON record, and A/B runs against another commit (`--baseline-ref GIT_REF`).

Scripts run as `python benchmarks/x.py` or `python -m benchmarks.x` with the package importable (installed, or
PYTHONPATH=the repository). An A/B run builds a git worktree of the other commit (reused across runs) and runs a
worker there in its own process, with PYTHONPATH pointing at that tree, so `import engine` is that commit's engine
and its C++ kernels are built from its own sources. A worker may only use what both commits offer: the public API
(`from engine import LLM, SamplingParams`, `LLM(dtype=..., quantization=...)`, `.generate`, the results'
`.token_ids` and `.metrics`) or the `pagedserve serve` command line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pagedserve.engine.errors import ArgumentParser

REPO = Path(__file__).resolve().parent.parent


def parser(doc: str | None, *, rounds: int | None = 3, baseline: bool = True) -> argparse.ArgumentParser:
    """The options every benchmark takes: --json, --rounds (rounds=None: the script has none) and, for scripts
    that compare commits, --baseline-ref."""
    ap = ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    if rounds is not None:
        ap.add_argument("--rounds", type=int, default=rounds, help="interleaved rounds; medians are reported")
    if baseline:
        ap.add_argument("--baseline-ref", action="append", default=[], metavar="GIT_REF",
                        help="also run this commit (a git worktree of it), interleaved with this tree (repeatable)")
    return ap


def machine_header() -> str:
    """One line: the CPU and the flags that decide its fast paths, torch's threads, the load average."""
    import torch

    from pagedserve.engine.machine import cpu

    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"machine: {cpu().describe()} | torch {torch.__version__}, {torch.get_num_threads()} threads | load {load}"


# ---- timing -----------------------------------------------------------------------------------------------
def _sync(device) -> None:
    if device is not None and device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device=None) -> float:
    """Seconds one call takes (a CUDA device is synchronized before and after)."""
    _sync(device)
    t = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t


def times_ms(fn: Callable[[], Any], reps: int = 7, warmup: int = 2, *, device=None, min_s: float = 0.0) -> list[float]:
    """ms per call of `reps` timed repetitions after `warmup` untimed calls. With `min_s`, each repetition calls
    `fn` as often as it takes to last that long (so microsecond ops do not measure the timer) and is divided."""
    for _ in range(warmup):
        fn()
    calls = 1
    while min_s and timed(lambda n=calls: [fn() for _ in range(n)], device) < min_s:
        calls *= 2
    return [timed(lambda: [fn() for _ in range(calls)], device) / calls * 1e3 for _ in range(reps)]


def median_ms(fn: Callable[[], Any], reps: int = 7, warmup: int = 2, device=None) -> float:
    """Median ms per call. On a CUDA device: triton's do_bench (CUDA events, L2 flushed between calls)."""
    if device is not None and device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    return statistics.median(times_ms(fn, reps, warmup, device=device))


def interleaved(rounds: int, contestants: dict[str, Callable[[], dict]], log=print) -> dict[str, list[dict]]:
    """Run every contestant once per round, in turn, so machine drift hits them all alike."""
    out: dict[str, list[dict]] = {name: [] for name in contestants}
    for r in range(rounds):
        for name, run in contestants.items():
            result = run()
            out[name].append(result)
            log(f"  round {r + 1}/{rounds} {name}: " + ", ".join(
                f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in result.items()
                if not isinstance(v, (dict, list))), flush=True)
    return out


def medians(results: list[dict]) -> dict:
    """Per key, the median over rounds of numeric values (the first round's value otherwise)."""
    return {k: statistics.median(r[k] for r in results) if isinstance(results[0][k], (int, float)) else
            results[0][k] for k in results[0]}


def copy_bandwidth(device, nbytes: int) -> float:
    """Bytes/s of a copy of an nbytes tensor on `device` (read + write counted): the roof of a memory-bound kernel."""
    import torch

    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    return 2 * nbytes / (median_ms(lambda: dst.copy_(src), reps=5, warmup=1, device=device) * 1e-3)


# ---- output -----------------------------------------------------------------------------------------------
def table(headers: Sequence[str], rows: Sequence[Sequence[object]], title: str | None = None) -> str:
    """Print a right-aligned table under its title and the machine header; return its text."""
    cells = [[str(h) for h in headers]] + [[c if isinstance(c, str) else f"{c}" for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ([title] if title else []) + [machine_header()]
    lines.append("  ".join(h.rjust(w) for h, w in zip(cells[0], widths)))
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells[1:]]
    text = "\n".join(lines)
    print("\n" + text, flush=True)
    return text


def ratio(x: float | None, base: float | None) -> str:
    """`x / base` as "1.23x" ("-" where either is missing)."""
    return "-" if x is None or not base else f"{x / base:.2f}x"


def json_safe(x: Any) -> Any:
    """inf and nan -> strings, so the file is strict JSON (rates are often infinite)."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


SECRET_OPTIONS = ("--api-key",)


def command_line() -> str:
    """This process's command line, with the values of secret options replaced by ***."""
    out, hide = [], False
    for arg in sys.argv:
        out.append("***" if hide else next((f"{o}=***" for o in SECRET_OPTIONS if arg.startswith(o + "=")), arg))
        hide = arg in SECRET_OPTIONS
    return " ".join(out)


def write_json(path: str | None, payload: dict) -> None:
    """The results with the machine, the commit (None outside a git checkout) and the command line."""
    if not path:
        return
    try:
        commit = commit_of("HEAD")
    except (OSError, subprocess.CalledProcessError):
        commit = None
    record = {"machine": machine_header(), "commit": commit, "command": command_line(), **payload}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(json_safe(record), indent=1, default=str, allow_nan=False))


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
    # A tree with the `pagedserve` package maps pagedserve.engine etc. onto its top-level folders through the
    # install's package-dir, which points at this checkout: with PYTHONPATH=path alone, `pagedserve` would come
    # from the tree and `pagedserve.engine` from here. Links inside the tree's package keep every import in it.
    if (path / "pagedserve").is_dir():
        for name in ("engine", "server", "benchmarks"):
            link = path / "pagedserve" / name
            if not link.exists():
                link.symlink_to(Path("..") / name)
    return path


def run_worker(tree: Path | None, code: str, *args: str, env: dict[str, str] | None = None,
               timeout: float = 3600, input: str | None = None) -> dict:
    """Run `code` (a Python program printing one JSON line last) with `tree`'s engine (None: this one); `input`
    is its stdin (for what is too long for a command line)."""
    tree = tree or REPO
    environ = dict(os.environ, PYTHONPATH=str(tree), **(env or {}))
    out = subprocess.run([sys.executable, "-c", code, *args], cwd=tree, env=environ, capture_output=True, text=True,
                         timeout=timeout, input=input)
    if out.returncode != 0:
        raise RuntimeError(f"worker in {tree} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def trees(baseline_refs: list[str]) -> dict[str, Path | None]:
    """{label: tree} for this tree ("this") and each baseline ref."""
    out: dict[str, Path | None] = {"this": None}
    for ref in baseline_refs:
        out[commit_of(ref)] = worktree(ref)
    return out


def serve(tree: Path | None, args: Sequence[str], log, bound_s: float = 900) -> tuple[subprocess.Popen, str]:
    """`pagedserve serve` from `tree` (None: this one) on a free loopback port, its output to the file `log`; returns
    the process and its base URL once it is ready (stop it with `stop`)."""
    tree = tree or REPO
    module = "pagedserve.server" if (tree / "pagedserve").is_dir() else "server"  # before the package was named
    port = free_port()
    return launch([sys.executable, "-m", module, "serve", "--host", "127.0.0.1", "--port", str(port), *args], port,
                  log, f"server from {tree}", bound_s, cwd=tree, env=dict(os.environ, PYTHONPATH=str(tree)))


def launch(cmd: Sequence[str], port: int, log, what: str, bound_s: float = 900, cwd: Path | None = None,
           env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """Start `cmd`, a server that listens on 127.0.0.1:`port` (any engine), its output to the file `log`; returns
    the process and its base URL once its /ready (or, for a server without one, /health) answers 200."""
    import httpx

    proc = subprocess.Popen(list(cmd), cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + bound_s
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited ({proc.returncode}):\n{_tail(log)}")
            try:
                r = httpx.get(url + "/ready", timeout=2, trust_env=False)
                if r.status_code == 404:  # an older tree, or another engine: its /health says the same
                    r = httpx.get(url + "/health", timeout=2, trust_env=False)
                if r.status_code == 200:
                    return proc, url
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"{what} not healthy within {bound_s:.0f} s")
    except BaseException:  # an interrupt while it loads too: no server is left behind
        stop(proc)
        raise


def _tail(log) -> str:
    """The end of a server's output file, or where to find it (a file opened write-only)."""
    try:
        log.flush()
        log.seek(0)
        return log.read()[-3000:]
    except (OSError, ValueError):
        return f"see {log.name}"


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now, for a server a benchmark starts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
