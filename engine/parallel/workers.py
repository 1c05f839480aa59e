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

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import socket
import struct
import time
import traceback
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from ..config import EngineConfig, ModelConfig, parse_cpu_bind, parse_dist_init_addr
from . import shm_all_reduce
from .group import CONNECT_TIMEOUT_S, TensorParallel

logger = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 30
READY_TIMEOUT_S = 1800.0  # loading a large checkpoint on every rank takes a while; a dead worker ends the wait early
CLOSE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Setup:
    """Rank 0's engine options: a rank of rank 0's node gets them at its spawn, one of another node once it has
    connected (its own options are only for binding its CPUs and finding its copy of the model)."""

    config: EngineConfig
    dtype: torch.dtype
    max_len: int
    model_config: ModelConfig  # the other node must hold the same model (its path may differ)


class WorkerFailedError(RuntimeError):
    """A tensor-parallel worker rank died or failed: the engine cannot run another step."""


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to build its shard (picklable: it crosses the spawn)."""

    config: EngineConfig  # this node's: its --cpu-bind, its ranks
    model_path: str
    rank: int
    host: str
    port: int
    device: torch.device
    shm_name: str | None  # the shared-memory all-reduce's segment (None: gloo only)
    setup: Setup | None  # None: another node's rank, which receives rank 0's once connected


def pin(config: EngineConfig, rank: int) -> None:
    """This process, rank `rank`, on its CPUs in --cpu-bind (where given) with one intra-op thread per CPU; unbound,
    with an even share of this node's cores."""
    per_node = config.tensor_parallel_size // config.nnodes
    cpus = parse_cpu_bind(config.cpu_bind, per_node)[rank % per_node] if config.cpu_bind else None
    if cpus is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(len(cpus) if cpus else max(1, cores // per_node))


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """One GPU per rank on a CUDA host (cuda:<the rank's index on its node>); every rank on the CPU otherwise."""
    return torch.device("cuda", local_rank) if device.type == "cuda" else device


def _authkey() -> bytes:
    """The step channel's HMAC key: it keeps strangers from feeding pickles to a rank. Set the same
    PAGEDSERVE_DIST_KEY on every node where the network is not trusted (gloo's own sockets are not authenticated)."""
    return os.environ.get("PAGEDSERVE_DIST_KEY", "pagedserve").encode()


def _dial(host: str, port: int, rank: int, size: int) -> Connection:
    """A remote rank's step channel: connect to rank 0 (retrying while it is not up yet), authenticate both ways,
    and say which rank this is."""
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=10)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    sock.settimeout(None)
    conn = multiprocessing.connection.Connection(sock.detach())
    multiprocessing.connection.answer_challenge(conn, _authkey())
    multiprocessing.connection.deliver_challenge(conn, _authkey())
    conn.send(("hello", rank, size))
    return conn


def _accept(host: str, port: int, ranks: range, size: int) -> dict[int, Connection]:
    """Rank 0's side of `_dial`: one connection from each remote rank in `ranks`, by rank."""
    conns: dict = {}
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    with socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET) as server:
        while len(conns) < len(ranks):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"tensor-parallel ranks {sorted(set(ranks) - set(conns))} did not connect to "
                                   f"{host}:{port} within {CONNECT_TIMEOUT_S:.0f} s: start them with --node-rank")
            server.settimeout(left)
            try:
                sock, _ = server.accept()
            except TimeoutError:
                continue
            sock.setblocking(True)  # Connection reads the fd directly: it must block
            _receive_timeout(sock, HANDSHAKE_TIMEOUT_S)  # a stranger that stalls the handshake cannot hold start-up
            conn = multiprocessing.connection.Connection(sock.detach())
            try:
                multiprocessing.connection.deliver_challenge(conn, _authkey())
                multiprocessing.connection.answer_challenge(conn, _authkey())
                kind, rank, their_size = conn.recv()
                if kind != "hello" or their_size != size or rank not in ranks or rank in conns:
                    raise ValueError(f"rank {rank} of tensor_parallel_size={their_size}, expected ranks {ranks[0]}.."
                                     f"{ranks[-1]} of {size} (are --tensor-parallel-size and --nnodes the same on "
                                     "every node?)")
            except (OSError, EOFError, ValueError, pickle.UnpicklingError,
                    multiprocessing.AuthenticationError) as e:
                logger.warning("tensor parallel: refused a step-channel connection: %r", e)
                conn.close()
                continue
            with socket.socket(fileno=os.dup(conn.fileno())) as dup:  # the same socket: options are shared
                _receive_timeout(dup, 0)  # and from now on waiting indefinitely is right: an idle engine
            conns[rank] = conn
    return conns


