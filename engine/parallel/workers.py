"""Rank 0's handle on the tensor-parallel worker processes, and the loop each worker runs.

Rank 0 (the engine's own process) schedules, samples and owns the block tables; ranks 1..N-1 are processes it
spawns (as nano-vllm does). Each step rank 0 pickles a small `StepMessage` (the flat batch as host lists) once and
writes it down one pipe per worker; every rank then runs its shard of the forward, meeting at the all-reduces, and
a `LogitsMessage` names the rows whose vocabulary shards rank 0 gathers. The pipes, not a collective, carry the
step: an idle engine leaves the workers blocked in `recv`, with no collective timeout running, and a rank 0 that
dies closes them, so its workers see EOF and exit (no orphans).

Failure: a worker that raises reports its traceback down its pipe and exits; a killed one closes its sockets, so
rank 0's next collective fails at once (a hung one: after the group's timeout, `PAGEDSERVE_TP_TIMEOUT_S`). Either
way rank 0 raises `WorkerFailedError` naming the rank, and the engine stops (the server's /health says 503).
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import socket
import time
import traceback
import weakref
from dataclasses import dataclass

import torch

from pagedserve.engine.config import EngineConfig, parse_cpu_bind
from pagedserve.engine.parallel import shm_all_reduce
from pagedserve.engine.parallel.group import TensorParallel

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 1800.0  # loading a large checkpoint on every rank takes a while; a dead worker ends the wait early
CLOSE_TIMEOUT_S = 5.0


class WorkerFailedError(RuntimeError):
    """A tensor-parallel worker rank died or failed: the engine cannot run another step."""


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to build its shard (picklable: it crosses the spawn)."""

    config: EngineConfig
    model_path: str
    dtype: torch.dtype
    max_len: int
    rank: int
    size: int
    host: str
    port: int
    device: torch.device
    cpus: list[int] | None
    threads: int
    shm_name: str | None  # the shared-memory all-reduce's segment (None: gloo only)


def pin(cpus: list[int] | None, threads: int) -> None:
    """This process on `cpus` (where given) with `threads` intra-op threads."""
    if cpus is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)
    torch.set_num_threads(threads)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """One GPU per rank on a CUDA host (cuda:rank); every rank on the CPU otherwise."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def worker_main(spec: WorkerSpec, conn: multiprocessing.connection.Connection) -> None:
    """A worker rank: join the group, build this rank's shard, then run steps until rank 0 says stop or is gone."""
    try:
        pin(spec.cpus, spec.threads)
        from pagedserve.engine import allocator
        from pagedserve.engine.layers.dispatch import kernel_table
        from pagedserve.engine.model_runner import ModelRunner
        from pagedserve.engine.models.loader import build_model, load_config
        from pagedserve.engine.quant.loading import QuantSpec

        config = spec.config
        allocator.tune()
        tp = TensorParallel.connect(spec.rank, spec.size, spec.host, spec.port, spec.device, shm_name=spec.shm_name)
        cfg = load_config(spec.model_path)
        table = kernel_table(spec.device, spec.dtype, config.kernel_policy)
        quant = QuantSpec.from_options(config.quantization, config.quant_group_size, config.quantize_lm_head)
        torch.manual_seed(config.seed)
        model = build_model(spec.model_path, cfg, spec.dtype, spec.device, spec.max_len, config.seed, quant, table,
                            tp)
        conn.send(("ready", None))
        runner = ModelRunner(config, cfg, model, spec.device, spec.dtype, table, tp=tp)
        while True:
            try:
                data = conn.recv_bytes()
            except (EOFError, OSError):  # rank 0 is gone
                break
            message = pickle.loads(data)
            if message is None:
                break
            runner.execute(message)
    except BaseException:  # noqa: BLE001 - reported to rank 0, then this rank ends
        text = traceback.format_exc()
        logger.error("tensor-parallel rank %d failed:\n%s", spec.rank, text)
        try:
            conn.send(("error", text))
        except OSError:
            pass
        os._exit(1)  # no interpreter teardown: a broken process group may block in its destructor
    os._exit(0)


