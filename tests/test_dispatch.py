"""The dispatch table: CPU facts, the start-up probes' rules (timers injected), their cache, and pinning."""

from __future__ import annotations

import json

import pytest
import torch

from pagedserve.engine import cpu_kernels
from pagedserve.engine.layers import dispatch
from pagedserve.engine.machine import Cpu, parse_cpuinfo

AVX512_NO_BF16 = frozenset("fpu sse2 avx2 fma avx512f avx512bw avx512vl avx512_vnni".split())
ZEN4 = AVX512_NO_BF16 | {"avx512_bf16"}
SAPPHIRE_RAPIDS = ZEN4 | {"amx_tile", "amx_bf16"}
GRAVITON3 = frozenset("fp asimd sve bf16 i8mm".split())


def test_cpuinfo_parsing_and_flags():
    text = "processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu sse2 avx512f avx512_bf16\n\n" \
           "processor\t: 1\nmodel name\t: Other\nflags\t: fpu\n"
    assert parse_cpuinfo(text) == ("Some CPU", frozenset({"fpu", "sse2", "avx512f", "avx512_bf16"}))
    assert Cpu("x", SAPPHIRE_RAPIDS, "x86_64").native_bf16 and Cpu("x", SAPPHIRE_RAPIDS, "x86_64").amx
    assert not Cpu("x", AVX512_NO_BF16, "x86_64").native_bf16
    assert Cpu("x", GRAVITON3, "aarch64").native_bf16 and not Cpu("x", GRAVITON3, "aarch64").is_x86
    assert "no-amx_bf16" in Cpu("x", ZEN4, "x86_64").describe()


def test_bf16_probe_rule():
    timer = lambda fp32, bf16: (lambda dtype: fp32 if dtype == torch.float32 else bf16)
    assert dispatch.probe_bf16_speedup(timer(0.7, 0.19))[0]
    for bf16 in (0.7, 0.65, 2.0):  # a tie or a loss keeps fp32's precision
        assert not dispatch.probe_bf16_speedup(timer(0.7, bf16))[0]
    assert "fp32 0.700 ms, bf16 0.190 ms" in dispatch.probe_bf16_speedup(timer(0.7, 0.19))[1]


def test_fp32_prepack_probe_rule():
    assert dispatch.probe_prepack_fp32(lambda packed: 1.0 if packed else 2.0)[0]  # oneDNN 2x faster
    assert not dispatch.probe_prepack_fp32(lambda packed: 1.0 if packed else 1.05)[0]  # a tie keeps F.linear
    assert not dispatch.probe_prepack_fp32(lambda packed: 1.5 if packed else 1.0)[0]  # MKL faster
    assert "F.linear 2.000 ms" in dispatch.probe_prepack_fp32(lambda packed: 1.0 if packed else 2.0)[1]


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """No pinned policy, an empty probe cache in tmp_path, and a record of which probes were asked."""
    monkeypatch.delenv(dispatch.POLICY_ENV, raising=False)
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    dispatch._cached_probes.cache_clear()
    asked = []

    def fake_measured(name, probe):
        asked.append(name)
        return True

    monkeypatch.setattr(dispatch, "measured", fake_measured)
    yield asked
    dispatch._cached_probes.cache_clear()


@pytest.mark.parametrize("flags,probes", [
    (AVX512_NO_BF16, []),  # no native bf16: fp32 without measuring (emulated bf16 is many times slower)
    (ZEN4, ["auto_bf16"]), (SAPPHIRE_RAPIDS, ["auto_bf16"]), (GRAVITON3, ["auto_bf16"]), (None, ["auto_bf16"]),
])
def test_auto_dtype_asks_the_probe_only_where_bf16_may_win(fresh, monkeypatch, flags, probes):
    monkeypatch.setattr(dispatch, "cpu", lambda: Cpu("test", flags, "x86_64" if flags != GRAVITON3 else "aarch64"))
    dtype = dispatch.auto_dtype(torch.device("cpu"))
    assert fresh == probes
    assert dtype == (torch.bfloat16 if probes else torch.float32)