def _receive_timeout(sock: socket.socket, seconds: int) -> None:
    """SO_RCVTIMEO (0: none), which a blocking read of the raw fd honours, unlike socket.settimeout."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", seconds, 0))


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def worker_main(spec: WorkerSpec, conn: multiprocessing.connection.Connection | None) -> None:
    """A worker rank: join the group, build this rank's shard, then run steps until rank 0 says stop or is gone.
    `conn`: the pipe from rank 0 on its node; None for a remote rank, which dials rank 0 itself."""
    try:
        pin(spec.config, spec.rank)  # by this node's --cpu-bind
        setup, size = spec.setup, spec.config.tensor_parallel_size
        if conn is None:  # another node's rank: rank 0's engine options win, so every rank agrees on every shape
            conn = _dial(spec.host, spec.port + 1, spec.rank, size)
            setup = conn.recv()
        from .. import allocator
        from ..model_runner import build_runner
        from ..models.loader import load_config

        allocator.tune()
        tp = TensorParallel.connect(spec.rank, size, spec.host, spec.port, spec.device, shm_name=spec.shm_name)
        cfg = load_config(spec.model_path)
        if cfg != setup.model_config:
            raise ValueError(f"this node's model ({spec.model_path}: {cfg}) is not node 0's ({setup.model_config})")
        runner = build_runner(setup.config, spec.model_path, cfg, spec.device, setup.dtype, setup.max_len, tp=tp,
                              before_runner=lambda: conn.send(("ready", None)))
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):  # rank 0 closed the channel (close()), or it died
                break
            runner.execute(message)
    except BaseException:  # noqa: BLE001 - reported to rank 0, then this rank ends
        text = traceback.format_exc()
        logger.error("tensor-parallel rank %d failed:\n%s", spec.rank, text)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.send(("error", text))
        os._exit(1)  # no interpreter teardown: a broken process group may block in its destructor
    os._exit(0)


class WorkerGroup:
    """Rank 0's side: the worker ranks, one channel each (`conns[i]` is rank i + 1's): a pipe to a process of this
    node (`procs[i]`), or a TCP connection from a rank on another node (`procs[i]` is None)."""

    def __init__(self, shm_name: str | None, per_node: int) -> None:
        self.procs: list = []
        self.conns: list[Connection] = []
        self.per_node = per_node
        self.error: WorkerFailedError | None = None  # set once a worker is found dead; every later call raises it
        self._finalizer = weakref.finalize(self, _shut_down, self.procs, self.conns, shm_name)

    @classmethod
    def start(cls, setup: Setup, model_path: str, device: torch.device) -> tuple[WorkerGroup, TensorParallel]:
        """Spawn this node's ranks 1..L-1, take the other nodes' ranks' connections (L = ranks per node), pin
        rank 0 (this process), join the group as rank 0."""
        config = setup.config
        size, nnodes = config.tensor_parallel_size, config.nnodes
        per_node = size // nnodes
        host, port = parse_dist_init_addr(config.dist_init_addr) if nnodes > 1 else ("127.0.0.1", free_port())
        shm_name = _shm_segment(size, device) if nnodes == 1 else None  # shared memory spans one host only
        group = cls(shm_name, per_node)  # first: its finalizer stops what has started if anything fails
        try:
            group.procs += spawn_ranks(config, model_path, device, range(1, per_node), host, port, shm_name, setup,
                                       group.conns)
            if nnodes > 1:
                remote = _accept(host, port + 1, range(per_node, size), size)
                for conn in remote.values():
                    conn.send(setup)
                group.procs += [None] * len(remote)
                group.conns += [remote[r] for r in range(per_node, size)]
            pin(config, 0)
            tp = TensorParallel.connect(0, size, host, port, rank_device(device, 0), shm_name=shm_name,
                                        watch=lambda: group.check(wait_s=0.2))
        except BaseException:
            group.close()
            raise
        logger.info("tensor parallel: %d ranks on %d node(s) (this node's workers: pids %s), %s", size, nnodes,
                    [p.pid for p in group.procs if p is not None],
                    "nccl" if device.type == "cuda" else "shared-memory all-reduce + gloo" if shm_name else "gloo")
        return group, tp

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Until every worker has built its shard; raises WorkerFailedError if one fails or dies first."""
        pending = {conn: i for i, conn in enumerate(self.conns)}
        deadline = time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._fail(f"tensor-parallel ranks {[i + 1 for i in pending.values()]} not ready after "
                                 f"{timeout:.0f} s")
            for conn in multiprocessing.connection.wait(list(pending), left):  # a dead worker's channel: EOF
                try:
                    kind, text = conn.recv()
                except (EOFError, OSError):
                    kind, text = "died", None
                if kind != "ready":
                    raise self._fail(self._describe(pending[conn], text))
                del pending[conn]

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

    def check(self, cause: BaseException | None = None, wait_s: float = 0.0) -> None:
        """Raise WorkerFailedError if a worker has failed or died, waiting up to `wait_s` for one to (cheap: one
        wait on every channel). A healthy worker sends nothing after "ready": a readable channel is its error
        report or its EOF (a process's pipe closes when it dies)."""
        if self.error is None:
            try:
                failed = multiprocessing.connection.wait(self.conns, wait_s)
            except OSError:  # a closed channel: the group was stopped
                failed = self.conns
            if failed:
                self._fail(self._describe(self.conns.index(failed[0])))
        if self.error is not None:
            raise self.error from cause

    def raise_failure(self, cause: BaseException, grace_s: float = 5.0) -> None:
        """After a step failed with `cause`: raise WorkerFailedError naming the dead rank if a worker died (it may
        take a moment to exit after its collective failed), else one saying that every worker is alive."""
        self.check(cause, grace_s)
        raise self._fail(f"a tensor-parallel collective failed with every worker alive: {cause}") from cause

    def _describe(self, i: int, text: str | None = None) -> str:
        proc, conn = self.procs[i], self.conns[i]
        if text is None:
            with contextlib.suppress(EOFError, OSError):
                if conn.poll(0.5):
                    kind, text = conn.recv()
        last = f": {text.strip().splitlines()[-1]}" if text else ""
        if proc is None:
            how = "failed" if text else "closed its connection (died, or its node stopped)"
            return f"tensor-parallel rank {i + 1} (node {(i + 1) // self.per_node}) {how}{last}"
        proc.join(timeout=1.0)
        code = proc.exitcode
        how = ("is hung" if code is None else f"was killed by signal {-code}" if code < 0 else
               f"exited with code {code}")
        return f"tensor-parallel rank {i + 1} (pid {proc.pid}) {how}{last}"

    def _fail(self, message: str) -> WorkerFailedError:
        self.error = WorkerFailedError(message + "; the engine has stopped")
        logger.error("%s", self.error)
        self.close()
        return self.error

    def close(self) -> None:
        """Stop every worker (its channel closed first, then terminated, then killed)."""
        self._finalizer()


