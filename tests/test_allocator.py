"""engine.allocator: nothing on import; huge pages and freed blocks kept once an engine is built."""

import os
import platform
import subprocess
import sys

import pytest

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