class WorkerGroup:
    """Rank 0's side: the worker processes, one pipe each."""

    def __init__(self, procs: list, conns: list, shm_name: str | None) -> None:
        self.procs, self.conns = procs, conns
        self.error: WorkerFailedError | None = None  # set once a worker is found dead; every later call raises it
        self._finalizer = weakref.finalize(self, _shut_down, procs, conns, shm_name)

    @classmethod
    def start(cls, config: EngineConfig, model_path: str, dtype: torch.dtype, max_len: int,
              device: torch.device) -> tuple[WorkerGroup, TensorParallel]:
        """Spawn ranks 1..N-1, pin rank 0 (this process), join the group as rank 0."""
        size = config.tensor_parallel_size
        binds = parse_cpu_bind(config.cpu_bind, size) if config.cpu_bind else [None] * size
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        host = "127.0.0.1"
        port = free_port(host)
        shm_name = _shm_segment(size, device)
        ctx = multiprocessing.get_context("spawn")
        group = cls([], [], shm_name)  # first: its finalizer stops what has started if anything below fails
        try:
            for rank in range(1, size):
                parent, child = ctx.Pipe()
                threads = len(binds[rank]) if binds[rank] else max(1, cores // size)
                spec = WorkerSpec(config, model_path, dtype, max_len, rank, size, host, port,
                                  rank_device(device, rank), binds[rank], threads, shm_name)
                proc = ctx.Process(target=worker_main, args=(spec, child), name=f"pagedserve-tp{rank}", daemon=True)
                proc.start()
                child.close()
                group.procs.append(proc)
                group.conns.append(parent)
            pin(binds[0], len(binds[0]) if binds[0] else max(1, cores // size))
            tp = TensorParallel.connect(0, size, host, port, rank_device(device, 0), shm_name=shm_name)
        except BaseException:
            group.close()
            raise
        logger.info("tensor parallel: %d ranks (workers: pids %s), %s", size, [p.pid for p in group.procs],
                    "nccl" if device.type == "cuda" else "shared-memory all-reduce + gloo" if shm_name else "gloo")
        return group, tp

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Until every worker has built its shard; raises WorkerFailedError if one fails or dies first."""
        pending = dict(enumerate(self.conns))
        deadline = time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._fail(f"tensor-parallel ranks {[i + 1 for i in pending]} not ready after {timeout:.0f} s")
            ready = multiprocessing.connection.wait(list(pending.values()) +
                                                    [self.procs[i].sentinel for i in pending], left)
            for i, conn in list(pending.items()):
                if conn in ready or self.procs[i].sentinel in ready:
                    try:
                        kind, text = conn.recv()
                    except (EOFError, OSError):
                        kind, text = "died", None
                    if kind != "ready":
                        raise self._fail(self._describe(i, text))
                    del pending[i]

    def send(self, message) -> None:
        """One message to every worker (pickled once)."""
        if self.error is not None:
            raise self.error
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for conn in self.conns:
                conn.send_bytes(data)
        except OSError as e:  # a worker's pipe closed: it died
            self.raise_failure(e)

    def check(self) -> None:
        """Raise WorkerFailedError if any worker has died (cheap: one non-blocking wait per worker)."""
        if self.error is not None:
            raise self.error
        for i, proc in enumerate(self.procs):
            if not proc.is_alive():
                raise self._fail(self._describe(i))

    def raise_failure(self, cause: BaseException, grace_s: float = 5.0) -> None:
        """After a step failed with `cause`: raise WorkerFailedError naming the dead rank if a worker died (it may
        take a moment to exit after its collective failed), else return and let the caller re-raise `cause`."""
        if self.error is not None:
            raise self.error from cause
        deadline = time.monotonic() + grace_s
        while True:
            for i, proc in enumerate(self.procs):
                if not proc.is_alive():
                    raise self._fail(self._describe(i)) from cause
            if time.monotonic() >= deadline:
                raise self._fail(f"a tensor-parallel collective failed with every worker alive: {cause}") from cause
            time.sleep(0.05)

    def _describe(self, i: int, text: str | None = None) -> str:
        proc, conn = self.procs[i], self.conns[i]
        if text is None:
            try:
                if conn.poll(0.5):
                    kind, text = conn.recv()
            except (EOFError, OSError):
                pass
        proc.join(timeout=1.0)
        code = proc.exitcode
        how = ("is hung" if code is None else f"was killed by signal {-code}" if code < 0 else
               f"exited with code {code}")
        last = f": {text.strip().splitlines()[-1]}" if text else ""
        return f"tensor-parallel rank {i + 1} (pid {proc.pid}) {how}{last}"

    def _fail(self, message: str) -> WorkerFailedError:
        self.error = WorkerFailedError(message + "; the engine has stopped")
        logger.error("%s", self.error)
        self.close()
        return self.error

    def close(self) -> None:
        """Stop every worker (asked first, then terminated, then killed)."""
        self._finalizer()


def _shm_segment(size: int, device: torch.device) -> str | None:
    """A shared-memory all-reduce segment where every rank is on this host's CPUs, it is supported, and
    PAGEDSERVE_TP_SHM is not 0 (the switch that benchmarks gloo against it); else None (gloo)."""
    if device.type != "cpu" or not shm_all_reduce.supported() or os.environ.get("PAGEDSERVE_TP_SHM", "1") == "0":
        return None
    try:
        return shm_all_reduce.create_segment(size)
    except OSError as e:  # e.g. a small /dev/shm: slower, not broken
        logger.warning("tensor parallel: no shared-memory all-reduce (%s); gloo only", e)
        return None


def _shut_down(procs: list, conns: list, shm_name: str | None) -> None:
    if shm_name is not None:  # normally unlinked once every rank mapped it; not if start-up failed before then
        shm_all_reduce.unlink_segment(shm_name)
    for conn in conns:
        try:
            conn.send_bytes(pickle.dumps(None))
        except OSError:
            pass
    deadline = time.monotonic() + CLOSE_TIMEOUT_S
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=1.0)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=1.0)
    for conn in conns:
        conn.close()
