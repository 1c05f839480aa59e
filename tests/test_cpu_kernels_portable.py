"""The C++ kernels built for other CPUs than this one: AVX-512 without AVX512-BF16 (the machines where fp32 is the
fast dtype), AVX2 only, and baseline x86-64 (SSE2: the scalar paths, which are what an Arm machine runs). Each
`#ifdef` path is then compiled and run here, against the same references as the native build's tests. A
subprocess per target: the ops register under one name per process. Each target is a fresh build (about a
minute), so these are in the slow tier."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pagedserve.engine.machine import cpu

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHECK = r"""
import sys
from pagedserve.engine import cpu_kernels
cpu_kernels.CFLAGS = [f"-march={sys.argv[1]}" if f.startswith("-march") else f for f in cpu_kernels.CFLAGS]
assert cpu_kernels.load(), "the kernels did not build"
import torch
from conftest import quant_reference, quant_tolerance
import torch.nn.functional as F
from pagedserve.engine.layers.dispatch import KernelTable
from pagedserve.engine.layers.linear import Linear
from pagedserve.engine.quant.formats import quantize
torch.manual_seed(0)
table = KernelTable(cpp=True)
gemv_max = table.quant_gemv_max_rows
import numpy as np
from pagedserve.benchmarks.gguf_quants import random_blocks
from pagedserve.engine.quant.formats import cat
from pagedserve.engine.quant.gguf_blocks import GGUFBlocks


def weights():
    # our formats (int4 with a Q4_1-style bias: every path bias term), then GGUF types and mixed fusions
    for fmt, (n, k), group in (("int8", (112, 1152), 32), ("int8", (960, 576), 32), ("int8", (48, 8224), 32),
                               ("int4", (112, 1152), 32), ("int4", (64, 1120), 32), ("int4", (960, 576), 64),
                               ("int4", (576, 1536), 128)):
        qw = quantize(torch.randn(n, k) * 0.02, fmt, group)
        if fmt == "int4":
            qw.bias, qw.symmetric = (torch.randn(n, k // group) * 0.01).half(), False
        yield qw
    rng = np.random.default_rng(0)
    for kinds in (("Q4_K",), ("Q5_K",), ("Q6_K",), ("Q5_0",), ("Q5_1",), ("Q4_K", "Q6_K"), ("Q4_0", "Q6_K")):
        yield cat([GGUFBlocks(t, random_blocks(t, 64, 1024, rng), (64, 1024)).storage() for t in kinds])


for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
    for qw in weights():
        n, k = qw.shape
        fmt = qw.format
        ref = qw.dequantize()
        lin = Linear(k, n)
        lin.quantize_to(qw)
        lin.select_kernels(table, torch.device("cpu"), dtype)
        assert qw.layout == "panels", (fmt, n, k)  # our kernels, not torch's fallback
        for m in (1, 2, 3, 4, 5, 8, 13, gemv_max, gemv_max + 1):
            x = torch.randn(m, k).to(dtype)
            got, want = lin(x).float(), quant_reference(lin, x, ref)  # the GEMVs' int8 activations included
            rel = ((got - want).norm() / want.norm()).item()
            assert rel < quant_tolerance(lin, x, 2 * tol), (fmt, dtype, n, k, m, rel)
    for n, k, m in ((7, 5, 1), (960, 576, 1), (576, 1536, 2), (40, 4099, 3)):
        w, x, b = torch.randn(n, k).to(dtype), torch.randn(m, k).to(dtype), torch.randn(n).to(dtype)
        got, want = torch.ops.pagedserve.dense_linear(x, w, b).float(), F.linear(x.float(), w.float(), b.float())
        # fp32: summation order only (a scalar build sums each row in one chain: ~sqrt(K) roundings)
        tol_dense = {torch.float32: 1e-5, torch.bfloat16: 4e-3}[dtype]
        assert ((got - want).norm() / want.norm()).item() < tol_dense, (n, k, m)
    x = torch.randn(5, 3072).to(dtype)
    g, u = x.float().chunk(2, -1)
    want = (F.silu(g).to(dtype).float() * u).to(dtype)
    assert torch.allclose(torch.ops.pagedserve.silu_and_mul(x).float(), want.float(), rtol=tol, atol=tol)
    # one decode row per sequence, 9 query heads over 3 KV heads, K/V scattered over shuffled blocks
    bs, lens = 16, [37, 130]
    kc, vc = torch.randn(2, 24, bs, 3, 64).to(dtype).unbind(0)
    tables = torch.randperm(24)[:18].view(2, 9).int()
    q = torch.randn(2, 9, 64).to(dtype)
    out = torch.ops.pagedserve.paged_attention(q, kc, vc, tables, torch.tensor(lens, dtype=torch.int32),
                                               torch.tensor([0, 1, 2], dtype=torch.int32), 0.125, 16, 2)
    for b, n in enumerate(lens):
        kk = kc[tables[b].long()].reshape(-1, 3, 64)[:n].float().repeat_interleave(3, 1)
        vv = vc[tables[b].long()].reshape(-1, 3, 64)[:n].float().repeat_interleave(3, 1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[b].float(), kk) * 0.125, -1)
        assert torch.allclose(out[b].float(), torch.einsum("hn,nhd->hd", p, vv), rtol=tol, atol=tol), (dtype, b)
print("ok")
"""


@pytest.mark.slow
@pytest.mark.parametrize("arch,needs", [("skylake-avx512", {"avx512f", "avx512bw", "avx512vl", "avx512dq"}),
                                        ("x86-64-v3", {"avx2", "fma", "f16c"}), ("x86-64", {"sse2"})])
def test_kernels_built_for_other_cpus(tmp_path, arch, needs):
    if os.uname().machine != "x86_64" or not needs <= (cpu().flags or set()):
        pytest.skip(f"this CPU cannot run code built for {arch}")
    env = dict(os.environ, PAGEDSERVE_CACHE_DIR=str(tmp_path), PYTHONPATH=f"{REPO}{os.pathsep}{REPO}/tests")
    r = subprocess.run([sys.executable, "-c", CHECK, arch], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-4000:]
