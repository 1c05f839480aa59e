"""One rank's view of a tensor-parallel group: its collectives, and which heads, columns and vocabulary rows it holds.

The group is a torch.distributed process group made directly over a TCPStore (gloo on CPU, NCCL on CUDA), not
the process-wide default group: an engine owns its group, so two engines in one process (tests, benchmarks) do
not collide, and closing one leaves no global state behind. Ranks on one host's CPUs sum through shared memory
(`shm_all_reduce.py`): a decode step makes two all-reduces per layer of a small tensor (a hidden-size row per
sequence), where gloo's loopback sockets cost a system call and a copy through the kernel per message and shared
memory costs one copy in and one sum (figures in docs/tensor_parallel.md). Gloo still carries the gathers, the
non-sum reductions and tensors larger than a shared slot.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config import ModelConfig
from .shm_all_reduce import ShmAllReduce, unlink_segment

# A collective waits at most this long for a peer: the bound on detecting a hung (not dead) rank. A dead rank's
# sockets close, so its peers fail at once; this backstop covers a stopped or deadlocked one.
COLLECTIVE_TIMEOUT_S = float(os.environ.get("PAGEDSERVE_TP_TIMEOUT_S", "60"))
CONNECT_TIMEOUT_S = 300.0  # ranks of other nodes may be started a while after node 0 (or before it)


def check_tensor_parallel(cfg: ModelConfig, size: int) -> None:
    """Raise ValueError (one line) where `cfg` cannot be split `size` (>= 1) ways: Megatron splits whole heads."""
    if cfg.num_heads % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide the model's {cfg.num_heads} attention heads")
    if cfg.num_kv_heads % size and size % cfg.num_kv_heads:
        raise ValueError(f"tensor_parallel_size={size} neither divides nor is a multiple of the model's "
                         f"{cfg.num_kv_heads} KV heads")
    if cfg.intermediate_size % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide the MLP's {cfg.intermediate_size} columns")


@dataclass(frozen=True)
class Shares:
    """What one rank holds of a model: first index and count of its query heads, KV heads, MLP columns, vocab rows."""

    q_start: int
    q_heads: int
    kv_start: int
    kv_heads: int  # a KV head is replicated on size / num_kv_heads ranks where there are fewer than ranks
    mlp_start: int
    mlp_size: int
    vocab_start: int
    vocab_size: int  # the last rank's may be smaller (ceil split)


class TensorParallel:
    """Rank `rank` of `size`; collectives over `group` on `device`."""

    def __init__(self, rank: int, size: int, group, device: torch.device, shm: ShmAllReduce | None = None) -> None:
        self.rank, self.size, self.group, self.device = rank, size, group, device
        self.shm = shm  # sums the CPU tensors that fit its slots; gloo the rest

    @classmethod
    def connect(cls, rank: int, size: int, host: str, port: int, device: torch.device,
                shm_name: str | None = None, watch: Callable[[], None] | None = None) -> TensorParallel:
        """Join the group: rank 0 hosts the store at host:port, the others connect to it. `shm_name`: a segment
        from `shm_all_reduce.create_segment` that every rank (all on this host) maps for its all-reduces.
        `watch` (rank 0): waits a moment for a worker to fail, raising if one has; called until every rank has
        joined, so a worker that dies before joining ends the start-up at once, not after CONNECT_TIMEOUT_S."""
        store = dist.TCPStore(host, port, size, rank == 0, timeout=datetime.timedelta(seconds=CONNECT_TIMEOUT_S),
                              wait_for_workers=watch is None)
        if rank:
            store.add("joined", 1)
        elif watch is not None:
            deadline = time.monotonic() + CONNECT_TIMEOUT_S
            while store.add("joined", 0) < size - 1:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"tensor-parallel ranks did not join {host}:{port} within "
                                       f"{CONNECT_TIMEOUT_S:.0f} s")
                watch()
        timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        if device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            torch.cuda.set_device(device)
            group = dist.ProcessGroupNCCL(store, rank, size, opts)
        else:
            group = dist.ProcessGroupGloo(store, rank, size, timeout)
        tp = cls(rank, size, group, device)
        if shm_name is not None:
            shm = ShmAllReduce(shm_name, rank, size, COLLECTIVE_TIMEOUT_S)
            tp.all_reduce(torch.zeros(1, device=device))  # a barrier: every rank has mapped the segment...
            if rank == 0:
                unlink_segment(shm_name)  # ...so its name can go: nothing is left in /dev/shm whoever dies later
            tp.shm = shm
        return tp

    # ---- collectives -------------------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """Sum (or `op`) over ranks, in place; returns x."""
        if self.shm is not None and op == dist.ReduceOp.SUM and self.shm.fits(x):
            return self.shm(x)
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        self.group.allreduce([x], opts).wait()
        return x

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """Each rank's logits [R, its vocab rows] -> [R, vocab_size] on rank 0 (None on the others)."""
        per = -(-vocab_size // self.size)
        if logits.shape[1] < per:  # the last rank's short shard: padded, cut off again below
            logits = torch.nn.functional.pad(logits, (0, per - logits.shape[1]))
        logits = logits.contiguous()
        opts = dist.GatherOptions()
        opts.rootRank = 0
        if self.rank:
            self.group.gather([], [logits], opts).wait()
            return None
        parts = [torch.empty_like(logits) for _ in range(self.size)]
        self.group.gather([parts], [logits], opts).wait()
        return torch.cat(parts, dim=1)[:, :vocab_size]

    # ---- what this rank holds ----------------------------------------------------------------------------
    def shares(self, cfg: ModelConfig) -> Shares:
        r, n = self.rank, self.size
        q = cfg.num_heads // n
        if cfg.num_kv_heads >= n:
            kv = cfg.num_kv_heads // n
            kv_start = r * kv
        else:  # fewer KV heads than ranks: rank r's query heads all read KV head r // (n / num_kv_heads)
            kv, kv_start = 1, r // (n // cfg.num_kv_heads)
        mlp = cfg.intermediate_size // n
        per = -(-cfg.vocab_size // n)
        v0 = min(r * per, cfg.vocab_size)
        return Shares(r * q, q, kv_start, kv, r * mlp, mlp, v0, min(per, cfg.vocab_size - v0))

    def __repr__(self) -> str:
        return f"TensorParallel(rank={self.rank}, size={self.size}, device={self.device}, shm={self.shm is not None})"
