"""What the HTTP layer costs: the same workload through the server (streaming) and the offline engine.

Starts the server in-process (uvicorn on 127.0.0.1), runs `pagedserve bench` against it from a separate
process (a client in the server's process would compete for its GIL) with the prose workload (64
requests, all at once, /v1/completions so prompts are identical to the offline run), then runs the same
requests through `LLM.generate` on the same engine, and prints both and the ratio. Client and server
share this machine's cores, so the HTTP figure includes the client's own CPU use.

    python benchmarks/serve_vs_offline.py [--num-prompts 64] [--json results/serve_vs_offline.json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import httpx  # noqa: E402
import uvicorn  # noqa: E402

from benchmarks import serve as bench  # noqa: E402
from benchmarks import workloads  # noqa: E402
from engine import LLM, LLMEngine, SamplingParams, make_config  # noqa: E402
from engine.async_engine import AdmissionLimits  # noqa: E402
from server.app import ServerConfig, create_app  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _thread_cpu_s(tid: int) -> float:
    """CPU seconds a thread of this process has used (Linux; 0 elsewhere)."""
    try:
        with open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--text", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    engine = LLMEngine(make_config(model=args.model, dtype=args.dtype))
    port = _free_port()
    app = create_app(lambda: engine, ServerConfig("model", AdmissionLimits()))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    while True:
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.1)

    loop_cpu0 = _thread_cpu_s(thread.native_id)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "bench.json")
        cmd = [sys.executable, "-m", "benchmarks.serve", "--base-url", base, "--endpoint", "completions",
               "--workload", "prose", "--num-prompts", str(args.num_prompts), "--no-progress",
               "--num-warmups", "1", "--json", out] + (["--text", args.text] if args.text else [])
        subprocess.run(cmd, check=True, cwd=REPO)
        with open(out) as f:
            online = json.load(f)
    loop_cpu = _thread_cpu_s(thread.native_id) - loop_cpu0
    server.should_exit = True
    thread.join(timeout=10)
    while engine.has_unfinished():  # nothing should be left, but never measure on a busy engine
        engine.step()
    engine.block_manager.reset_prefix_cache()  # the offline run must not reuse the online run's prompts

    reqs = workloads.prose(args.num_prompts, text_path=args.text)
    llm = LLM(engine=engine)
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in reqs]
    t0 = time.perf_counter()
    results = llm.generate([r.prompt for r in reqs], params)
    wall = time.perf_counter() - t0
    offline_tps = sum(len(r.token_ids) for r in results) / wall
    ttfts = sorted(r.metrics.ttft for r in results)

    rows = [("offline LLM.generate", offline_tps, ttfts[len(ttfts) // 2] * 1e3, None),
            ("HTTP streaming (pagedserve bench)", online["output_throughput"], online["median_ttft_ms"],
             online["p99_ttft_ms"])]
    print(f"\nWorkload: {args.num_prompts} prose requests, all at once, dtype {engine.dtype}")
    print(f"{'path':<36}{'out tok/s':>11}{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}")
    for name, tps, p50, p99 in rows:
        print(f"{name:<36}{tps:>11.1f}{p50:>13.0f}{'' if p99 is None else f'{p99:.0f}':>13}")
    overhead = 1 - online["output_throughput"] / offline_tps
    print(f"HTTP path: {overhead * 100:.1f}% less throughput than offline; online TPOT p50 "
          f"{online['median_tpot_ms']:.1f} ms, p99 {online['p99_tpot_ms']:.1f} ms")
    print(f"server event-loop thread (HTTP, SSE, metrics) used {loop_cpu:.2f} s of CPU over the "
          f"{online['duration']:.1f} s run ({loop_cpu / online['duration'] * 100:.1f}% of one core)")
    result = {"offline_output_tok_s": offline_tps, "online": {k: v for k, v in online.items() if k != "requests"},
              "http_overhead_fraction": overhead, "event_loop_cpu_s": loop_cpu}
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(bench._json_safe(result), f, indent=1)
    return result


if __name__ == "__main__":
    main()
