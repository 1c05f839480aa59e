"""The package list, derived from the tree: every folder with an __init__.py under engine/, server/, benchmarks/ and
tools/ installs as pagedserve.<folder>.<subfolder>..., so a new subpackage cannot be left out of the wheel. The rest
of the metadata is in pyproject.toml."""

import os

from setuptools import setup

# The folders stay at the top of the repository and install under one name (pagedserve.engine, ...): nothing
# generic lands in site-packages.
ROOTS = {"pagedserve": "pagedserve", "pagedserve.engine": "engine", "pagedserve.server": "server",
         "pagedserve.benchmarks": "benchmarks", "pagedserve.tools": "tools"}


def packages() -> list[str]:
    found = []
    for name, folder in ROOTS.items():
        for path, dirs, files in os.walk(folder):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            if "__init__.py" in files:
                found.append(name + path[len(folder):].replace(os.sep, "."))
    return found


setup(packages=packages(), package_dir=ROOTS)
