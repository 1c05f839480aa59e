"""Decode paged-attention kernel benchmark: Triton backend vs the PyTorch reference vs dense SDPA.

For batch x context, times one decode attention call (store of the new K/V + attention over the
blocks) and reports the K/V bandwidth it achieves: bytes of K and V read (context x KV heads x head
dim per sequence) / time, also as a % of the device's measured copy bandwidth (the practical roof
for a memory-bound kernel). SDPA runs on K/V already gathered into contiguous tensors: a dense
baseline that pays no paging cost (and whose gather is not timed).

    python benchmarks/kernels/bench_paged_attention.py [--json out.json]          # on a GPU
    TRITON_INTERPRET=1 python benchmarks/kernels/bench_paged_attention.py --quick --device cpu
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from pagedserve.benchmarks import common
from pagedserve.engine.attention.base import AttentionMetadata
from pagedserve.engine.attention.torch_paged import TorchPagedAttention
from pagedserve.engine.attention.triton_paged import TritonPagedAttention, num_kv_splits

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def decode_batch(batch: int, context: int, args: argparse.Namespace, device: torch.device):
    """Caches with every sequence's blocks scattered over a shuffled pool, and its decode metadata."""
    dtype, bs = DTYPES[args.dtype], args.block_size
    blocks_per_seq = -(-context // bs)
    num_blocks = batch * blocks_per_seq
    tables = torch.randperm(num_blocks, device=device).view(batch, blocks_per_seq).to(torch.int32)
    pos = context - 1  # the new token is the last one
    slots = tables[:, pos // bs].long() * bs + pos % bs
    meta = AttentionMetadata(
        slot_mapping=slots, query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device), block_tables=tables,
        max_query_len=1, max_seq_len=context, num_decodes=batch, query_lens_cpu=[1] * batch,
        seq_lens_cpu=[context] * batch)
    shape = (num_blocks, bs, args.num_kv_heads, args.head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    q = torch.randn(batch, args.num_heads, args.head_dim, dtype=dtype, device=device)
    k = torch.randn(batch, args.num_kv_heads, args.head_dim, dtype=dtype, device=device)
    v = torch.randn_like(k)
    return q, k, v, k_cache, v_cache, meta


def fits(batch: int, context: int, args: argparse.Namespace, device: torch.device) -> bool:
    """The cache plus SDPA's contiguous copy of it (and a transient), with a margin.

    The baselines may need more (the reference gathers a copy; SDPA's math fallback repeats K/V per
    query head): they are reported as OOM when they run out, without stopping the sweep.
    """
    cache = 2 * batch * context * args.num_kv_heads * args.head_dim * DTYPES[args.dtype].itemsize
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 8 * 2**30
    return 3 * cache < free


def run_case(batch: int, context: int, args: argparse.Namespace, device: torch.device, bw: float) -> dict:
    q, k, v, k_cache, v_cache, meta = decode_batch(batch, context, args, device)
    scale = args.head_dim ** -0.5
    triton_backend, torch_backend = TritonPagedAttention(), TorchPagedAttention(args.block_size)
    # each backend's per-step metadata is built once, as the model runner does for all layers
    triton_meta = triton_backend.build_metadata(meta, args.num_kv_heads, q.dtype)
    torch_meta = torch_backend.build_metadata(meta, args.num_kv_heads, q.dtype)
    calls = {"triton": lambda: triton_backend.forward(q, k, v, k_cache, v_cache, triton_meta, scale),
             "torch": lambda: torch_backend.forward(q, k, v, k_cache, v_cache, torch_meta, scale)}
    triton_out = calls["triton"]()  # also stores the new K/V, so the gather below includes them
    # SDPA's operands: the same K/V gathered once into contiguous [B, Hkv, L, D]
    tables = meta.block_tables.long()
    dense_k, dense_v = (c[tables].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
                        for c in (k_cache, v_cache))
    calls["sdpa"] = lambda: F.scaled_dot_product_attention(q.unsqueeze(2), dense_k, dense_v, scale=scale,
                                                            enable_gqa=True)
    kv_bytes = 2 * batch * context * args.num_kv_heads * args.head_dim * q.element_size()
    row = {"batch": batch, "context": context, "kv_bytes": kv_bytes,
           "kv_splits": num_kv_splits(batch, args.num_kv_heads, context, device)}
    try:
        dense_out = calls["sdpa"]().squeeze(2)
        row["max_abs_err_vs_sdpa"] = (triton_out.float() - dense_out.float()).abs().max().item()
    except torch.OutOfMemoryError:
        row["max_abs_err_vs_sdpa"] = None
    for name, fn in calls.items():
        try:
            ms = common.median_ms(fn, reps=3, warmup=1, device=device)
        except torch.OutOfMemoryError:  # a baseline's temporaries (gathers, SDPA's math fallback) too big
            row[f"{name}_us"] = row[f"{name}_GBps"] = row[f"{name}_pct_bw"] = None
            torch.cuda.empty_cache()
            continue
        row[f"{name}_us"] = ms * 1e3
        row[f"{name}_GBps"] = kv_bytes / (ms * 1e-3) / 1e9
        row[f"{name}_pct_bw"] = 100 * kv_bytes / (ms * 1e-3) / bw
    return row


def _f(x: float | None, width: int, digits: int, kind: str = "f") -> str:
    return f"{'OOM':>{width}}" if x is None else f"{x:>{width}.{digits}{kind}}"


def main(argv: list[str] | None = None) -> None:
    p = common.parser(__doc__, rounds=None, baseline=False)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    p.add_argument("--num-heads", type=int, default=32)  # Llama-3-8B's attention shape
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--batches", default="1,8,64,256")
    p.add_argument("--contexts", default="128,1024,4096,16384")
    p.add_argument("--quick", action="store_true", help="tiny shapes: a smoke test (on CPU: interpreted)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if args.quick:
        args.batches, args.contexts, args.dtype = "1,3", "16,40", "float32"
        args.num_heads, args.num_kv_heads, args.head_dim = 4, 2, 64
    batches = [int(x) for x in args.batches.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    torch.manual_seed(0)

    bw = common.copy_bandwidth(device, 2**30 if device.type == "cuda" and not args.quick else 2**22)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(common.machine_header())
    print(f"{name}: measured copy bandwidth {bw / 1e9:.0f} GB/s; {args.dtype}, Hq={args.num_heads} "
          f"Hkv={args.num_kv_heads} D={args.head_dim} block={args.block_size}")
    header = (f"{'batch':>5} {'context':>7} {'splits':>6} | {'triton us':>9} {'GB/s':>6} {'%bw':>5} | "
              f"{'torch us':>9} {'%bw':>5} | {'sdpa us':>9} {'%bw':>5} | {'err':>7}")
    print(header)
    print("-" * len(header))
    rows = []
    for batch in batches:
        for context in contexts:
            if not fits(batch, context, args, device):
                print(f"{batch:>5} {context:>7}  skipped: does not fit in memory")
                continue
            r = run_case(batch, context, args, device, bw)
            rows.append(r)
            if device.type == "cuda":  # hand the case's tensors back before the next, larger one
                torch.cuda.empty_cache()
            print(f"{batch:>5} {context:>7} {r['kv_splits']:>6} | {_f(r['triton_us'], 9, 1)} "
                  f"{_f(r['triton_GBps'], 6, 0)} {_f(r['triton_pct_bw'], 5, 1)} | {_f(r['torch_us'], 9, 1)} "
                  f"{_f(r['torch_pct_bw'], 5, 1)} | {_f(r['sdpa_us'], 9, 1)} {_f(r['sdpa_pct_bw'], 5, 1)} | "
                  f"{_f(r['max_abs_err_vs_sdpa'], 7, 1, 'e')}", flush=True)
    common.write_json(args.json, {"device": name, "copy_bandwidth_Bps": bw, "config": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
