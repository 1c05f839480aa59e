"""CPU attention benchmark: the in-place C++ paged kernel vs the reference gather + SDPA, one layer.

Shapes are SmolLM2-135M's (9 query heads, 3 KV heads, head dim 64) unless overridden. Each row times one
backend.forward call (store of the new K/V + attention; the step's metadata is built once beforehand, as the model
runner does for all layers), best of --reps, for:
  decode  B sequences x one query, contexts ~context (±25 %), blocks scattered over a shuffled pool;
  extend  one chunk of --chunk new tokens on top of a cached context;
  prefill one chunk of --chunk tokens with nothing cached.
The "floor" column is the time to read the K/V bytes once at the measured copy bandwidth.

    python benchmarks/kernels/bench_cpu_attention.py [--dtype both] [--block-sizes 16,64] [--threads 1] [--json out]
"""

from __future__ import annotations

import torch

from pagedserve.benchmarks import common
from pagedserve.engine.attention.base import AttentionMetadata
from pagedserve.engine.attention.cpu_paged import CpuPagedAttention
from pagedserve.engine.attention.torch_paged import TorchPagedAttention
from pagedserve.engine.layers.dispatch import kernel_table

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def best_ms(fn, reps: int) -> float:
    """The least disturbed run: other processes share these cores."""
    return min(common.times_ms(fn, reps, warmup=1))


def make_case(q_lens: list[int], seq_lens: list[int], heads: int, kv_heads: int, head_dim: int, block_size: int,
              dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    total = sum(-(-n // block_size) for n in seq_lens) + 1
    pool = (torch.randperm(total - 1, generator=g) + 1).tolist()
    tables, slots = [], []
    for q_len, seq_len in zip(q_lens, seq_lens):
        table = [pool.pop() for _ in range(-(-seq_len // block_size))]
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(seq_len - q_len, seq_len)]
    width = max(len(t) for t in tables)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    torch.cumsum(torch.tensor(q_lens), 0, out=qsl[1:])
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=qsl, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        num_decodes=next((i for i, n in enumerate(q_lens) if n != 1), len(q_lens)),
        query_lens_cpu=list(q_lens), seq_lens_cpu=list(seq_lens))
    t = sum(q_lens)
    qkv = torch.randn(t, heads + 2 * kv_heads, head_dim, generator=g).to(dtype)  # strided views, as in the model
    q, k, v = qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]
    caches = [torch.randn(total, block_size, kv_heads, head_dim, generator=g).to(dtype) for _ in range(2)]
    return q, k, v, caches, meta


def main(argv: list[str] | None = None) -> None:
    ap = common.parser(__doc__, rounds=None, baseline=False)
    ap.add_argument("--dtype", default="both", choices=["both", *DTYPES])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=500)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--block-sizes", default="16,32,64")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--cases", default="", help="comma-separated case-name prefixes to run (default: all)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(common.machine_header())
    g = torch.Generator().manual_seed(1)
    ctx = [int(args.context * (0.75 + 0.5 * x)) for x in torch.rand(args.batch, generator=g).tolist()]
    cases = {
        f"decode B={args.batch} ctx~{args.context}": ([1] * args.batch, ctx),
        "decode B=1 ctx=2000": ([1], [2000]),
        f"extend {args.chunk} on 1500": ([args.chunk], [1500 + args.chunk]),
        f"prefill {args.chunk}": ([args.chunk], [args.chunk]),
        f"mixed: {args.batch - 1} decodes + prefill {args.chunk}": ([1] * (args.batch - 1) + [args.chunk],
                                                                     ctx[:-1] + [args.chunk]),
    }
    rows = []
    print(f"{'case':40} {'dtype':9} {'bs':>3} {'gather+SDPA ms':>15} {'in-place ms':>12} {'ratio':>6} {'floor ms':>9}")
    bw = common.copy_bandwidth(torch.device("cpu"), 2**27)
    for dname in DTYPES if args.dtype == "both" else [args.dtype]:
        dtype = DTYPES[dname]
        new = CpuPagedAttention(kernel_table(torch.device("cpu"), dtype))
        for bs in map(int, args.block_sizes.split(",")):
            old = TorchPagedAttention(bs)
            for name, (q_lens, seq_lens) in cases.items():
                if args.cases and not name.startswith(tuple(args.cases.split(","))):
                    continue
                q, k, v, (kc, vc), meta = make_case(q_lens, seq_lens, args.heads, args.kv_heads, args.head_dim, bs,
                                                   dtype)
                old_call = (q, k, v, kc, vc, old.build_metadata(meta, args.kv_heads, dtype), 0.125)
                new_call = (q, k, v, kc, vc, new.build_metadata(meta, args.kv_heads, dtype), 0.125)
                old_ms = best_ms(lambda c=old_call, old=old: old.forward(*c), args.reps)
                new_ms = best_ms(lambda c=new_call, new=new: new.forward(*c), args.reps)
                kv_bytes = 2 * sum(seq_lens) * args.kv_heads * args.head_dim * dtype.itemsize
                floor = kv_bytes / bw * 1e3
                rows.append({"case": name, "dtype": dname, "block_size": bs, "gather_sdpa_ms": old_ms,
                             "inplace_ms": new_ms, "ratio": new_ms / old_ms, "floor_ms": floor})
                print(f"{name:40} {dname:9} {bs:>3} {old_ms:15.2f} {new_ms:12.2f} {new_ms / old_ms:6.2f} {floor:9.2f}")
    common.write_json(args.json, {"rows": rows})


if __name__ == "__main__":
    main()
