"""The checks that need a GPU, in one run, for when a CUDA machine is at hand: one table of what passed.

1. The Triton paged-attention kernels against the torch oracle on the real GPU (tests/test_triton_paged.py).
2. Tensor parallelism over NCCL: TP=2 greedy tokens against TP=1 on a small random model, then the decode-step
   benchmark (benchmarks/tensor_parallel.py) at TP=1 vs TP=2. Needs 2+ GPUs; with one it says so and skips.

    python benchmarks/gpu_check.py [--model random:llama-3.2-1b] [--dtype bfloat16] [--json PATH]

Exit status: 0 when every check that ran passed, 1 when one failed, 2 without a CUDA device.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pagedserve.benchmarks import common

TIMEOUT_S = 900


def _pytest(path: str) -> tuple[str, str]:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path], cwd=common.REPO,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    summary = next((line for line in reversed(proc.stdout.splitlines()) if re.search(r"passed|failed|error", line)),
                   proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "no output")
    result = "pass" if proc.returncode == 0 and "passed" in summary else \
        "skipped" if proc.returncode in (0, 5) else "FAIL"  # 5: nothing collected
    return result, f"{summary.strip('= ')} ({time.monotonic() - t0:.0f} s)"


def _tp_tokens(model: str, dtype: str) -> tuple[str, str]:
    """TP=2 over NCCL serves TP=1's greedy tokens (a divergence only at a genuine near-tie)."""
    from pagedserve.engine import LLMEngine, SamplingParams, make_config

    prompts = [[1, 2, 3, 4, 5, 6, 7], [100, 37, 250, 9], list(range(300, 340))]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    outs = []
    for tp in (1, 2):
        eng = LLMEngine(make_config(model=model, dtype=dtype, device="cuda", tensor_parallel_size=tp,
                                    max_model_len=512))
        try:
            for i, p in enumerate(prompts):
                eng.add_request(f"r{i}", p, params)
            tokens: dict[str, list[int]] = {}
            while eng.has_unfinished():
                for o in eng.step():
                    tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            outs.append(tokens)
        finally:
            eng.close()
    same = sum(outs[0][r] == outs[1][r] for r in outs[0])
    first = [next((i for i, (a, b) in enumerate(zip(outs[0][r], outs[1][r])) if a != b), None) for r in outs[0]]
    return ("pass" if same == len(prompts) else "CHECK"), \
        f"{same}/{len(prompts)} requests identical; first divergence per request: {first}"


def _tp_bench(model: str, dtype: str) -> tuple[str, str]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "tp.json"
        proc = subprocess.run([sys.executable, str(common.REPO / "benchmarks" / "tensor_parallel.py"), "--device",
                               "cuda", "--tp", "2", "--dtype", dtype, "--model", model, "--batch", "1,32",
                               "--json", str(out)], cwd=common.REPO, capture_output=True, text=True,
                              timeout=TIMEOUT_S)
        if proc.returncode:
            return "FAIL", (proc.stderr.strip().splitlines() or ["no output"])[-1]
        rows = json.loads(out.read_text())["steps"]
    return "ran", "; ".join(f"batch {r['batch']}: TP=1 {r['tp1_ms']:.1f} ms, TP=2 {r['tpN_ms']:.1f} ms "
                            f"({common.ratio(r['tpN_ms'], r['tp1_ms'])})" for r in rows)


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(__doc__, rounds=None, baseline=False)
    ap.add_argument("--model", default="random:llama-3.2-1b", help="for the TP=2 tokens and the benchmark")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device here (torch {torch.__version__}, built for CUDA "
              f"{torch.version.cuda or 'none'}): run it on a machine with an NVIDIA GPU", file=sys.stderr)
        return 2
    gpus = torch.cuda.device_count()
    print(common.machine_header())
    print(f"{gpus} GPU(s): {', '.join(torch.cuda.get_device_name(i) for i in range(gpus))}", flush=True)
    rows = [("Triton paged attention (tests/test_triton_paged.py)", *_pytest("tests/test_triton_paged.py"))]
    if gpus >= 2:
        rows.append((f"TP=2 vs TP=1 greedy tokens, NCCL ({args.model}, {args.dtype})",
                     *_tp_tokens(args.model, args.dtype)))
        rows.append(("TP=2 vs TP=1 decode step (benchmarks/tensor_parallel.py)", *_tp_bench(args.model, args.dtype)))
    else:
        rows.append(("TP=2 with NCCL", "skipped", f"needs 2 GPUs, this machine has {gpus}"))
    common.table(["check", "result", "detail"], [list(r) for r in rows], "GPU checks")
    common.write_json(args.json, {"gpus": gpus, "checks": [dict(zip(("check", "result", "detail"), r))
                                                           for r in rows]})
    return 1 if any(r[1] == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
