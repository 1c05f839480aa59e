"""The C++ CPU paged-attention kernel vs the PyTorch reference backend (the oracle), and the whole model.

Block tables are shuffled physical blocks with prefix blocks shared between sequences; slots that no
sequence owns hold NaN on the kernel's side, so any read outside a sequence's context poisons the output.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
from conftest import greedy, record_comparison, run_to_completion

from pagedserve.engine.attention import cpu_paged as cp
from pagedserve.engine.attention import get_backend
from pagedserve.engine.attention import torch_paged as ref
from pagedserve.engine.attention.base import AttentionMetadata
from pagedserve.engine.layers.dispatch import KernelTable

TOL = {torch.float32: 2e-5, torch.bfloat16: 5e-3}


@pytest.fixture(scope="module")
def kernel():
    """A backend factory: every sequence with up to `max_query` query tokens through the kernel."""
    return lambda max_query=10**9: cp.CpuPagedAttention(KernelTable(cpp=True, attention_kernel_max_query=max_query))


def make_batch(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, shared_blocks=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(-(-n // block_size) for n in seq_lens) + 3
    pool = (torch.randperm(total - 1, generator=g) + 1).tolist()
    shared = [pool.pop() for _ in range(shared_blocks)]
    tables, slots = [], []
    for q_len, seq_len in zip(q_lens, seq_lens):
        num_shared = min(shared_blocks, (seq_len - q_len) // block_size)  # only wholly cached blocks
        table = shared[:num_shared] + [pool.pop() for _ in range(-(-seq_len // block_size) - num_shared)]
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(seq_len - q_len, seq_len)]
    width = max(len(t) for t in tables)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    torch.cumsum(torch.tensor(q_lens), 0, out=qsl[1:])
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64), query_start_loc=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        num_decodes=next((i for i, n in enumerate(q_lens) if n != 1), len(q_lens)),
        query_lens_cpu=list(q_lens), seq_lens_cpu=list(seq_lens))
    tokens = sum(q_lens)
    # q, k, v as strided views of one fused projection, as the model hands them over
    qkv = torch.randn(tokens, num_heads + 2 * num_kv_heads, head_dim, generator=g).to(dtype)
    q, k, v = qkv[:, :num_heads], qkv[:, num_heads:num_heads + num_kv_heads], qkv[:, num_heads + num_kv_heads:]
    ref_caches = tuple(torch.randn(total, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
                       for _ in range(2))
    owned = torch.zeros(total * block_size, dtype=torch.bool)
    for table, seq_len in zip(tables, seq_lens):
        pos = torch.arange(seq_len)
        owned[torch.tensor(table)[pos // block_size] * block_size + pos % block_size] = True
    ours = tuple(c.clone().view(total * block_size, -1).masked_fill_(~owned[:, None], float("nan")).view(c.shape)
                 for c in ref_caches)
    return q, k, v, ref_caches, ours, meta


def check(batch, dtype, kernel, max_kernel_query_len=10**9, scale=0.125):
    """Our backend (every sequence through the kernel by default) against the fp32 reference."""
    q, k, v, (rk, rv), (ok, ov), meta = batch
    out = kernel(max_kernel_query_len).forward(q, k, v, ok, ov, meta, scale)
    rk32, rv32 = rk.float(), rv.float()
    want = ref.TorchPagedAttention().forward(q.float(), k.float(), v.float(), rk32, rv32, meta, scale)
    slots = meta.slot_mapping
    assert torch.equal(ok.flatten(0, 1)[slots].float(), rk32.flatten(0, 1)[slots])  # K/V stored
    assert out.dtype == q.dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 7])
def test_decode(kernel, group, dtype):
    seq_lens = [1, 17, 64, 200, 2000]  # one token, a partial block, exact blocks, a long context
    check(make_batch([1] * 5, seq_lens, 2 * group, 2, 64, 16, dtype, shared_blocks=1, seed=group), dtype, kernel)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_batch1_long_context_splits(kernel, dtype):
    assert cp.num_splits(3, 2000, 2) > 1  # few work items: the context is split across threads
    check(make_batch([1], [2000], 9, 3, 64, 16, dtype, seed=5), dtype, kernel)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 7])
def test_prefill_and_extend(kernel, group, dtype):
    # a fresh prompt, an extend over a shared cached prefix, one spanning several query tiles, a long context
    q_lens, seq_lens = [40, 23, 150, 37], [40, 90, 170, 2000]
    check(make_batch(q_lens, seq_lens, 2 * group, 2, 64, 16, dtype, shared_blocks=2, seed=group), dtype, kernel)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("max_kernel_query_len", [1, 16, 10**9])
def test_mixed_batches_split_between_kernel_and_sdpa(kernel, dtype, max_kernel_query_len):
    q_lens, seq_lens = [1, 1, 1, 12, 30, 2, 100], [9, 130, 48, 60, 30, 300, 1900]
    batch = make_batch(q_lens, seq_lens, 9, 3, 64, 16, dtype, shared_blocks=2, seed=max_kernel_query_len % 7)
    check(batch, dtype, kernel, max_kernel_query_len)


# bf16 decodes with head dims in 64s take the vdpbf16ps path (where the CPU has it): blocks shorter and longer
# than its 16-key chunks, odd key counts
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size,head_dim", [(1, 64), (8, 16), (32, 80), (64, 128), (256, 64)])
def test_block_sizes_and_head_dims(kernel, block_size, head_dim, dtype):
    q_lens, seq_lens = [1, 1, 9, 33, 1], [5, 700, 9, 300, 37]
    check(make_batch(q_lens, seq_lens, 6, 2, head_dim, block_size, dtype, shared_blocks=1), dtype, kernel)


def test_padding_slots_are_not_stored(kernel):
    q, k, v, (rk, rv), (ok, ov), meta = make_batch([1, 1], [10, 20], 4, 2, 64, 16, torch.float32)
    meta.slot_mapping[1] = -1
    before = ok.clone()
    kernel().forward(q, k, v, ok, ov, meta, 0.125)
    changed = (ok != before) & ~(ok.isnan() & before.isnan())
    assert int(changed.any(dim=(1, 2, 3)).sum()) == 1  # only the first sequence's block was written


def test_a_build_killed_midway_does_not_hang_later_starts():
    """torch's build lock is a plain file: a build killed by SIGKILL or SIGTERM leaves it, and torch would wait on
    it forever at every later start (even with the library built). Found under our flock, it is removed."""
    import subprocess
    import sys

    from pagedserve.engine import cpu_kernels

    assert cpu_kernels.load()
    stale = cpu_kernels.build_dir() / "lock"
    stale.touch()
    code = "from pagedserve.engine import cpu_kernels; assert cpu_kernels.load()"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
    assert not stale.exists()


def test_each_ninja_builds_into_its_own_directory(monkeypatch, tmp_path):
    """An activated venv finds pip's ninja, `.venv/bin/python` the system's: of two versions, each reads the other's
    .ninja_log as foreign and rebuilds everything, so sharing one directory rebuilt the kernels at every switch."""
    from pagedserve.engine import cpu_kernels

    other = tmp_path / "ninja"
    other.write_text("#!/bin/sh\necho 1.0.0\n")
    other.chmod(0o755)
    before = cpu_kernels.build_dir()
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert cpu_kernels.build_dir() != before


def test_compile_failure_falls_back_to_the_reference_or_fails_when_required(monkeypatch, tmp_path, caplog):
    from pagedserve.engine import cpu_kernels

    (tmp_path / "csrc").mkdir()
    (tmp_path / "csrc" / "broken.cpp").write_text("#error this does not compile\n")
    monkeypatch.setattr(cpu_kernels, "CSRC", tmp_path / "csrc")
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(cpu_kernels.KernelBuildError):  # the test suite and CI require the kernels
        cpu_kernels.load.__wrapped__()
    monkeypatch.delenv("PAGEDSERVE_REQUIRE_KERNELS")
    with caplog.at_level(logging.WARNING):
        assert cpu_kernels.load.__wrapped__() is False
    assert "PyTorch paths" in caplog.text
    assert get_backend("auto", torch.device("cpu"), KernelTable(cpp=False)).name == "torch"


def test_auto_picks_the_kernel_on_cpu(kernel):
    assert get_backend("auto", torch.device("cpu")).name == "cpu"


def test_smollm_greedy_matches_reference_backend(make_engine):
    """Real weights, chunked prefill mixing decodes with extends, prefix-cache hits: same greedy tokens."""
    base = "The quick brown fox jumps over the lazy dog. " * 12
    prompts = [base + "Once upon a time", "Hello", base + "In a distant land", "Write a poem about the sea."]
    outputs = {}
    for backend in ("torch", "cpu"):
        engine = make_engine(attention_backend=backend, max_num_batched_tokens=64, num_blocks=128)
        assert engine.runner.backend.name == backend
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, greedy(24))
        outputs[backend] = run_to_completion(engine)
        assert engine.block_manager.num_used_blocks == 0
    for i in map(str, range(len(prompts))):
        ours, want = outputs["cpu"][i], outputs["torch"][i]
        record_comparison(f"cpu backend request {i}", ours["tokens"], want["tokens"], ours["logprobs"])
