"""End-to-end decode step time through the public engine API, against the weight-streaming floor.

Random weights at Qwen2.5-0.5B's shapes, bf16, Triton attention. For each batch size the same
workload runs twice (the first compiles kernels for the context lengths that occur) and the second
is timed: every step after all requests have their first token decodes the whole batch. The floor
is the bytes every step must read (all weights; LM head = tied embedding) / measured copy bandwidth;
the table also shows it with the KV cache reads added.

    python benchmarks/kernels/bench_decode_step.py [--batches 1,64] [--no-cuda-graphs] [--json out.json]
"""

from __future__ import annotations

import argparse
import random
import statistics

import torch

from pagedserve.benchmarks import common
from pagedserve.engine import LLMEngine, SamplingParams, make_config


def decode_step_times(engine: LLMEngine, batch: int, prompt_len: int, steps: int, seed: int) -> list[float]:
    """Seconds per step for the steps that decode all `batch` requests (prefill steps are not timed)."""
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{seed}-{i}", [rng.randrange(vocab) for _ in range(prompt_len)], params)
    started: set[str] = set()
    times = []
    while engine.has_unfinished():
        decoding = len(started) == batch
        outputs = []
        # step returns sampled token ids: the step's GPU work is done when it returns
        dt = common.timed(lambda out=outputs: out.extend(engine.step()))
        started.update(o.request_id for o in outputs)
        if decoding and len(outputs) == batch:
            times.append(dt)
    return times


def main(argv: list[str] | None = None) -> None:
    p = common.parser(__doc__, rounds=None, baseline=False)
    p.add_argument("--model", default="random:qwen2.5-0.5b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--attention-backend", default="triton")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=64, help="decode steps timed per batch size")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="capture decode steps as CUDA graphs (default: the engine's)")
    args = p.parse_args(argv)
    batches = [int(x) for x in args.batches.split(",")]

    options = dict(model=args.model, device=args.device, dtype=args.dtype,
                   attention_backend=args.attention_backend, memory_gib=4, max_num_seqs=max(batches))
    if args.cuda_graphs is not None:
        options["cuda_graphs"] = args.cuda_graphs
    engine = LLMEngine(make_config(**options))
    device = engine.device
    model = engine.runner.model
    weight_bytes = sum(t.numel() * t.element_size() for t in model.parameters())  # tied tensors counted once
    bw = common.copy_bandwidth(device, 2**30 if device.type == "cuda" else 2**24)
    graphs = engine.config.cuda_graphs
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(common.machine_header())
    print(f"{name}: copy bandwidth {bw / 1e9:.0f} GB/s; {args.model} {engine.dtype}, weights "
          f"{weight_bytes / 1e9:.2f} GB, attention {engine.runner.backend.name}, cuda_graphs={graphs}")
    print(f"{'batch':>5} {'context':>9} | {'step ms':>8} {'p90 ms':>7} {'tok/s':>8} | "
          f"{'floor ms':>8} {'+KV ms':>7} {'floor/step':>10}")

    rows = []
    for batch in batches:
        decode_step_times(engine, batch, args.prompt_len, args.steps, seed=2 * batch)  # warm-up / compile
        times = decode_step_times(engine, batch, args.prompt_len, args.steps, seed=2 * batch + 1)
        step = statistics.median(times)
        p90 = sorted(times)[int(0.9 * (len(times) - 1))]
        mean_ctx = args.prompt_len + args.steps / 2
        kv_bytes = batch * mean_ctx * engine.runner.kv_bytes_per_token
        floor, floor_kv = weight_bytes / bw, (weight_bytes + kv_bytes) / bw
        row = {"batch": batch, "prompt_len": args.prompt_len, "timed_steps": len(times),
               "step_ms": step * 1e3, "p90_ms": p90 * 1e3, "tokens_per_s": batch / step,
               "floor_weights_ms": floor * 1e3, "floor_weights_kv_ms": floor_kv * 1e3,
               "floor_fraction": floor / step}
        rows.append(row)
        print(f"{batch:>5} {args.prompt_len:>4}+{args.steps:<4} | {row['step_ms']:>8.2f} "
              f"{row['p90_ms']:>7.2f} {row['tokens_per_s']:>8.0f} | {row['floor_weights_ms']:>8.3f} "
              f"{row['floor_weights_kv_ms']:>7.3f} {row['floor_fraction']:>10.1%}", flush=True)
    common.write_json(args.json, {"device": name, "copy_bandwidth_Bps": bw, "weight_bytes": weight_bytes,
                                  "config": {**vars(args), "cuda_graphs_effective": graphs}, "rows": rows})


if __name__ == "__main__":
    main()
