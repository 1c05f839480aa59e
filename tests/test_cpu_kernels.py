"""engine/cpu_kernels.py without compiling anything: the build key names everything a build reads (so a change
rebuilds and nothing else does), and a failed build is a warning and the PyTorch paths, or an error when required."""

from __future__ import annotations

import logging
import shutil

import pytest

from pagedserve.engine import cpu_kernels
from pagedserve.engine.machine import Cpu


@pytest.fixture
def sources(tmp_path, monkeypatch):
    """A copy of the kernel sources that the build key reads, and a pinned CPU."""
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    for p in sorted(cpu_kernels.CSRC.glob("*.cpp"))[:2] + sorted(cpu_kernels.CSRC.glob("*.h"))[:1]:
        shutil.copy(p, csrc / p.name)
    monkeypatch.setattr(cpu_kernels, "CSRC", csrc)
    monkeypatch.setattr(cpu_kernels, "cpu", lambda: Cpu("Test CPU", frozenset({"sse2", "avx2"}), "x86_64"))
    return csrc


def test_the_key_is_stable_and_changes_with_each_input(sources, monkeypatch):
    key = cpu_kernels.build_key()
    assert key == cpu_kernels.build_key() and len(key) == 16
    cpp = next(sources.glob("*.cpp"))
    keys = {key}

    def changed() -> str:
        k = cpu_kernels.build_key()
        assert k not in keys
        keys.add(k)
        return k

    cpp.write_text(cpp.read_text() + "\n// a comment is a change too\n")
    changed()
    (sources / "extra.h").write_text("#pragma once\n")  # a new header
    changed()
    monkeypatch.setattr(cpu_kernels, "CFLAGS", cpu_kernels.CFLAGS + ["-DX"])
    changed()
    monkeypatch.setattr(cpu_kernels, "cpu", lambda: Cpu("Test CPU", frozenset({"sse2", "avx2", "avx512f"}), "x86_64"))
    changed()
    monkeypatch.setattr(cpu_kernels, "cpu", lambda: Cpu("Other CPU", frozenset({"sse2", "avx2", "avx512f"}), "x86_64"))
    changed()
    (sources / "notes.txt").write_text("not read by the build")
    assert cpu_kernels.build_key() in keys and len(keys) == 6


def test_a_moved_checkout_is_another_build(sources, tmp_path, monkeypatch):
    key = cpu_kernels.build_key()
    moved = tmp_path / "elsewhere"
    shutil.copytree(sources, moved)
    monkeypatch.setattr(cpu_kernels, "CSRC", moved)
    assert cpu_kernels.build_key() != key  # same bytes, another location: build.ninja names its paths


def test_the_build_dir_is_under_the_cache_and_named_by_the_key(sources, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    assert cpu_kernels.build_dir() == tmp_path / "cache" / "extensions" / (
        "pagedserve_cpu_kernels_" + cpu_kernels.build_key())


def failing_build(monkeypatch, tmp_path):
    import torch.utils.cpp_extension

    def fail(**kwargs):
        raise RuntimeError("no compiler here\nerror: g++ not found")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", fail)
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))


def test_a_failed_build_is_a_warning_and_false(sources, tmp_path, monkeypatch, caplog):
    failing_build(monkeypatch, tmp_path)
    monkeypatch.setenv("PAGEDSERVE_REQUIRE_KERNELS", "0")
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        assert cpu_kernels.load.__wrapped__() is False
    assert "error: g++ not found" in caplog.text and "PyTorch paths" in caplog.text


def test_a_failed_build_raises_when_required(sources, tmp_path, monkeypatch):
    failing_build(monkeypatch, tmp_path)
    monkeypatch.setenv("PAGEDSERVE_REQUIRE_KERNELS", "1")
    with pytest.raises(cpu_kernels.KernelBuildError, match="no compiler here"):
        cpu_kernels.load.__wrapped__()
