"""Owns the model and the KV-cache tensors; turns a scheduled step into one forward pass + sampling.

`build_runner` builds a model and the runner over it, the one way the engine, each tensor-parallel worker and the
draft proposer do.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .attention import AttentionMetadata, get_backend
from .config import EngineConfig, ModelConfig
from .layers.dispatch import KernelTable, kernel_table
from .layers.fused_decode import FusedDecoder
from .models.llama import LlamaModel
from .models.loader import build_model
from .prompt_logprobs import prompt_logprobs
from .quant.loading import QuantSpec
from .rejection_sampler import verify_batch
from .sampler import Sampler, SampleRequest, TokenLogprob
from .sequence import Sequence

if TYPE_CHECKING:
    from .parallel.group import TensorParallel
    from .parallel.workers import WorkerGroup

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_GIB = 1.0
DEFAULT_GPU_KV_FRACTION = 0.9


def gpu_kv_budget(free: int, total: int, activations: int, fraction: float = DEFAULT_GPU_KV_FRACTION) -> float:
    """Bytes for KV blocks: the GPU may be `fraction` full in all, and what is in use now (weights, the CUDA
    context, other processes: total - free) plus the largest step's activations is not ours to take."""
    return free - (1.0 - fraction) * total - activations


def build_runner(config: EngineConfig, model_path: str, model_config: ModelConfig, device: torch.device,
                 dtype: torch.dtype, max_len: int, *, model: LlamaModel | None = None, tp: TensorParallel | None = None,
                 workers: WorkerGroup | None = None, before_runner: Callable[[], None] | None = None) -> ModelRunner:
    """The model at `model_path` as `config` asks (its quantization, its kernel policy; `max_len` positions; this
    rank's shard under `tp`), and the runner over it. Each caller reads `model_config` itself first, as each checks
    it before building: the engine for its context length and shares, a worker against node 0's, the draft against
    the target's vocabulary. `model`: pre-built (tests and benchmarks share one load). `before_runner`: called
    between the two, because the runner's first collective needs every rank: rank 0 waits there for its workers'
    shards, and a worker says it has built its own."""
    table = kernel_table(device, dtype, config.kernel_policy)
    torch.manual_seed(config.seed)
    if model is None:
        quant = QuantSpec.from_options(config.quantization, config.quant_group_size, config.quantize_lm_head)
        model = build_model(model_path, model_config, dtype, device, max_len, config.seed, quant, table, tp)
    elif model.rope.max_positions < max_len:
        raise ValueError(f"the given model was built for {model.rope.max_positions} positions < {max_len}")
    if before_runner is not None:
        before_runner()
    return ModelRunner(config, model_config, model, device, dtype, table, tp, workers)


@dataclass(slots=True)
class StepInput:
    """What the model runner needs from the scheduler for one step."""

    seqs: list[Sequence]
    num_new_tokens: list[int]
    sample_requests: list[SampleRequest | None]  # per sequence; None where this step samples nothing


@dataclass(slots=True)
class StepMessage:
    """What a tensor-parallel worker needs to run its shard of a step (rank 0 sends it; small, host lists)."""

    input_ids: list[int]
    positions: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    tables: list[list[int]]


@dataclass(slots=True)
class LogitsMessage:
    """Rows of the last step's hidden states whose logits rank 0 gathers next (each rank computes its vocab rows)."""

    rows: list[int] | slice


