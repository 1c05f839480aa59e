"""A shared-memory all-reduce for tensor-parallel ranks on one host's CPUs.

Gloo sums over loopback sockets, and a decode step makes two such calls per layer: through shared memory the same
sum costs a small fraction of that (benchmarks/tensor_parallel.py; figures in docs/tensor_parallel.md). vLLM's and
SGLang's CPU paths carry one too.

One segment in /dev/shm: a header (per rank, on its own cache line: the sequence number of its last published call
and its pid), then two sets of slots, one slot per rank each, alternating by call parity. A call copies x into this
rank's slot, publishes the call's sequence number, waits until every rank's number reaches it, then sums the slots
into x in rank order. Every rank does the same adds in the same order, so every rank holds bit-identical sums: the
replicated ops after the all-reduce (norms, residuals) then agree across ranks, as they do after gloo's.

Why two slot sets: a rank may start call k+1 (writing the other parity) while a slower peer still reads call k's
slots; it cannot reach call k+2, which reuses call k's slots, before every peer has published k+1, i.e. finished
reading call k.

Memory order: the data is stored (a torch copy) before the sequence number (a numpy store), and a reader loads the
numbers before the data. Both are separate C calls, which the compiler cannot reorder, and x86-64 (TSO) keeps
stores in program order and loads in program order, so a peer that sees the new number sees the data. Weaker
orders (arm64) would need fences, which Python cannot issue: there `supported()` says no and gloo stays.

The segment's name is unlinked as soon as every rank has mapped it (`TensorParallel.connect`): from then on no
rank's death, not even rank 0's SIGKILL, can leave a file behind in /dev/shm.
"""

from __future__ import annotations

import mmap
import os
import platform
import secrets
import sys
import time
from multiprocessing import resource_tracker

import numpy as np
import torch

SHM_DIR = "/dev/shm"
PREFIX = "pagedserve-tp-"
# Per slot: a decode step's activations up to [128, 4096] fp32. Larger ones (prefill chunks) take gloo, whose
# per-call latency is small beside their compute. Two parities x ranks slots: 8 MiB for 2 ranks (Docker's default
# /dev/shm is 64 MiB).
SLOT_BYTES = 2 << 20
LINE = 64  # bytes: one cache line per rank's header entry, so publishing does not invalidate a peer's line
SPINS = 200  # pure spins before each wait starts yielding the core (ranks may share cores)
CHECK_PEERS_S = 0.1  # how often a long wait checks that the ranks it waits for are still alive


class PeerDiedError(RuntimeError):
    """A rank this all-reduce waits for has died (or the wait timed out)."""


def supported() -> bool:
    """Linux /dev/shm on x86-64 (see the module docstring on memory order)."""
    return sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64") and os.path.isdir(SHM_DIR)


def create_segment(size: int, slot_bytes: int = SLOT_BYTES) -> str:
    """Make a zeroed segment for `size` ranks; returns its name for `ShmAllReduce(name, ...)`. The pages are allocated
    now (posix_fallocate): a full /dev/shm raises OSError here instead of a SIGBUS on first touch. Until this process
    unlinks it, multiprocessing's resource tracker holds the name too: if this process is killed during start-up
    (before every rank has mapped the segment), the tracker unlinks it once this process and its children are gone."""
    name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, size * LINE + 2 * size * slot_bytes)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    resource_tracker.register("/" + name, "shared_memory")
    return name


def unlink_segment(name: str) -> None:
    """Remove the segment's name (mappings stay valid until their processes drop them); by the process that created
    it. Idempotent."""
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        return
    resource_tracker.unregister("/" + name, "shared_memory")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a killed child of ours stays a zombie until its parent reaps it: dead all the same
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return True  # no /proc: os.kill's answer stands


class ShmAllReduce:
    """Rank `rank`'s mapping of segment `name` (from `create_segment`): `__call__(x)` sums x over the ranks, in
    place. A wait longer than `timeout_s`, or for a rank whose process has died, raises PeerDiedError."""

    def __init__(self, name: str, rank: int, size: int, timeout_s: float) -> None:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
        try:
            total = os.fstat(fd).st_size
            self._map = mmap.mmap(fd, total)  # kept for the process's life: torch views its buffer
        finally:
            os.close(fd)
        self.name, self.rank, self.size, self.timeout_s = name, rank, size, timeout_s
        header = size * LINE
        self.slot_bytes = (total - header) // (2 * size)
        words = np.frombuffer(self._map, dtype=np.int64, count=header // 8)
        self._seqs = words[0::LINE // 8]  # rank r's last published call
        self._pids = words[1::LINE // 8]
        self._slots = torch.frombuffer(self._map, dtype=torch.uint8, offset=header,
                                       count=2 * size * self.slot_bytes).view(2, size, self.slot_bytes)
        self._pids[rank] = os.getpid()
        self._seq = 0

    def fits(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.is_contiguous() and x.numel() * x.element_size() <= self.slot_bytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self._seq += 1
        seq = self._seq
        nbytes = x.numel() * x.element_size()
        slots = self._slots[seq & 1, :, :nbytes]
        flat = x.view(-1)
        slots[self.rank].view(x.dtype).copy_(flat)
        self._seqs[self.rank] = seq  # after the data: see the module docstring on memory order
        self._wait(seq)
        if self.rank:
            flat.copy_(slots[0].view(x.dtype))
        for r in range(1, self.size):  # rank order on every rank: bit-identical sums
            flat.add_(slots[r].view(x.dtype))
        return x

    def _wait(self, seq: int) -> None:
        seqs = self._seqs
        for _ in range(SPINS):
            if seqs.min() >= seq:
                return
        start = time.monotonic()
        check = start + CHECK_PEERS_S
        while seqs.min() < seq:
            os.sched_yield()
            now = time.monotonic()
            if now >= check:
                self._check_peers(seq)
                if now - start > self.timeout_s:
                    late = [r for r in range(self.size) if seqs[r] < seq]
                    raise PeerDiedError(f"shared-memory all-reduce: tensor-parallel ranks {late} did not arrive "
                                        f"within {self.timeout_s:.0f} s")
                check = now + CHECK_PEERS_S

    def _check_peers(self, seq: int) -> None:
        for r in range(self.size):
            pid = int(self._pids[r])
            if self._seqs[r] < seq and pid and not _alive(pid):
                raise PeerDiedError(f"tensor-parallel rank {r} (pid {pid}) died during a shared-memory all-reduce")

    def __repr__(self) -> str:
        return f"ShmAllReduce({self.name!r}, rank={self.rank}, size={self.size}, slot_bytes={self.slot_bytes})"
