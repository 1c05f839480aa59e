"""What `pip install .` ships (setup.py, pyproject.toml): every module and asset of the tree, under pagedserve.*.
The installed wheel itself is served from another folder by .ci/run (docker/smoke.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# Each folder of the tree and the name it installs under
INSTALLED_AS = {"pagedserve": "pagedserve", "engine": "pagedserve/engine", "server": "pagedserve/server",
                "benchmarks": "pagedserve/benchmarks", "tools": "pagedserve/tools"}


def tree_files() -> set[str]:
    """Every file of the shipped folders as the wheel should name it; bytecode caches aside."""
    names = set()
    for folder, installed in INSTALLED_AS.items():
        for path, dirs, files in os.walk(REPO / folder):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            rel = Path(path).relative_to(REPO / folder)
            names |= {(Path(installed) / rel / f).as_posix() for f in files if not f.endswith(".pyc")}
    return names


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    # from a copy: setuptools writes a build/ folder into the source, whose stale files a later wheel would ship
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(REPO / name, src / name)
    for folder in INSTALLED_AS:
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", str(src), "-w", str(out)], check=True)
    (path,) = out.glob("pagedserve-*.whl")
    return zipfile.ZipFile(path)


def test_every_file_of_the_tree_is_in_the_wheel(wheel):
    shipped = set(wheel.namelist())
    missing = sorted(tree_files() - shipped)
    assert not missing, f"not in the wheel: {missing}"


def test_every_package_folder_has_an_init(wheel):
    """A folder of Python files without __init__.py would be a namespace package: left out of the wheel by setup.py
    and importable only from a checkout."""
    for folder in INSTALLED_AS:
        for path, dirs, files in os.walk(REPO / folder):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            if any(f.endswith(".py") for f in files):
                assert "__init__.py" in files, f"{path} has Python files but no __init__.py"


def test_the_wheel_has_the_command_and_nothing_outside_pagedserve(wheel):
    names = wheel.namelist()
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "pagedserve = pagedserve.server.cli:main" in wheel.read(entry_points).decode()
    assert all(n.startswith(("pagedserve/", "pagedserve-")) for n in names), "something generic in site-packages"
