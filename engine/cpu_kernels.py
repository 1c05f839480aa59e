"""The project's C++ CPU kernels (engine/csrc/*.cpp), built once into one torch extension.

Compiled on first use with g++ -march=native (torch's cpp_extension + ninja) into a cache directory keyed by
everything the build depends on (sources and their location, headers, flags, torch's version and location, Python's
version, the CPU), so later starts load it at once and two environments never take turns rebuilding one directory.
If the build fails, `load()` logs a warning and returns False, and every layer keeps its PyTorch path; with
PAGEDSERVE_REQUIRE_KERNELS=1 (the test suite, CI) a failed build raises instead, so a broken kernel can never
pass as a skipped one.

Ops registered (torch.ops.pagedserve.*): paged_attention; dense_linear; int8_linear, int4_linear, int6_linear,
int8_gemm, int4_gemm, int6_gemm, their int8-code forms int8_int8_gemm, int4_int8_gemm, int6_int8_gemm (on AMX or
VNNI), amx_int8 and vnni_int8 (whether this build and CPU run them); rms_norm, add_rms_norm, rope_, silu_and_mul;
decode_layer.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import shutil
import sys
import time
from pathlib import Path

from .machine import cache_dir, cpu

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
# -fopenmp: at::parallel_for is a header template whose `#pragma omp parallel` is compiled into our own code;
# without it every kernel runs on one thread. libgomp.so.1 resolves to the copy torch already loaded.
CFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp"]
LDFLAGS = ["-fopenmp"]


class KernelBuildError(RuntimeError):
    """The C++ kernels did not build, and PAGEDSERVE_REQUIRE_KERNELS asked for them."""


def required() -> bool:
    return os.environ.get("PAGEDSERVE_REQUIRE_KERNELS", "") not in ("", "0")


def build_key() -> str:
    """A digest of everything the build reads: change any of it and the kernels are rebuilt, else reused."""
    import torch

    sources = sorted(CSRC.glob("*.cpp")) + sorted(CSRC.glob("*.h"))
    machine = cpu()
    parts = [p.name + "\0" + p.read_text() for p in sources]
    # torch's location and the sources': build.ninja names its include directories and source files, and ninja
    # rebuilds when that file changes (two checkouts of one commit would take turns rebuilding)
    # and the ninja torch runs (the first on PATH): two ninja versions read each other's .ninja_log as foreign and
    # rebuild everything, and an activated venv (pip's ninja) and `.venv/bin/python` (the system's) find different ones
    parts += [torch.__version__, os.path.dirname(torch.__file__), str(CSRC.resolve()), sys.version,
              os.path.realpath(shutil.which("ninja") or ""), *CFLAGS, *LDFLAGS, machine.model,
              " ".join(sorted(machine.flags or ()))]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def build_dir() -> Path:
    """Where this build lives: one directory per build key."""
    return cache_dir() / "extensions" / f"pagedserve_cpu_kernels_{build_key()}"


@functools.cache
def load() -> bool:
    """Build (or load the cached build of) the extension; False, with a logged warning, if it cannot."""
    build = build_dir()
    name = build.name
    fresh = not any(build.glob("*.so"))
    if fresh:
        logger.info("building the C++ CPU kernels (first start on this machine only, about a minute) in %s", build)
    t0 = time.perf_counter()
    try:
        from torch.utils.cpp_extension import load as build_extension

        build.mkdir(parents=True, exist_ok=True)
        # torch's own build lock is a file that a killed build (SIGKILL, SIGTERM, a container stopped during the
        # first start) leaves behind, and every later start would wait on it forever. An flock dies with its
        # holder: whoever holds it is the only builder, so a torch lock found then is stale.
        with open(build.with_suffix(".flock"), "w") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)
            (build / "lock").unlink(missing_ok=True)
            # copies: torch appends to the flag lists it is given, which would change build_key()
            build_extension(name=name, sources=[str(p) for p in sorted(CSRC.glob("*.cpp"))], extra_cflags=list(CFLAGS),
                            extra_ldflags=list(LDFLAGS), build_directory=str(build), is_python_module=False,
                            verbose=False)
    except Exception as e:  # no compiler, no ninja, a read-only cache...: slower, never wrong
        if required():
            raise KernelBuildError(f"the C++ CPU kernels did not build: {e}") from e
        msg = str(e).strip()
        logger.warning("could not build the C++ CPU kernels (%s: %s); using the PyTorch paths instead",
                       type(e).__name__, msg.splitlines()[-1] if msg else "")
        return False
    logger.info("C++ CPU kernels %s in %.1fs", "built" if fresh else "loaded", time.perf_counter() - t0)
    return True


def vnni_int8() -> bool:
    """Whether our kernels run the int8 GEMMs on AVX512-VNNI registers: they built, for a CPU with it."""
    import torch

    return load() and bool(torch.ops.pagedserve.vnni_int8())


def amx_int8() -> bool:
    """Whether our kernels run the AMX-INT8 GEMMs: they built, for a CPU with AMX, and the OS granted the tiles."""
    import torch

    return load() and bool(torch.ops.pagedserve.amx_int8())
