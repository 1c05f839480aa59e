"""What tensor parallelism costs and buys on this machine: the all-reduce, then whole decode steps at TP=1 vs TP=N.

1. All-reduce of one step's activations ([batch, hidden] fp32, as o_proj and down_proj each produce per layer), between
   N spawned ranks on this host: torch.distributed's gloo vs the engine's shared-memory all-reduce
   (engine/parallel/shm_all_reduce.py: each rank writes its tensor into a shared slot, waits on the others' sequence
   numbers, sums the slots in rank order). Per call and per step (2 x layers calls).
2. Decode step time (LLMEngine.step, median over steps after the prefill) at batch 1 and 32, TP=1 vs TP=N, random
   weights of a published shape; on CPU TP=N twice: all-reduces over gloo only (PAGEDSERVE_TP_SHM=0, the engine
   before the shared-memory all-reduce) and as the engine runs by default.

On a machine with fewer cores than ranks x threads TP cannot be faster: the ranks share the same cores and add the
all-reduces. It pays where each rank brings its own cores and memory bandwidth (one rank per socket / NUMA node, with
--cpu-bind), or its own GPU.

    python benchmarks/tensor_parallel.py [--model random:qwen2.5-0.5b] [--tp 2] [--batch 1,32] [--steps 8]
        [--dtype float32] [--device cpu] [--reps 300] [--json PATH]

On a host with two or more GPUs (NCCL; untested here), the same script is the GPU check:
    python benchmarks/tensor_parallel.py --device cuda --tp 2 --dtype bfloat16 --model random:llama-3.2-1b
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import time

import torch

from pagedserve.benchmarks import common
from pagedserve.engine.parallel.shm_all_reduce import SLOT_BYTES, ShmAllReduce, create_segment, unlink_segment
from pagedserve.engine.parallel.workers import free_port

# ---- 1. the all-reduce ----------------------------------------------------------------------------------------


def _reduce_rank(rank: int, size: int, port: int, shapes: list[tuple[int, int]], reps: int, shm_name: str,
                 out) -> None:
    from pagedserve.engine.parallel.group import TensorParallel

    torch.set_num_threads(1)
    tp = TensorParallel.connect(rank, size, "127.0.0.1", port, torch.device("cpu"))  # gloo only: no shm_name
    shm_reduce = ShmAllReduce(shm_name, rank, size, timeout_s=60)
    result = {}
    for shape in shapes:
        x = torch.randn(shape)
        for name, fn in (("gloo", tp.all_reduce), ("shared memory", shm_reduce)):
            for _ in range(20):
                fn(x)
            tp.all_reduce(torch.zeros(1))  # line up before timing
            t0 = time.perf_counter()
            for _ in range(reps):
                fn(x)
            result[(name, shape)] = (time.perf_counter() - t0) / reps * 1e6
        # the two agree on the sum
        y = torch.full(shape, float(rank + 1))
        assert torch.allclose(shm_reduce(y.clone()), tp.all_reduce(y.clone()))
    if rank == 0:
        out.put(result)


def all_reduce_table(size: int, hidden: int, layers: int, batches: list[int], reps: int) -> list[dict]:
    ctx = multiprocessing.get_context("spawn")
    shapes = [(b, hidden) for b in batches]
    shm_name = create_segment(size, slot_bytes=max(SLOT_BYTES, max(batches) * hidden * 4))
    out = ctx.Queue()
    port = free_port("127.0.0.1")
    procs = [ctx.Process(target=_reduce_rank, args=(r, size, port, shapes, reps, shm_name, out))
             for r in range(size)]
    try:
        for p in procs:
            p.start()
        result = out.get(timeout=600)
        for p in procs:
            p.join()
    finally:
        unlink_segment(shm_name)
    rows = []
    for b in batches:
        for name in ("gloo", "shared memory"):
            us = result[(name, (b, hidden))]
            rows.append({"batch": b, "method": name, "us_per_call": us, "ms_per_step": us * 2 * layers / 1e3})
    common.table(["batch", "all-reduce", "us / call", f"ms / step ({2 * layers} calls)"],
                 [[r["batch"], r["method"], f"{r['us_per_call']:.1f}", f"{r['ms_per_step']:.2f}"] for r in rows],
                 f"all-reduce of [batch, {hidden}] fp32 between {size} ranks on this host")
    return rows


# ---- 2. decode steps ------------------------------------------------------------------------------------------
THREADS = torch.get_num_threads()  # TP=1 gets every core; each of TP=N's ranks gets its share


def step_ms(model: str, tp: int, batch: int, steps: int, dtype: str, device: str, shm: bool = True) -> float:
    from pagedserve.engine import LLMEngine, SamplingParams, make_config

    torch.set_num_threads(THREADS)  # rank 0 of a TP run pins this process to its share of the cores; undo it
    os.environ["PAGEDSERVE_TP_SHM"] = "1" if shm else "0"  # read by rank 0 when it starts the workers
    eng = LLMEngine(make_config(model=model, dtype=dtype, device=device, tensor_parallel_size=tp, max_step_ms=0,
                                num_blocks=max(64, batch * 4), max_model_len=256))
    try:
        params = SamplingParams(max_tokens=steps + 3, temperature=0.0, ignore_eos=True)
        for i in range(batch):
            eng.add_request(f"r{i}", [1 + (i * 7 + j) % 500 for j in range(16)], params)
        times = []
        while eng.has_unfinished():
            prefill = any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.scheduler.running) or \
                eng.num_waiting
            t0 = time.perf_counter()
            eng.step()
            if not prefill:
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times[1:])  # the first decode step warms up
    finally:
        eng.close()


def main(argv: list[str] | None = None) -> None:
    ap = common.parser(__doc__, rounds=None, baseline=False)
    ap.add_argument("--model", default="random:qwen2.5-0.5b")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--batch", default="1,32")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--reps", type=int, default=300, help="all-reduce calls timed per shape")
    args = ap.parse_args(argv)
    from pagedserve.engine.models.loader import load_config

    cfg = load_config(args.model)
    batches = [int(b) for b in args.batch.split(",")]
    reduce_rows = all_reduce_table(args.tp, cfg.hidden_size, cfg.num_layers, batches, args.reps) \
        if args.device == "cpu" else []
    rows = []
    for b in batches:
        one = step_ms(args.model, 1, b, args.steps, args.dtype, args.device)
        gloo = step_ms(args.model, args.tp, b, args.steps, args.dtype, args.device, shm=False) \
            if args.device == "cpu" else None
        split = step_ms(args.model, args.tp, b, args.steps, args.dtype, args.device)
        rows.append({"batch": b, "tp1_ms": one, "tpN_gloo_ms": gloo, "tpN_ms": split})
    n = args.tp
    common.table(["batch", "TP=1 ms/step", f"TP={n} gloo", f"TP={n} / TP=1", f"TP={n} (engine)", f"TP={n} / TP=1"],
                 [[r["batch"], f"{r['tp1_ms']:.1f}", "-" if r["tpN_gloo_ms"] is None else f"{r['tpN_gloo_ms']:.1f}",
                   common.ratio(r["tpN_gloo_ms"], r["tp1_ms"]), f"{r['tpN_ms']:.1f}",
                   common.ratio(r["tpN_ms"], r["tp1_ms"])] for r in rows],
                 f"decode step, {args.model} ({cfg.num_layers} layers, hidden {cfg.hidden_size}), {args.dtype} on "
                 f"{args.device}")
    common.write_json(args.json, {"all_reduce": reduce_rows, "steps": rows, "model": args.model, "tp": args.tp})


if __name__ == "__main__":
    main()
