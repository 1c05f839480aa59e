"""CUDA graphs for decode steps: capture the forward once per batch size, then replay it.

A decode step of a small model is mostly kernel-launch overhead (hundreds of small kernels); a
graph replays all of them with one launch. Inputs live in static buffers that each step copies into.
A batch is padded up to the nearest captured size: padding rows store nothing (slot -1) and attend
to a one-token context, and their outputs are dropped. With `capture=False` the same padded buffers
run eagerly, which is how the padding logic is tested without a GPU.
"""

from __future__ import annotations

import logging

import torch

from .attention.base import AttentionMetadata
from .attention.triton_paged import TritonPagedAttention, num_kv_splits
from .models.llama import LlamaModel

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_batch (as vLLM does): padding wastes at most 15 rows."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch] + list(range(16, max_batch, 16))
    return sizes + [max_batch]


class DecodeGraphRunner:
    def __init__(self, model: LlamaModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], max_batch: int,
                 max_model_len: int, block_size: int, device: torch.device, capture: bool = True) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = graph_batch_sizes(max_batch)
        self.max_model_len = max_model_len
        max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(max_batch, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        num_kv_heads = kv_caches[0][0].shape[2]
        # The split count is a compile-time constant of the kernel, so each graph fixes one that suits its
        # batch at the longest context; the kernels are exact for any shorter context with it.
        self.backends = {bs: TritonPagedAttention(num_kv_splits(bs, num_kv_heads, max_model_len, device))
                         for bs in self.sizes}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        if capture:
            self._capture()

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs], query_start_loc=self.query_start_loc[:bs + 1],
            seq_lens=self.seq_lens[:bs], block_tables=self.block_tables[:bs], max_query_len=1,
            max_seq_len=self.max_model_len, num_decodes=bs, query_lens_cpu=[1] * bs,
            seq_lens_cpu=[self.max_model_len] * bs)

    def _forward(self, bs: int) -> torch.Tensor:
        return self.model(self.input_ids[:bs], self.positions[:bs], self.kv_caches, self._meta(bs),
                          self.backends[bs])

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = None
        for bs in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory pool
            self._forward(bs)  # compiles the kernels outside the capture; slots are -1: writes nothing
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bs] = self._forward(bs)
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batch sizes %s", self.sizes)

    def fits(self, num_seqs: int) -> bool:
        return num_seqs <= self.sizes[-1]

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            seq_lens: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
        """Hidden states [n, hidden] for n decoding sequences (host or device tensors)."""
        n = input_ids.shape[0]
        bs = next(s for s in self.sizes if s >= n)
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(seq_lens, non_blocking=True)
        self.block_tables[:n, :block_tables.shape[1]].copy_(block_tables, non_blocking=True)
        self.slot_mapping[n:bs].fill_(-1)  # padding rows: nothing stored, a one-token context read
        self.seq_lens[n:bs].fill_(1)
        if bs in self.graphs:
            self.graphs[bs].replay()
            return self.outputs[bs][:n]
        return self._forward(bs)[:n]
