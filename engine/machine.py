"""What machine this is: the CPU's model and feature flags (read once), and where pagedserve keeps its caches.

Every choice that depends on the CPU (the dtype `auto` means, which kernels are built and picked) reads these
facts from here, so /proc/cpuinfo is parsed in one place.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # x86; aarch64 lists "bf16" among its Features
# the flags that decide a fast path somewhere, printed with every benchmark table
REPORTED_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile")


@dataclass(frozen=True)
class Cpu:
    """`flags` is None where they cannot be read (not Linux)."""

    model: str
    flags: frozenset[str] | None
    arch: str

    @property
    def is_x86(self) -> bool:
        return self.flags is not None and ("sse2" in self.flags or "avx2" in self.flags)

    @property
    def native_bf16(self) -> bool:
        """bf16 matmuls in hardware (AVX512-BF16 or AMX on x86, the bf16 feature on Arm)."""
        if self.flags is None:
            return False
        if self.is_x86:
            return any(f in self.flags for f in NATIVE_BF16_FLAGS)
        return "bf16" in self.flags

    @property
    def amx(self) -> bool:
        return self.flags is not None and "amx_bf16" in self.flags

    def describe(self) -> str:
        """One line: model, core count, and the flags that pick fast paths (present, or `no-...`)."""
        have = self.flags or frozenset()
        flags = " ".join(f if f in have else f"no-{f}" for f in REPORTED_FLAGS) if self.flags is not None else "?"
        return f"{self.model} ({self.arch}, {os.cpu_count()} CPUs) | {flags}"


def parse_cpuinfo(text: str) -> tuple[str, frozenset[str] | None]:
    """The first CPU's model name and flags in /proc/cpuinfo's format."""
    model, flags = "", None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key in ("flags", "Features") and flags is None:
            flags = frozenset(value.split())
        elif not line.strip() and (model or flags is not None):
            break  # the first processor's block is enough
    return model, flags


@functools.cache
def cpu(path: str = "/proc/cpuinfo") -> Cpu:
    try:
        with open(path) as f:
            model, flags = parse_cpuinfo(f.read())
    except OSError:
        model, flags = "", None
    return Cpu(model or platform.processor() or "unknown CPU", flags, platform.machine())


def cache_dir() -> Path:
    """`$PAGEDSERVE_CACHE_DIR`, else `$XDG_CACHE_HOME/pagedserve`, else ~/.cache/pagedserve."""
    root = os.environ.get("PAGEDSERVE_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")) / "pagedserve"