def test_probes_run_only_where_their_answer_matters(fresh, monkeypatch):
    monkeypatch.setattr(dispatch, "cpu", lambda: Cpu("test", ZEN4, "x86_64"))
    bf16 = dispatch.kernel_table(torch.device("cpu"), torch.bfloat16)
    # the VNNI GEMM's probe: a model's table (its dtype known) on a VNNI CPU whose build has the kernel
    vnni = ["quant_gemm_vnni"] if cpu_kernels.vnni_int8() else []
    assert fresh == vnni and bf16.prepack_bf16 and not bf16.prepack_fp32 and bf16.attention_kernel_bf16_all
    assert bf16.quant_gemm_vnni == bool(vnni)
    fp32 = dispatch.kernel_table(torch.device("cpu"), torch.float32)
    assert fresh == vnni + ["prepack_fp32"] + vnni and fp32.prepack_fp32 and not fp32.torch_int_bf16  # ours built
    monkeypatch.setattr(dispatch, "cpu", lambda: Cpu("test", AVX512_NO_BF16 - {"avx512_vnni"}, "x86_64"))
    fresh.clear()
    assert not dispatch.kernel_table(torch.device("cpu"), torch.bfloat16).quant_gemm_vnni and fresh == []
    amx = dispatch.KernelTable(attention_kernel_bf16_all=False)
    assert amx.attention_query_limit(torch.bfloat16) == 16 and bf16.attention_query_limit(torch.bfloat16) > 10**9


def test_policy_pins_entries_and_rejects_unknown_ones(fresh, monkeypatch):
    monkeypatch.setenv(dispatch.POLICY_ENV, "prepack_fp32=off,quant_gemm_vnni=off,dense_gemv_max_rows=4")
    table = dispatch.kernel_table(torch.device("cpu"), torch.float32, "quant_gemv_max_rows=32")
    assert fresh == []  # pinned: nothing measured
    assert (table.prepack_fp32, table.dense_gemv_max_rows, table.quant_gemv_max_rows) == (False, 4, 32)
    for bad in ("nonsense=1", "prepack_fp32", "prepack_fp32=maybe", "dense_gemv_max_rows=x"):
        with pytest.raises(ValueError):
            dispatch.parse_policy(bad)


def test_probe_results_are_cached_per_machine(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    dispatch._cached_probes.cache_clear()
    runs = []

    def probe():
        runs.append(1)
        return True, "measured something"

    try:
        assert dispatch.measured("prepack_fp32", probe) and dispatch.measured("prepack_fp32", probe)
        assert len(runs) == 1  # the second answer came from the cache
        saved = json.loads((tmp_path / "probes.json").read_text())
        entry = saved[dispatch._machine_key()]["prepack_fp32"]
        assert entry["value"] is True and entry["detail"] == "measured something"
        dispatch._cached_probes.cache_clear()  # a new process reads the file
        assert dispatch.measured("prepack_fp32", probe) and len(runs) == 1
    finally:
        dispatch._cached_probes.cache_clear()


def test_fp32_model_follows_the_pinned_packing():
    from pagedserve.engine.layers.linear import Linear
    from pagedserve.engine.models.loader import build_model, load_config

    cfg = load_config("random:tiny")
    for pack in (False, True):
        table = dispatch.kernel_table(torch.device("cpu"), torch.float32, f"prepack_fp32={'on' if pack else 'off'}")
        model = build_model("random:tiny", cfg, torch.float32, torch.device("cpu"), 64, table=table)
        linears = [m for m in model.modules() if isinstance(m, Linear)]
        assert all((m.packed is not None) == pack for m in linears)
        assert ("oneDNN" in linears[0].describe_routes()) == pack
