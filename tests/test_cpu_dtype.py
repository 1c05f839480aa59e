"""dtype=auto on CPUs: bf16 only with native hardware support and a measured win (flags and timings injected)."""

import torch

from engine.cpu_dtype import choose_cpu_dtype, choose_fp32_packing, has_native_bf16, read_cpu_flags, time_gemm

AVX512_NO_BF16 = frozenset("fpu sse2 avx2 fma avx512f avx512bw avx512vl avx512_vnni".split())
SAPPHIRE_RAPIDS = AVX512_NO_BF16 | {"avx512_bf16", "amx_tile", "amx_bf16"}
GRAVITON3 = frozenset("fp asimd sve bf16 i8mm".split())


def timer(fp32_ms, bf16_ms):
    calls = []

    def t(dtype):
        calls.append(dtype)
        return fp32_ms if dtype == torch.float32 else bf16_ms

    return t, calls


def test_avx512_without_bf16_picks_fp32_without_measuring():
    t, calls = timer(1.0, 0.1)  # even a (bogus) fast bf16 timing is not consulted
    choice = choose_cpu_dtype(AVX512_NO_BF16, t)
    assert choice.dtype == torch.float32 and "AVX512_BF16" in choice.reason
    assert calls == []


def test_native_bf16_picks_bf16_when_measured_faster():
    t, calls = timer(0.7, 0.19)
    choice = choose_cpu_dtype(SAPPHIRE_RAPIDS, t)
    assert choice.dtype == torch.bfloat16 and "3.7x" in choice.reason
    assert set(calls) == {torch.float32, torch.bfloat16}


def test_native_bf16_flags_but_slower_gemm_keeps_fp32():
    for bf16_ms in (0.7, 0.65, 2.0):  # a tie or a loss keeps fp32
        t, _ = timer(0.7, bf16_ms)
        assert choose_cpu_dtype(SAPPHIRE_RAPIDS, t).dtype == torch.float32


def test_unknown_or_arm_flags_decide_by_timing():
    for flags in (None, GRAVITON3, frozenset("fp asimd".split())):
        assert choose_cpu_dtype(flags, timer(1.0, 0.5)[0]).dtype == torch.bfloat16
        assert choose_cpu_dtype(flags, timer(1.0, 1.2)[0]).dtype == torch.float32


def test_flag_parsing(tmp_path):
    assert has_native_bf16(SAPPHIRE_RAPIDS) and not has_native_bf16(AVX512_NO_BF16)
    assert has_native_bf16(GRAVITON3)
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx512f avx512_bf16\n\nprocessor\t: 1\nflags\t: fpu\n")
    assert read_cpu_flags(str(info)) == frozenset({"fpu", "sse2", "avx512f", "avx512_bf16"})
    assert read_cpu_flags(str(tmp_path / "missing")) is None


def test_real_probe_runs():
    assert time_gemm(torch.float32, (8, 32, 32), reps=3) > 0
    assert time_gemm(torch.float32, (8, 32, 32), reps=3, packed=True) > 0


def test_fp32_packing_only_where_measured_faster():
    assert choose_fp32_packing(lambda packed: 1.0 if packed else 2.0)[0]  # oneDNN 2x faster (Zen 4's MKL)
    assert not choose_fp32_packing(lambda packed: 1.0 if packed else 1.05)[0]  # a tie keeps F.linear
    assert not choose_fp32_packing(lambda packed: 1.5 if packed else 1.0)[0]  # MKL faster (Intel)
    assert "F.linear 2.000 ms" in choose_fp32_packing(lambda packed: 1.0 if packed else 2.0)[1]


def test_fp32_model_follows_the_packing_probe(monkeypatch):
    import engine.config as config
    from engine.models.llama import Linear
    from engine.models.loader import build_model, load_config

    for pack in (False, True):
        monkeypatch.setattr(config, "cpu_packs_fp32", lambda pack=pack: pack)
        cfg = load_config("random:tiny")
        model = build_model("random:tiny", cfg, torch.float32, torch.device("cpu"), 64)
        linears = [m for m in model.modules() if isinstance(m, Linear)]
        assert all((m.packed is not None) == pack for m in linears)
        x = torch.randn(5, cfg.hidden_size)
        ref = torch.nn.functional.linear(x, linears[0].weight) if linears[0].weight.numel() else None
        if ref is not None:  # the packed path computes the same product (other roundings)
            assert torch.allclose(linears[0](x), ref, rtol=1e-5, atol=1e-5)
