"""engine/machine.py: what the CPU is (parsed once from /proc/cpuinfo's format, or unknown) and where caches go."""

from __future__ import annotations

from pagedserve.engine import machine
from pagedserve.engine.machine import Cpu, cache_dir, parse_cpuinfo

ARM = "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd bf16 sve\n\nprocessor\t: 1\nFeatures\t: fp\n"


def test_only_the_first_processor_counts():
    two = "model name\t: A\nflags\t\t: sse2 avx2\n\nmodel name\t: B\nflags\t\t: sse2 amx_bf16\n"
    assert parse_cpuinfo(two) == ("A", frozenset({"sse2", "avx2"}))
    assert parse_cpuinfo(ARM) == ("", frozenset({"fp", "asimd", "bf16", "sve"}))
    assert parse_cpuinfo("") == ("", None)


def test_native_bf16_and_amx_by_architecture():
    assert Cpu("x", frozenset({"sse2", "avx512_bf16"}), "x86_64").native_bf16
    assert Cpu("x", frozenset({"sse2", "amx_bf16"}), "x86_64").amx
    assert not Cpu("x", frozenset({"sse2", "avx512f"}), "x86_64").native_bf16
    assert not Cpu("x", frozenset({"sse2", "bf16"}), "x86_64").native_bf16  # Arm's flag name means nothing on x86
    assert Cpu("a", frozenset({"fp", "bf16"}), "aarch64").native_bf16
    unknown = Cpu("?", None, "x86_64")
    assert not (unknown.native_bf16 or unknown.amx or unknown.is_x86)
    assert unknown.describe().endswith("| ?")


def test_an_unreadable_cpuinfo_is_an_unknown_cpu(tmp_path):
    c = machine.cpu.__wrapped__(str(tmp_path / "missing"))
    assert c.flags is None and c.model  # a name still: platform's, or "unknown CPU"
    real = tmp_path / "cpuinfo"
    real.write_text("model name\t: Test CPU\nflags\t\t: sse2\n")
    assert machine.cpu.__wrapped__(str(real)) == Cpu("Test CPU", frozenset({"sse2"}), c.arch)


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("PAGEDSERVE_CACHE_DIR")
    assert cache_dir() == tmp_path / "xdg" / "pagedserve"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "pagedserve"
