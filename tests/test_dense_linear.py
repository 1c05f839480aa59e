"""Our dense GEMV (engine/csrc/dense_linear.cpp) against F.linear in fp32, and the Linear module's routing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.engine.layers.dispatch import KernelTable
from pagedserve.engine.layers.linear import Linear

pytestmark = pytest.mark.usefixtures("cpp_kernels")

# relative error of the whole output against an fp32 reference: fp32 differs by summation order only; bf16 and
# fp16 round the output once (2^-9 and 2^-12 relative at most), plus the fp32 sums
TOL = {torch.float32: 1e-6, torch.bfloat16: 4e-3, torch.float16: 1e-3}


# K below one vector, not a multiple of any vector width, SmolLM2's hidden and intermediate, and a long row
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(7, 5), (33, 100), (960, 576), (576, 1536), (40, 4099)])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 9, 13])  # every tile height, and 8 + 1 and 8 + 5
@pytest.mark.parametrize("bias", [False, True])
def test_dense_linear_matches_fp32_reference(dtype, n, k, m, bias):
    gen = torch.Generator().manual_seed(n * 1000 + k + m)
    w = torch.randn(n, k, generator=gen).to(dtype)
    x = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    got = torch.ops.pagedserve.dense_linear(x, w, b)
    assert got.dtype == dtype and got.shape == (m, n)
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    rel = ((got.float() - want).norm() / want.norm()).item()
    assert rel < TOL[dtype], rel


def test_dense_linear_rejects_mismatched_inputs():
    w = torch.randn(8, 16)
    with pytest.raises(RuntimeError, match="dtype"):
        torch.ops.pagedserve.dense_linear(torch.randn(1, 16).bfloat16(), w, None)
    with pytest.raises(RuntimeError, match="x \\[M, K\\]"):
        torch.ops.pagedserve.dense_linear(torch.randn(1, 15), w, None)
    with pytest.raises(RuntimeError, match="fp32, bf16 or fp16"):
        torch.ops.pagedserve.dense_linear(torch.randn(1, 16).double(), w.double(), None)


@pytest.mark.parametrize("dtype,prepack,keep_plain", [(torch.float32, False, True), (torch.float32, True, True),
                                                      (torch.bfloat16, True, False), (torch.bfloat16, True, True)])
def test_linear_routes_by_row_count(dtype, prepack, keep_plain):
    """One or two rows take our GEMV where the row-major weight is kept; more rows, or a dropped row-major weight,
    take oneDNN's prepacked copy (or F.linear); the result agrees either way."""
    torch.manual_seed(0)
    lin = Linear(576, 960, bias=True).to(dtype)
    torch.nn.init.normal_(lin.weight)
    torch.nn.init.normal_(lin.bias)
    ref = lin.weight.detach().float().clone(), lin.bias.detach().float().clone()
    table = KernelTable(cpp=True)
    lin.select_kernels(table, torch.device("cpu"), dtype, prepack=prepack, keep_plain=keep_plain)
    kernels = [r.kernel for r in lin.routes]
    big = "oneDNN, prepacked" if prepack else "F.linear"
    assert kernels == (["dense GEMV (ours)", big] if keep_plain else [big])
    assert (lin.fused_operands is not None) == keep_plain
    for m in (1, 2, 3, 64):
        x = torch.randn(m, 576).to(dtype)
        got = lin(x).float()
        want = F.linear(x.float(), *ref)
        assert ((got - want).norm() / want.norm()).item() < TOL[dtype]
        ours = next(r for r in lin.routes if m <= r.max_rows).kernel == "dense GEMV (ours)"
        assert ours == (m <= table.dense_gemv_max_rows and keep_plain), m


def test_many_row_gemms_meet_few_row_counts(monkeypatch):
    """Above 64 rows a GEMM runs at a bucketed row count (oneDNN keeps a kernel per shape it meets): every row
    count from 65 to 2,048 maps to one of a few dozen, never fewer rows than asked nor more than 1/16 (or 15)
    extra, and the padded rows never reach the caller."""
    import types

    from pagedserve.engine.layers import linear as linear_module
    from pagedserve.engine.layers.linear import gemm_rows

    assert [gemm_rows(r) for r in (1, 64)] == [1, 64]
    seen = {gemm_rows(r) for r in range(65, 2049)}
    assert len(seen) <= 64
    for r in range(65, 4097):
        assert r <= gemm_rows(r) <= max(r + 15, r + r // 16), r

    lin = Linear(64, 48)
    torch.nn.init.normal_(lin.weight)
    lin.select_kernels(KernelTable(cpp=True), torch.device("cpu"), torch.float32)
    assert lin.describe_routes().endswith("F.linear")
    rows_run = []  # the rows F.linear meets inside the route
    monkeypatch.setattr(linear_module, "F", types.SimpleNamespace(
        pad=F.pad, linear=lambda x, *a: rows_run.append(len(x)) or F.linear(x, *a)))
    for m in (3, 65, 100, 513):
        x = torch.randn(m, 64)
        got = lin(x)
        assert got.shape == (m, 48)
        torch.testing.assert_close(got, F.linear(x, lin.weight))
    assert rows_run == [3, 80, 112, 544]