class ModelRunner:
    """`tp`: this rank's place in a tensor-parallel group (None: the whole model). On rank 0, `workers` runs the
    other ranks: `run` sends them each step's metadata and logits rows; a worker calls `execute` with them."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, model: LlamaModel,
                 device: torch.device, dtype: torch.dtype, table: KernelTable | None = None,
                 tp: TensorParallel | None = None, workers: WorkerGroup | None = None) -> None:
        self.config = config
        self.tp, self.workers = tp, workers
        # this rank's KV heads (all of them without tensor parallelism)
        self.num_kv_heads = model_config.num_kv_heads if tp is None else tp.shares(model_config).kv_heads
        self._hidden: torch.Tensor | None = None  # a worker's last step, for the logits rows that follow
        self.model_config = model_config
        self.model = model
        self.device = device
        self.dtype = dtype
        self.block_size = config.cache.block_size
        table = table or kernel_table(device, dtype, config.kernel_policy)
        self.backend = get_backend(config.attention_backend, device, table, self.block_size)
        # a small decode step on the CPU: each layer in one C++ call (None where the model has no fused form)
        # (not under tensor parallelism: the fused layer has no all-reduce between its projections)
        self.fused = FusedDecoder.build(model) if self.backend.name == "cpu" and model is not None and tp is None \
            else None
        self.sampler = Sampler(config.seed, device)
        self.num_blocks = self._num_blocks()
        cfg = model_config
        # One allocation for all layers: [layers, 2 (K, V), blocks, block_size, kv heads, head dim].
        # Zeroed: padded decode rows read never-written slots under a zero softmax weight, and 0 * NaN
        # garbage would still poison the output.
        self.kv_cache = torch.zeros(cfg.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads,
                                    cfg.head_dim, dtype=dtype, device=device)
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(cfg.num_layers)]
        self.graph_runner = None
        if config.cuda_graphs and device.type == "cuda" and self.backend.name == "triton" and tp is None:
            self.graph_runner = self._capture_graphs()

    def _capture_graphs(self):
        from .graph_runner import DecodeGraphRunner

        max_len = min(self.config.context_length(self.model_config), self.kv_capacity_tokens)
        try:
            return DecodeGraphRunner(self.model, self.kv_caches, min(self.config.scheduler.max_num_seqs, 256),
                                     max_len, self.block_size, self.device)
        except Exception:  # a capture failure costs speed, never correctness: run eagerly
            logger.exception("CUDA graph capture failed; decode steps run eagerly")
            return None

    # ---- sizing -----------------------------------------------------------------------------------
    @property
    def kv_bytes_per_token(self) -> int:
        """This rank's: its KV heads only."""
        cfg = self.model_config
        return 2 * cfg.num_layers * self.num_kv_heads * cfg.head_dim * self.dtype.itemsize

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def _num_blocks(self) -> int:
        cache = self.config.cache
        per_block = self.kv_bytes_per_token * self.block_size
        if cache.num_blocks is not None:
            return self._fits_memory(cache.num_blocks, per_block)
        if cache.memory_gib is not None:
            budget = cache.memory_gib * 2**30
        elif self.device.type == "cuda":
            activations = self._profile_peak_bytes()
            free, total = torch.cuda.mem_get_info(self.device)
            budget = gpu_kv_budget(free, total, activations)
            logger.info("KV cache: %.2f GiB free of %.2f GiB; the largest step peaks at %.2f GiB of activations; "
                        "%.2f GiB for KV blocks (%.0f%% of the GPU in use at most)", free / 2**30, total / 2**30,
                        activations / 2**30, budget / 2**30, DEFAULT_GPU_KV_FRACTION * 100)
        else:
            budget = DEFAULT_CPU_KV_GIB * 2**30
        num = int(budget // per_block)
        if self.tp is not None:  # every rank holds the same block tables: the smallest budget sets them all
            num = int(self.tp.all_reduce(torch.tensor([num], device=self.device), dist.ReduceOp.MIN).item())
        if num < 1:
            raise ValueError(f"KV-cache budget of {budget / 2**30:.2f} GiB holds no {per_block}-byte block")
        return self._fits_memory(num, per_block)

    def _fits_memory(self, num_blocks: int, per_block: int) -> int:
        """num_blocks, refused in one line where they need more than this machine's memory (the zeroed cache
        would fail its allocation with a traceback, or be killed for memory while it zeroes)."""
        need = num_blocks * per_block
        if self.device.type == "cpu" and hasattr(os, "sysconf"):
            memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            if need > memory:
                raise ValueError(f"a KV cache of {num_blocks} blocks needs {need / 2**30:.1f} GiB, more than this "
                                 f"machine's {memory / 2**30:.1f} GiB of memory: lower --kv-cache-gib or --num-blocks")
        return num_blocks

    def _profile_forward(self) -> None:
        """The largest step the scheduler can build: max_num_batched_tokens prompt tokens of one sequence (through
        a scratch KV cache of just its blocks), and logits for max_num_seqs rows."""
        cfg, sched = self.model_config, self.config.scheduler
        tokens = sched.max_num_batched_tokens
        blocks = -(-tokens // self.block_size)
        scratch = torch.zeros(cfg.num_layers, 2, blocks, self.block_size, self.num_kv_heads, cfg.head_dim,
                              dtype=self.dtype, device=self.device)
        caches = [(scratch[i, 0], scratch[i, 1]) for i in range(cfg.num_layers)]
        positions = [p % self.model.rope.max_positions for p in range(tokens)]
        meta = self._metadata(positions, [tokens], [tokens], [list(range(blocks))])
        with torch.inference_mode():
            hidden = self.model(torch.zeros(tokens, dtype=torch.long, device=self.device),
                                torch.tensor(positions, device=self.device), caches, meta, self.backend)
            self.model.compute_logits(hidden[:min(sched.max_num_seqs, tokens)])

    def _profile_peak_bytes(self) -> int:
        """Peak memory of the largest step above the weights (vLLM's profile run), measured before the KV cache
        exists: what must stay free beside the KV blocks."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        self._profile_forward()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        torch.cuda.empty_cache()
        return peak

    def kv_cache_bytes(self) -> int:
        return self.kv_cache.nbytes

    # ---- the step ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, step: StepInput) -> tuple[list[int | list[int] | None], list[TokenLogprob | None],
                                            dict[int, tuple[int, list[TokenLogprob]]]]:
        """Forward the scheduled tokens; return a sampled token (or None) per scheduled sequence, or for a
        sequence with draft tokens the verified ones plus the target's own next token; and for sequences that
        want prompt logprobs {index: (first prompt position scored, entries)}."""
        # decodes first: the backends batch them as one block
        order = sorted(range(len(step.seqs)), key=lambda i: step.num_new_tokens[i] != 1)
        input_ids, positions, query_lens, seq_lens, tables = [], [], [], [], []
        for i in order:
            seq, n = step.seqs[i], step.num_new_tokens[i]
            start = seq.num_computed_tokens
            input_ids.extend(seq.token_ids[start:start + n])
            if start + n > seq.num_tokens:  # draft tokens to verify
                input_ids.extend(seq.spec_token_ids[:start + n - seq.num_tokens])
            positions.extend(range(start, start + n))
            query_lens.append(n)
            seq_lens.append(start + n)
            tables.append(seq.block_table)
        if self.workers is not None:
            self.workers.send(StepMessage(input_ids, positions, query_lens, seq_lens, tables))
        host = HostBatch.build(input_ids, positions, query_lens, seq_lens, tables, self.block_size)
        if self.graph_runner is not None and len(input_ids) == len(order) and self.graph_runner.fits(len(order)):
            hidden = self.graph_runner.run(host.input_ids, host.positions, host.slot_mapping, host.seq_lens,
                                           host.block_tables)
        else:
            hidden = self._forward(host, query_lens, seq_lens)

        # logits only at each sampling sequence's last scheduled token
        ends = host.query_start_loc[1:].tolist()  # one conversion, not a tensor index per sequence
        prompt_lps = self._prompt_logprobs(step, order, ends, hidden)
        sampling = [(ends[j] - 1, i) for j, i in enumerate(order) if step.sample_requests[i] is not None]
        sampled: list[int | list[int] | None] = [None] * len(step.seqs)
        logprobs: list[TokenLogprob | None] = [None] * len(step.seqs)
        if not sampling:
            return sampled, logprobs, prompt_lps
        # a speculating sequence needs logits at each draft position too: one row per draft, then its last
        num_drafts = [len(step.seqs[i].spec_token_ids) for _, i in sampling]
        rows = [r for (row, _), k in zip(sampling, num_drafts) for r in range(row - k, row + 1)]
        logits = self._logits(hidden, rows)
        # sample the plain sequences; verify the speculating ones' drafts (accepted + one token each)
        logit_ends = list(itertools.accumulate(k + 1 for k in num_drafts))
        plain = [j for j, k in enumerate(num_drafts) if not k]
        if plain:
            plain_logits = logits if len(plain) == len(sampling) else logits[[logit_ends[j] - 1 for j in plain]]
            tokens, lps = self.sampler(plain_logits, [step.sample_requests[sampling[j][1]] for j in plain])
            for j, tok, lp in zip(plain, tokens, lps):
                sampled[sampling[j][1]], logprobs[sampling[j][1]] = tok, lp
        spec = [j for j, k in enumerate(num_drafts) if k]
        if spec:
            rows = [r for j in spec for r in range(logit_ends[j] - num_drafts[j] - 1, logit_ends[j])]
            verified = verify_batch(logits[rows], [step.seqs[sampling[j][1]].spec_token_ids for j in spec],
                                    [step.sample_requests[sampling[j][1]] for j in spec], self.sampler.generator)
            for j, tokens in zip(spec, verified):
                sampled[sampling[j][1]] = tokens
        return sampled, logprobs, prompt_lps

    def _logits(self, hidden: torch.Tensor, rows: list[int] | slice) -> torch.Tensor:
        """fp32 logits at `rows` of the step's hidden states (the workers compute their vocab rows of them too)."""
        if self.workers is not None:
            self.workers.send(LogitsMessage(rows))
        return self.model.compute_logits(hidden[self._index(rows)])

    def _index(self, rows: list[int] | slice) -> torch.Tensor | slice:
        return rows if isinstance(rows, slice) else torch.tensor(rows, device=self.device)

    def execute(self, message: StepMessage | LogitsMessage) -> None:
        """A tensor-parallel worker's part of what rank 0's `run` does: the forward of a step, then the logits
        rows rank 0 gathers."""
        with torch.inference_mode():
            if isinstance(message, LogitsMessage):
                self.model.compute_logits(self._hidden[self._index(message.rows)])
                return
            m = message
            host = HostBatch.build(m.input_ids, m.positions, m.query_lens, m.seq_lens, m.tables, self.block_size)
            self._hidden = self._forward(host, m.query_lens, m.seq_lens)

    def _forward(self, host: HostBatch, query_lens: list[int], seq_lens: list[int]) -> torch.Tensor:
        """The eager forward of a batch, its host tensors copied to the device."""
        input_ids, positions = host.input_ids.to(self.device), host.positions.to(self.device)
        meta = self._attention_metadata(host, query_lens, seq_lens)
        if self.fused is not None:
            hidden = self.fused(input_ids, positions, self.kv_caches, meta, self.backend)
            if hidden is not None:
                return hidden
        return self.model(input_ids, positions, self.kv_caches, meta, self.backend)

    def _prompt_logprobs(self, step: StepInput, order: list[int], ends: list[int],
                         hidden) -> dict[int, tuple[int, list[TokenLogprob]]]:
        out = {}
        for j, i in enumerate(order):
            seq, n = step.seqs[i], step.num_new_tokens[i]
            start = seq.num_computed_tokens
            stop = min(start + n, seq.num_prompt_tokens - 1)  # the last prompt position scores the output
            if seq.params.prompt_logprobs is None or stop <= start:
                continue
            row = ends[j] - n
            out[i] = (start, prompt_logprobs(lambda lo, hi, row=row: self._logits(hidden, slice(row + lo, row + hi)),
                                             stop - start, seq.token_ids[start + 1:stop + 1],
                                             seq.params.prompt_logprobs))
        return out

    def _attention_metadata(self, host: HostBatch, query_lens: list[int], seq_lens: list[int]) -> AttentionMetadata:
        return self.backend.build_metadata(host.metadata(self.device, query_lens, seq_lens), self.num_kv_heads,
                                           self.dtype)

    def _metadata(self, positions: list[int], query_lens: list[int], seq_lens: list[int],
                  tables: list[list[int]]) -> AttentionMetadata:
        """Metadata for a batch given as lists (the profile run, tests and tools; `run` builds its own)."""
        host = HostBatch.build([0] * len(positions), positions, query_lens, seq_lens, tables, self.block_size)
        return self._attention_metadata(host, query_lens, seq_lens)


@dataclass(slots=True)
class HostBatch:
    """The step's flat batch as CPU tensors; copied to the device once (or into graph buffers)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor

    @classmethod
    def build(cls, input_ids: list[int], positions: list[int], query_lens: list[int], seq_lens: list[int],
              tables: list[list[int]], block_size: int) -> HostBatch:
        # In Python lists, then one tensor each: at batch 1 the tensor-op version (repeat_interleave, gathers,
        # cumsum) was slower, and a long prefill's slots take about as long either way (figures:
        # docs/performance.md).
        width = max(len(t) for t in tables)
        slots, i = [], 0
        for table, n in zip(tables, query_lens):
            slots.extend(table[p // block_size] * block_size + p % block_size for p in positions[i:i + n])
            i += n
        return cls(torch.tensor(input_ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long),
                   torch.tensor(slots, dtype=torch.long),
                   torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32),
                   torch.tensor(seq_lens, dtype=torch.int32),
                   torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32))

    def metadata(self, device: torch.device, query_lens: list[int], seq_lens: list[int]) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping.to(device),
            query_start_loc=self.query_start_loc.to(device),
            seq_lens=self.seq_lens.to(device),
            block_tables=self.block_tables.to(device),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            num_decodes=next((j for j, n in enumerate(query_lens) if n != 1), len(query_lens)),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )
