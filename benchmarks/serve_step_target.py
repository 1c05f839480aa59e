"""HTTP serving: this tree vs another checkout (the previous commit), and the step-time target curve.

Each row starts `python -m server.cli serve` as its own process from a given source tree (PYTHONPATH),
waits for /health, runs `pagedserve bench` (benchmarks/serve.py from this tree) with the prose workload
(64 requests at once through /v1/completions), and stops the server. Rows:
  baseline   --baseline-tree (e.g. /work/main at its HEAD), its defaults;
  ours       this tree, defaults (the max-step-ms default: twice the decodes' own step cost);
  ours, max-step-ms=X   for each X in --step-targets (0 = time budget off: the token budget only).

    flock /tmp/pagedserve-bench.lock python benchmarks/serve_step_target.py --baseline-tree /work/main \\
        [--step-targets 0,100,250,500,1000] [--dtype auto] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.machine import machine_header  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_row(tree: str, serve_args: list[str], args: argparse.Namespace) -> dict:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=tree)
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    t0 = time.perf_counter()
    server = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--port", str(port), "--log-level",
                               "warning", "--dtype", args.dtype, *serve_args], cwd=tree, env=env,
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        while True:
            if server.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"server exited:\n{log.read()[-3000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.perf_counter() - t0 > 600:
                raise RuntimeError("server did not become healthy in 600 s")
            time.sleep(0.5)
        startup = time.perf_counter() - t0
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            subprocess.run([sys.executable, "-m", "benchmarks.serve", "--base-url", url, "--endpoint", "completions",
                            "--workload", "prose", "--num-prompts", str(args.num_prompts), "--json", out.name,
                            "--no-progress"], cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO), check=True,
                           stdout=subprocess.DEVNULL)
            m = json.load(open(out.name))
        return {"startup_s": startup, "output_tok_s": m["output_throughput"], "ttft_p50_ms": m["median_ttft_ms"],
                "tpot_p50_ms": m["median_tpot_ms"], "tpot_p99_ms": m["p99_tpot_ms"], "itl_p99_ms": m.get("p99_itl_ms")}
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
        os.unlink(log.name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline-tree", action="append", default=[],
                    help="source tree of a baseline row (repeatable; none: no baseline row)")
    ap.add_argument("--step-targets", default="0", help="max-step-ms values for extra rows of this tree")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--json")
    args = ap.parse_args()
    print(machine_header(), flush=True)
    rows = []
    for tree in args.baseline_tree:
        rows.append((f"baseline ({tree})", tree, []))
    rows.append(("ours (default step target)", REPO, []))
    for x in filter(None, args.step_targets.split(",")):
        rows.append((f"ours, max-step-ms={x}", REPO, ["--max-step-ms", x]))
    results = []
    print(f"{'server':44} {'start s':>8} {'tok/s':>7} {'TTFT p50 ms':>12} {'TPOT p50 ms':>12} {'TPOT p99 ms':>12}",
          flush=True)
    for name, tree, extra in rows:
        r = run_row(tree, extra, args)
        results.append({"row": name, **r})
        print(f"{name:44} {r['startup_s']:8.1f} {r['output_tok_s']:7.1f} {r['ttft_p50_ms']:12.0f} "
              f"{r['tpot_p50_ms']:12.0f} {r['tpot_p99_ms']:12.0f}", flush=True)
    print(machine_header())
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_header(), "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
