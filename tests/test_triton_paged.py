"""Triton paged-attention kernels vs the PyTorch reference backend, on the CPU through Triton's interpreter.

Block tables are shuffled physical blocks with prefix blocks shared between sequences; cache slots no
sequence owns hold NaN for the Triton side (the reference gets finite garbage), so any read past a
sequence's context poisons the output.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels are decorated as interpreted
pytest.importorskip("triton")

import torch  # noqa: E402

from pagedserve.engine import LLMEngine, SamplingParams, make_config  # noqa: E402
from pagedserve.engine.attention import get_backend  # noqa: E402
from pagedserve.engine.attention import torch_paged as ref  # noqa: E402
from pagedserve.engine.attention import triton_paged as tp  # noqa: E402
from pagedserve.engine.attention.base import AttentionMetadata  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # atol = rtol


def make_batch(q_lens: list[int], seq_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
               block_size: int, dtype: torch.dtype, shared_blocks: int = 0, seed: int = 0):
    """A batch in model-runner order (decodes first), caches holding every sequence's cached prefix.

    The first `shared_blocks` physical blocks of a sequence are common to all sequences whose cached
    prefix covers them (prefix-cache hits); the rest are distinct blocks taken from a shuffled pool.
    Returns q, k, v, (k_cache, v_cache) for the reference, (k_cache, v_cache) for Triton, meta.
    """
    g = torch.Generator().manual_seed(seed)
    total = sum(-(-n // block_size) for n in seq_lens) + 3
    pool = (torch.randperm(total - 1, generator=g) + 1).tolist()  # block 0 (table padding) stays unowned
    shared = [pool.pop() for _ in range(shared_blocks)]
    tables, slots = [], []
    for q_len, seq_len in zip(q_lens, seq_lens, strict=True):
        num_shared = min(shared_blocks, (seq_len - q_len) // block_size)  # only blocks wholly cached
        table = shared[:num_shared] + [pool.pop() for _ in range(-(-seq_len // block_size) - num_shared)]
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size
                  for p in range(seq_len - q_len, seq_len)]
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    torch.cumsum(torch.tensor(q_lens), 0, out=qsl[1:])
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64), query_start_loc=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=block_tables,
        max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        num_decodes=next((i for i, n in enumerate(q_lens) if n != 1), len(q_lens)),
        query_lens_cpu=list(q_lens), seq_lens_cpu=list(seq_lens))

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    tokens = sum(q_lens)
    q = randn(tokens, num_heads, head_dim)
    k, v = randn(tokens, num_kv_heads, head_dim), randn(tokens, num_kv_heads, head_dim)
    ref_caches = tuple(randn(total, block_size, num_kv_heads, head_dim) for _ in range(2))
    owned = torch.zeros(total * block_size, dtype=torch.bool)
    for table, seq_len in zip(tables, seq_lens, strict=True):
        pos = torch.arange(seq_len)
        owned[torch.tensor(table)[pos // block_size] * block_size + pos % block_size] = True
    tri_caches = tuple(c.clone().view(total * block_size, -1).masked_fill_(~owned[:, None], float("nan"))
                       .view(c.shape) for c in ref_caches)
    return q, k, v, ref_caches, tri_caches, meta


def run_both(batch, scale: float = 0.1, kv_splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(Triton output, fp32 reference output) for the same inputs; also checks the stored K/V."""
    q, k, v, (rk, rv), (tk, tv), meta = batch
    out = tp.TritonPagedAttention(kv_splits).forward(q, k, v, tk, tv, meta, scale)
    rk32, rv32 = rk.float(), rv.float()
    expect = ref.TorchPagedAttention().forward(q.float(), k.float(), v.float(), rk32, rv32, meta, scale)
    slots = meta.slot_mapping
    for tri, want in ((tk, rk32), (tv, rv32)):
        assert torch.equal(tri.flatten(0, 1)[slots].float(), want.flatten(0, 1)[slots])
    assert out.dtype == q.dtype and out.shape == q.shape
    return out.float(), expect


