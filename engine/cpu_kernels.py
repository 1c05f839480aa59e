"""The project's C++ CPU kernels (engine/csrc/*.cpp), built once into one torch extension.

Compiled on first use with g++ -march=native (torch's cpp_extension + ninja) into a persistent cache
directory keyed by the sources, torch version, flags and CPU model, so later starts load it at once.
If the build fails, `load()` logs a warning and returns False, and each caller keeps its PyTorch path.
Ops registered (torch.ops.pagedserve.*): paged_attention; dense_linear; int8_linear, int4_linear, int8_gemm, int4_gemm;
rms_norm, add_rms_norm, rope_, silu_and_mul.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCES = sorted(Path(__file__).with_name("csrc").glob("*.cpp"))
HEADERS = sorted(Path(__file__).with_name("csrc").glob("*.h"))  # in the cache key: a changed header rebuilds
# -fopenmp: at::parallel_for is a header template whose `#pragma omp parallel` is compiled into our own code;
# without it every kernel ran on one thread. libgomp.so.1 resolves to the copy torch already loaded.
CFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp"]
LDFLAGS = ["-fopenmp"]


def cache_dir() -> Path:
    root = os.environ.get("PAGEDSERVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pagedserve")
    return Path(root) / "extensions"


@functools.cache
def load() -> bool:
    """Build (or load the cached build of) the extension; False, with a logged warning, if it cannot."""
    import torch

    texts = [p.read_text() for p in SOURCES + HEADERS]
    # -march=native code is only valid on this CPU: the key covers the CPU model as well as the sources
    parts = [*texts, torch.__version__, *CFLAGS, *LDFLAGS, _cpu_model()]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    name = f"pagedserve_cpu_kernels_{key}"
    build = cache_dir() / name
    t0 = time.perf_counter()
    try:
        from torch.utils.cpp_extension import load as build_extension

        build.mkdir(parents=True, exist_ok=True)
        build_extension(name=name, sources=[str(p) for p in SOURCES], extra_cflags=CFLAGS,
                        extra_ldflags=LDFLAGS, build_directory=str(build), is_python_module=False, verbose=False)
    except Exception as e:  # no compiler, no ninja, a read-only cache...: slower, never wrong
        msg = str(e).strip()
        logger.warning("could not build the C++ CPU kernels (%s: %s); using the PyTorch paths instead",
                       type(e).__name__, msg.splitlines()[-1] if msg else "")
        return False
    logger.info("C++ CPU kernels ready in %.1fs (%s)", time.perf_counter() - t0, build)
    return True


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("model name", "flags"))), "")
    except OSError:
        return ""
