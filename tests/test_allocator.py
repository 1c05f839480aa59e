"""engine.allocator: nothing on import; huge pages and freed blocks kept once an engine is built."""

import os
import platform
import subprocess
import sys

import pytest

from pagedserve.engine import allocator

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_tune_sets_huge_pages_unless_the_user_chose(monkeypatch):
    from pagedserve.engine import allocator

    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    allocator.use_huge_pages()
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "1"
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    allocator.use_huge_pages()
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "0"


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt thresholds are glibc's")
def test_glibc_takes_the_thresholds():
    from pagedserve.engine import allocator

    assert allocator._keep_freed_blocks()


def test_importing_the_engine_changes_nothing():
    """`import pagedserve` (its engine and allocator modules too) sets no variable, loads no torch extension, imports
    no torch."""
    code = ("import os, sys; before = dict(os.environ); "
            "import pagedserve, pagedserve.engine, pagedserve.engine.allocator; "
            "assert dict(os.environ) == before, 'environment changed'; "
            "assert 'torch' not in sys.modules, 'torch imported'; print('ok')")
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr


def _run(code: str, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    out = subprocess.run([sys.executable, "-c", code, *args], cwd="/", env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.split()[-1] + "\n" + out.stderr


MADVISE = pytest.mark.skipif(allocator.thp_mode() != "madvise",
                             reason="needs transparent huge pages in madvise mode to tell")


@MADVISE
def test_no_module_makes_a_tensor_on_import():
    """torch fixes its huge-page setting at the process's first tensor: after importing every engine and server
    module, `tune` must still be in time, so the weights an engine loads next sit on 2 MiB pages."""
    from test_imports import RAY_MODULES, _modules

    mods = sorted(m for m in _modules() if m.startswith(("pagedserve.engine", "pagedserve.server"))
                  and m not in ("pagedserve.server.__main__", *RAY_MODULES))
    code = ("import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
            "from pagedserve.engine import allocator\nimport torch\nallocator.tune()\n"
            "x = torch.ones(64 << 20, dtype=torch.uint8)\n"
            "rollup = dict(l.split(':', 1) for l in open('/proc/self/smaps_rollup') if ':' in l)\n"
            "print(allocator.torch_huge_pages() and int(rollup['AnonHugePages'].split()[0]) >> 10 >= 32)")
    out = _run(code, *mods)
    assert out.startswith("True"), "a module made a tensor on import: huge pages came too late\n" + out


@MADVISE
def test_a_tensor_before_the_engine_is_reported():
    """A process that made a tensor first keeps 4 KiB pages; `tune` says so in the log, once."""
    code = ("import logging, torch\nlogging.basicConfig()\ntorch.zeros(1)\n"
            "from pagedserve.engine import allocator\nallocator.tune()\nallocator.tune()\n"
            "print(allocator.torch_huge_pages())")
    out = _run(code)
    assert out.startswith("False") and out.count("THP_MEM_ALLOC_ENABLE=1") == 1, out