def assert_close(out: torch.Tensor, expect: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(out, expect, atol=TOL[dtype], rtol=TOL[dtype])


# ---- store ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_store_kv_scatters_and_skips_padding(dtype):
    g = torch.Generator().manual_seed(1)
    num_kv_heads, head_dim, block_size, num_blocks = 3, 16, 16, 8
    qkv = torch.randn(9, 4 + 2 * num_kv_heads, head_dim, generator=g).to(dtype)  # k, v: strided views
    k, v = qkv[:, 4:4 + num_kv_heads], qkv[:, 4 + num_kv_heads:]
    slots = torch.randperm(num_blocks * block_size, generator=g)[:9]
    slots[[2, 7]] = -1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = [torch.randn(shape, generator=g).to(dtype) for _ in range(2)]
    expect = [c.clone() for c in caches]
    tp.store_kv(k, v, *caches, slots)
    ref.store_rows(k, v, *expect, *ref.drop_padding(slots))
    assert torch.equal(caches[0], expect[0]) and torch.equal(caches[1], expect[1])


# ---- decode ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 7])
@pytest.mark.parametrize("kv_splits", [1, 3])
def test_decode(group, head_dim, dtype, kv_splits):
    seq_lens = [1, 17, 64, 200]  # 1 token, partial block, exact blocks, several BLOCK_N tiles
    batch = make_batch([1] * 4, seq_lens, 2 * group, 2, head_dim, 16, dtype, shared_blocks=1, seed=group)
    assert_close(*run_both(batch, kv_splits=kv_splits), dtype)


@pytest.mark.parametrize("block_size", [32, 256])
def test_decode_block_sizes_and_heuristic_splits(block_size):
    seq_lens = [1, 33, 255, 257, 700]
    batch = make_batch([1] * 5, seq_lens, 8, 1, 64, block_size, torch.float32, shared_blocks=1)  # MQA
    assert_close(*run_both(batch), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_long_context_split(dtype):
    batch = make_batch([1, 1], [2000, 1337], 7, 1, 128, 16, dtype, shared_blocks=40, seed=3)
    assert_close(*run_both(batch, kv_splits=8), dtype)


def test_num_kv_splits():
    cpu = torch.device("cpu")
    assert tp.num_kv_splits(1, 8, 100, cpu) == 1
    for batch, kv_heads, length in [(1, 1, 16384), (1, 2, 4096), (64, 8, 100_000)]:
        n = tp.num_kv_splits(batch, kv_heads, length, cpu)
        assert 1 <= n <= tp.MAX_KV_SPLITS and n & (n - 1) == 0


# ---- prefill / extend -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 7])
def test_prefill_and_extend(group, head_dim, dtype):
    # a fresh prompt, an extend over a shared cached prefix, and one spanning several query tiles
    q_lens, seq_lens = [40, 23, 150], [40, 90, 170]
    batch = make_batch(q_lens, seq_lens, 2 * group, 2, head_dim, 16, dtype, shared_blocks=2, seed=group)
    assert_close(*run_both(batch), dtype)


@pytest.mark.parametrize("block_size", [16, 64, 256])
def test_extend_long_cached_prefix(block_size):
    batch = make_batch([20, 7], [2000, 1100], 4, 4, 64, block_size, torch.float32, shared_blocks=2)
    assert_close(*run_both(batch), torch.float32)


@pytest.mark.parametrize("head_dim", [16, 80, 256])  # the tiny test model's 16, a non power of two, wide
def test_other_head_dims(head_dim):
    batch = make_batch([1, 1, 9, 33], [5, 70, 9, 100], 6, 2, head_dim, 32, torch.float32, shared_blocks=1)
    assert_close(*run_both(batch, kv_splits=2), torch.float32)


# ---- mixed batches ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv_splits", [1, 4])
def test_mixed_decodes_and_extends(dtype, kv_splits):
    q_lens, seq_lens = [1, 1, 1, 12, 30, 2], [9, 130, 48, 60, 30, 300]
    batch = make_batch(q_lens, seq_lens, 9, 3, 64, 16, dtype, shared_blocks=2, seed=kv_splits)
    assert_close(*run_both(batch, kv_splits=kv_splits), dtype)


# ---- whole model ----------------------------------------------------------------------------------------

def greedy(backend: str, prompts: list[list[int]], **options) -> list[list[int]]:
    engine = LLMEngine(make_config(model="random:tiny", attention_backend=backend, device="cpu",
                                   dtype="float32", num_blocks=64, **options))
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outputs: list[list[int]] = []
    for group in prompts:  # groups run one after another, so later ones hit the prefix cache
        tokens: dict[str, list[int]] = {}
        for i, prompt in enumerate(group):
            engine.add_request(f"{len(outputs)}-{i}", prompt, params)
            tokens[f"{len(outputs)}-{i}"] = []
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
        outputs += list(tokens.values())
    return outputs


def test_model_greedy_matches_torch_backend():
    assert get_backend("triton", torch.device("cpu")).name == "triton"
    prompts = [[list(range(5, 40)), [7] * 3, list(range(100, 190))],  # 90 tokens: chunked by the budget
               [list(range(5, 40)) + [400, 401], list(range(5, 22))]]  # prefix-cache hits
    # a small token budget forces chunked prefill, so steps mix decodes with extends
    want = greedy("torch", prompts, max_num_batched_tokens=48)
    got = greedy("triton", prompts, max_num_batched_tokens=48)
    assert got == want
    assert all(len(t) == 12 for t in got)


def test_padded_decode_graph_buffers_match_eager():
    """The CUDA-graph path's static, padded buffers (eager here: no GPU) give the plain path's tokens."""
    from pagedserve.engine.graph_runner import DecodeGraphRunner, graph_batch_sizes

    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    prompts = [[list(range(5, 40)), [7] * 3, list(range(100, 130))]]  # 3 decoding rows, padded to 4
    want = greedy("torch", prompts, max_num_batched_tokens=256)

    engine = LLMEngine(make_config(model="random:tiny", attention_backend="triton", device="cpu",
                                   dtype="float32", num_blocks=64, max_num_batched_tokens=256))
    runner = engine.runner
    runner.graph_runner = DecodeGraphRunner(runner.model, runner.kv_caches, max_batch=6, max_model_len=1024,
                                            block_size=engine.config.cache.block_size, device=runner.device,
                                            capture=False)
    calls = []
    original = runner.graph_runner.run
    runner.graph_runner.run = lambda *a: calls.append(a[0].shape[0]) or original(*a)
    got = []
    for batch in prompts:
        for i, p in enumerate(batch):
            engine.add_request(str(i), p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
        tokens = {}
        while engine.has_unfinished():
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        got += [tokens[str(i)] for i in range(len(batch))]
    assert got == want
    assert calls and set(calls) == {3}  # every decode step went through the padded buffers
    assert engine.block_manager.num_used_blocks == 0


# ---- benchmark smoke test -------------------------------------------------------------------------------

def test_bench_paged_attention_quick_cpu(tmp_path):
    out = tmp_path / "bench.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, str(REPO / "benchmarks/kernels/bench_paged_attention.py"), "--quick",
           "--device", "cpu", "--json", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert out.read_text().strip().startswith("{")


# ---- GPU compilation ------------------------------------------------------------------------------------

# The interpreter checks no GPU constraint (tl.dot shapes, shared memory), so also compile the kernels for
# Hopper: triton ships ptxas, no GPU is needed. In a fresh process, where triton.jit does not interpret.
SM90_COMPILE = r"""
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from pagedserve.engine.attention import triton_paged as tp

TYPES = {"slot_ptr": "*i64", "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_ptr": "*i32",
         "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "scale_log2": "fp32", "first_seq": "i32"}

def compile_sm90(fn, dtype, num_warps, **constexprs):
    sig = {n: "constexpr" if n in constexprs else TYPES.get(n, "*" + dtype if n.endswith("_ptr") else "i32")
           for n in fn.arg_names}
    # what a launch specializes on: 16-byte aligned pointers, strides divisible by 16
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n.endswith("_ptr") or n.startswith("stride")}
    src = ASTSource(fn, sig, constexprs=constexprs, attrs=attrs)
    options = dict(num_warps=num_warps, num_stages=2)  # as the launches
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    assert kernel.metadata.shared <= 227 * 1024, (fn.__name__, kernel.metadata.shared)

compile_sm90(tp._store_kv_kernel, "bf16", 4, NUM_KV_HEADS=2, HEAD_DIM=128, PAGE=16, BLOCK_H=2, BLOCK_D=128)
compile_sm90(tp._decode_reduce_kernel, "bf16", 4, HEAD_DIM=128, NUM_SPLITS=4, BLOCK_S=4, BLOCK_D=128)
for dtype, name, head_dim in ((torch.bfloat16, "bf16", 64), (torch.bfloat16, "bf16", 128),
                              (torch.bfloat16, "bf16", 256), (torch.float32, "fp32", 128)):
    shape = dict(GROUP=7, HEAD_DIM=head_dim, PAGE=16, UPCAST=False)
    block_d, block_n, warps = tp.decode_tiles(head_dim, dtype)
    for splits in (1, 4):
        compile_sm90(tp._decode_kernel, name, warps, NUM_SPLITS=splits, BLOCK_G=16, BLOCK_D=block_d,
                     BLOCK_N=block_n, **shape)
    block_d, block_m, block_n, warps = tp.prefill_tiles(head_dim, dtype)
    compile_sm90(tp._prefill_kernel, name, warps, BLOCK_M=block_m, BLOCK_D=block_d, BLOCK_N=block_n, **shape)
"""


@pytest.mark.slow
def test_kernels_compile_for_hopper():
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", SM90_COMPILE], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