def spawn_ranks(config: EngineConfig, model_path: str, device: torch.device, ranks: range, host: str, port: int,
                shm_name: str | None, setup: Setup | None, conns: list | None) -> list:
    """Start worker processes for `ranks` of this node. `conns` (node 0): a pipe to each is appended there; None
    (another node): each dials rank 0 at host:port + 1 itself."""
    per_node = config.tensor_parallel_size // config.nnodes
    ctx = multiprocessing.get_context("spawn")
    procs = []
    for rank in ranks:
        spec = WorkerSpec(config, model_path, rank, host, port, rank_device(device, rank % per_node), shm_name, setup)
        child = None
        if conns is not None:
            parent, child = ctx.Pipe()
            conns.append(parent)
        proc = ctx.Process(target=worker_main, args=(spec, child), name=f"pagedserve-tp{rank}", daemon=True)
        proc.start()
        if child is not None:
            child.close()
        procs.append(proc)
    return procs


def run_node(config: EngineConfig, model_path: str) -> int:
    """`pagedserve serve --node-rank k` (k > 0): run this node's worker ranks until node 0 stops (they connect to
    it, then take its steps); no server here. Returns the exit status: 0 when every rank ended cleanly."""
    host, port = parse_dist_init_addr(config.dist_init_addr)
    per_node = config.tensor_parallel_size // config.nnodes
    first = config.node_rank * per_node
    procs = spawn_ranks(config, model_path, config.torch_device(), range(first, first + per_node), host, port, None,
                        None, None)
    logger.info("node %d: tensor-parallel ranks %d..%d (pids %s), rank 0 at %s:%d", config.node_rank, first,
                first + per_node - 1, [p.pid for p in procs], host, port)
    try:
        for proc in procs:
            proc.join()
    finally:  # interrupted: take the ranks down with this process
        _stop(procs, 0.0)
    return max((abs(p.exitcode or 0) for p in procs), default=0)


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
    for conn in conns:  # each worker, here or on another node, reads EOF and exits
        conn.close()
    _stop([p for p in procs if p is not None], CLOSE_TIMEOUT_S)


def _stop(procs: list, grace_s: float) -> None:
    """Join the processes within `grace_s` in all; then terminate, then kill, each one still alive."""
    deadline = time.monotonic() + grace_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        for stop in (proc.terminate, proc.kill):
            if proc.is_alive():
                stop()
                proc.join(1.0)
