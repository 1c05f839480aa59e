"""LLMEngine: the online engine (add_request / abort / step), and its public state snapshot (`stats`)."""

from __future__ import annotations

import atexit
import copy
import dataclasses
import gc
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import allocator
from .block_manager import BlockManager
from .config import EngineConfig, make_config, resolve_dtype
from .errors import InvalidRequestError
from .input_processor import EngineRequest, InputProcessor
from .model_runner import StepInput, build_runner
from .models.llama import LlamaModel
from .models.loader import load_config
from .models.resolver import resolve_model
from .output_processor import OutputProcessor, RequestOutput, RequestState
from .sampler import SampleRequest
from .sampling_params import SamplingParams
from .scheduler import DEFAULT_PREFILL_MS_PER_TOKEN, Scheduler, SchedulerStats
from .sequence import Sequence, StopMatch
from .snapshot import EngineSnapshot, StepRecord
from .snapshot import take as take_snapshot
from .spec_decode import SpecStats, build_speculator
from .step_cost import StepCostModel, StepShape
from .structured import StructuredOutputs
from .tokenizer import IncrementalDetokenizer, StopStringMatcher, load_tokenizer

logger = logging.getLogger(__name__)


# Prompt lengths of the start-up steps: prefill chunks of several sizes beside 0..7 decodes
WARM_UP_PROMPTS = (24, 96, 40, 160, 8, 64, 128, 16)
WARM_UP_BATCH = 24


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of the engine's state for servers and dashboards (counts only, never request content)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # 0..1: blocks held by requests
    num_preemptions: int
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # of which found cached
    spec_decode: SpecStats | None  # None unless speculative decoding is on


class LLMEngine:
    """The engine loop's state. `add_request` and `abort` may be called from any thread; `step` from one.

    Requests enter through a locked inbox that `step` drains, so the scheduler itself is only ever
    touched by the thread that steps.
    """

    def __init__(self, config: EngineConfig | None = None, *, model: LlamaModel | None = None,
                 tokenizer=None, **kwargs) -> None:
        """`model` / `tokenizer` may be passed pre-built (tests and benchmarks share one load)."""
        allocator.tune()  # before torch allocates anything here: the weights, the configs' tensors
        config = config or make_config(**kwargs)
        model_path = resolve_model(config.model, config.revision, config.gguf_file).path
        self.config = config
        self.model_path = model_path
        self.model_config = load_config(model_path)
        self.device = config.torch_device()
        self.dtype = resolve_dtype(config.dtype, self.device, config.kernel_policy)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.tokenizer or model_path)
        max_len = config.context_length(self.model_config)
        t0 = time.perf_counter()
        self.workers = None  # tensor-parallel ranks 1..N-1 (engine/parallel/workers.py)
        tp = None
        if config.tensor_parallel_size > 1:
            tp = self._start_workers(model, max_len)
        elif config.cpu_bind is not None:  # one rank, this process: on its CPUs as a tensor-parallel rank would be
            from .parallel.workers import pin

            pin(config, 0)
        try:
            self.runner = build_runner(config, model_path, self.model_config, self.device, self.dtype, max_len,
                                       model=model, tp=tp, workers=self.workers,
                                       before_runner=None if self.workers is None else self.workers.wait_ready)
        except BaseException:
            self.close()
            raise
        if self.runner.kv_capacity_tokens < max_len:
            logger.warning("KV cache holds %d tokens < max_model_len %d: capping max_model_len",
                           self.runner.kv_capacity_tokens, max_len)
            max_len = self.runner.kv_capacity_tokens
        self.max_model_len = max_len
        self.block_manager = BlockManager(self.runner.num_blocks, config.cache.block_size,
                                          config.cache.enable_prefix_caching)
        self.cost_model = StepCostModel()  # fitted from timed steps; sizes prefill chunks by time
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.cost_model)
        self.speculator = build_speculator(config, self.model_config, self.runner.num_blocks, max_len, self.device,
                                           self.cost_model)
        self.output_processor = OutputProcessor()
        # The engine thread detokenizes while other threads encode: HF fast tokenizers mutate state on
        # encode ("Already borrowed"), so the detokenizer gets its own copy.
        self._detok_tokenizer = copy.deepcopy(self.tokenizer)
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids |= {self.tokenizer.eos_token_id}
        self.structured = StructuredOutputs(self.tokenizer, self.model_config.vocab_size)
        self.input_processor = InputProcessor(self.tokenizer, self.model_config.vocab_size, max_len, self.structured,
                                              config.scheduler.scheduling_policy)
        self._requests: dict[str, RequestState] = {}
        self._adds: list[Sequence] = []  # since the last step (the inbox), under _lock
        self._aborts: list[str] = []
        self._lock = threading.Lock()
        self._seq_ids = itertools.count()
        self.num_steps = 0  # steps that ran a batch
        self.last_step: StepRecord | None = None  # what the last one did (for the live view; one small record a step)
        logger.info(
            "model %s (%s, %s on %s) loaded in %.1fs; KV cache: %d blocks x %d tokens = %d tokens, "
            "%d bytes/token, %.2f GiB", model_path, self.model_config.architecture, self.dtype, self.device,
            time.perf_counter() - t0, self.runner.num_blocks, config.cache.block_size,
            self.runner.kv_capacity_tokens, self.runner.kv_bytes_per_token, self.runner.kv_cache_bytes() / 2**30)
        # Everything built so far (model, tokenizer and their many objects) lives as long as the engine:
        # frozen, the cyclic GC's full collections stop re-scanning it. Unfrozen, each full collection re-scans the
        # whole start-up heap: a stall for every stream whenever a server's allocations trigger one (figures:
        # docs/performance.md). vLLM freezes its start-up heap the same way.
        gc.collect()
        gc.freeze()
        atexit.register(gc.unfreeze)  # let the interpreter's last collection see them (nanobind reports leaks)

    def _start_workers(self, model: LlamaModel | None, max_len: int):
        """Spawn the tensor-parallel worker ranks; returns rank 0's TensorParallel (this process's place)."""
        from .parallel.group import check_tensor_parallel
        from .parallel.workers import Setup, WorkerGroup, rank_device

        check_tensor_parallel(self.model_config, self.config.tensor_parallel_size)
        if self.config.node_rank:
            raise ValueError(f"node_rank={self.config.node_rank} runs only its worker ranks (`pagedserve serve "
                             "--node-rank k`); the engine runs on node 0")
        if model is not None:
            raise ValueError("a pre-built model cannot be split for tensor parallelism: pass the model's path")
        self.device = rank_device(self.device, 0)
        setup = Setup(self.config, self.dtype, max_len, self.model_config)
        self.workers, tp = WorkerGroup.start(setup, self.model_path, self.device)
        return tp

    def check_health(self) -> None:
        """Raise if the engine can no longer step (a tensor-parallel worker died). Cheap; any thread."""
        if self.workers is not None:
            self.workers.check()

    def close(self) -> None:
        """Stop the tensor-parallel workers (nothing to do without them). The engine cannot step afterwards."""
        if self.workers is not None:
            self.workers.close()

    def warm_up(self) -> None:
        """Time a few steps of varied shape before serving: the step-cost model is then fitted before the first
        burst (unfitted, it cannot bound a step's prefill in time, and a burst's first streams waited behind whole
        2048-token steps), and the kernels' first calls are paid. The counters are reset; no block stays held.
        Only for engines that size prefill by time (the offline LLM does not)."""
        sched = self.config.scheduler
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        tail = 8  # tokens of each batch request's own after the longest prompt
        lengths = [n for n in WARM_UP_PROMPTS if n + tail + params.max_tokens <= self.max_model_len]
        if sched.max_step_ms == 0 or sched.policy != "continuous" or not lengths:  # too short a context: unfitted
            return
        t0 = time.perf_counter()
        vocab = self.model_config.vocab_size
        for rep in range(2):  # the first pass pays the kernels' first calls, the second is what the model keeps
            self.cost_model.reset()
            prompts = [[(7919 * i + 31 * j + rep) % vocab for j in range(n)] for i, n in enumerate(lengths)]
            for i, ids in enumerate(prompts):  # one prompt a step beside the decodes of the earlier ones
                self.add_request(f"warm-up-{rep}-{i}", ids, params)
                self.step()
            # then a batch on the longest prompt (cached by now) with short tails of their own: decode steps of
            # many sequences with long contexts, at the price of a few prefill tokens each (no more than can run
            # at once: the rest would only repeat those steps)
            longest = max(prompts, key=len)
            for i in range(min(WARM_UP_BATCH, sched.max_num_seqs)):
                self.add_request(f"warm-up-{rep}-b{i}", longest + [(104729 * i + 17 * j) % vocab for j in range(tail)],
                                 params)
            while self.has_unfinished():
                self.step()
        self.scheduler.stats = SchedulerStats()
        self.num_steps, self.last_step = 0, None
        logger.info("warmed up in %.1fs; %s", time.perf_counter() - t0, self.cost_model.describe())

    # ---- requests -----------------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt. Any thread; O(prompt size), so servers call it off their event loop."""
        return self.input_processor.tokenize(prompt)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int | None = None) -> int:
        """Queue a request (a string or token ids). Returns the prompt's token count. `priority` (vLLM's keyword;
        lower runs first, under --scheduling-policy priority) overrides `params.priority`. Builds the request
        with `input_processor.process` in the calling thread, then `add`s it."""
        params = params or SamplingParams()
        if priority is not None and priority != params.priority:
            params = dataclasses.replace(params, priority=priority)  # params may be shared by other requests
        with self._lock:  # early too, so that a duplicate costs nothing below
            self._check_unused(request_id)
        request = self.input_processor.process(request_id, prompt, params, arrival_time=arrival_time)
        self.add(request)
        return len(request.prompt_token_ids)

    def add(self, request: EngineRequest) -> None:
        """Queue a request built by `input_processor.process`, trusted as it is. Any thread."""
        ids, params = request.prompt_token_ids, request.params
        seq = Sequence(next(self._seq_ids), request.request_id, ids, params, request.max_tokens, self.eos_token_ids,
                       arrival_time=request.arrival_time or time.monotonic())
        generator = None if params.seed is None else torch.Generator(device=self.device).manual_seed(params.seed)
        req = RequestState(seq, IncrementalDetokenizer(self._detok_tokenizer, ids), StopStringMatcher(params.stop),
                           SampleRequest(params, [], generator, request.constraint))
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None] * len(ids)
        with self._lock:
            self._check_unused(request.request_id)
            self._requests[request.request_id] = req
            self._adds.append(seq)

    def _check_unused(self, request_id: str) -> None:
        """Under _lock."""
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")

    def abort(self, request_id: str) -> None:
        with self._lock:
            if request_id in self._requests:
                self._aborts.append(request_id)

    def has_request(self, request_id: str) -> bool:
        """Whether `request_id` names a request the engine still holds (an aborted one until its next step)."""
        with self._lock:
            return request_id in self._requests

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._requests)

    @property
    def num_waiting(self) -> int:
        """Requests not running yet: queued in the scheduler, or added since the last step. Any thread.

        The inbox moves into the scheduler under the same lock, so no request is ever counted in neither.
        """
        with self._lock:
            return len(self._adds) + len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    def has_seat(self, num_prompt_tokens: int) -> bool:
        """Whether a prompt of this many tokens, queued now behind every request waiting, finds a free seat
        (--max-num-seqs) and free KV blocks for itself as the scheduler seats requests (`SchedulerOutput.seated`):
        then only the prefill ahead of it delays its own. Any thread: read without stopping the loop, an estimate."""
        with self._lock:
            queue = list(self.scheduler.waiting) + self._adds
        if len(self.scheduler.running) + len(queue) >= self.config.scheduler.max_num_seqs:
            return False
        size = self.block_manager.block_size
        need = sum(-(-s.num_tokens // size) for s in queue) + -(-num_prompt_tokens // size)
        return need <= self.scheduler.free_blocks_after_running_prompts()

    def prefill_time(self, num_tokens: int) -> float:
        """Seconds to prefill this many prompt tokens: the step-cost model's measured cost per token (before it is
        fitted, the scheduler's prior). Any thread."""
        return num_tokens * (self.cost_model.ms_per_prefill_token() or DEFAULT_PREFILL_MS_PER_TOKEN) / 1e3

    def estimated_wait(self, ahead: int) -> float:
        """Seconds until the first `ahead` requests waiting now (in queue order; any beyond those known here count
        for their seats only) will have been scheduled, from what the engine knows: the prompts ahead of the last of
        them prefilled (`prefill_time`; running prompts first), and, where they need more seats than --max-num-seqs
        leaves, as many running requests finished, each running to its max_tokens in decode steps timed by the
        step-cost model (else as long as the last step). An upper estimate, since outputs may end early: a
        Retry-After's when no queue has drained yet to be measured. Any thread: it reads the scheduler's lists
        without stopping the loop."""
        if ahead <= 0:
            return 0.0
        with self._lock:
            queue = list(self.scheduler.waiting) + self._adds
        running = list(self.scheduler.running)
        prompts = [s for s in running if s.num_tokens - s.num_computed_tokens > 1] + queue[:ahead - 1]
        seconds = self.prefill_time(sum(s.num_tokens - s.num_computed_tokens for s in prompts))
        must_finish = len(running) + ahead - self.config.scheduler.max_num_seqs
        if must_finish > 0 and running:
            step_ms = self.cost_model.decode_ms(len(running), sum(s.num_tokens for s in running))
            if not step_ms and self.last_step is not None:
                step_ms = self.last_step.ms
            left = sorted(max(0, s.max_tokens - s.num_output_tokens) for s in running)
            rounds, k = divmod(must_finish - 1, len(left))  # past one batch, each next one as long as the longest
            seconds += (left[k] + rounds * left[-1]) * (step_ms or 0.0) / 1e3
        return seconds

    # ---- the step -----------------------------------------------------------------------------------
    def step(self, on_scheduled: Callable[[list[str]], None] | None = None) -> list[RequestOutput]:
        """Run one scheduler step + forward pass. Returns an output for every request that changed.
        `on_scheduled` is called before the forward pass with the ids of the requests this step schedules for the
        first time (their prefill begins) or seats (`SchedulerOutput.seated`): the async engine's admission never
        refuses those for their wait."""
        outputs = self._drain_inbox()
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        if on_scheduled is not None and (sched.started or sched.seated):
            on_scheduled([s.request_id for s in sched.started + sched.seated])
        if not sched.seqs:
            return outputs
        reqs = [self._requests[s.request_id] for s in sched.seqs]
        for r in reqs:
            if r.sample.params.needs_penalties:
                r.sample.output_token_ids = r.seq.output_token_ids
        sample = [r.sample if want else None for r, want in zip(reqs, sched.sample)]
        self.structured.begin_step([(r.sample.constraint, r.seq) for r, want in zip(reqs, sched.sample)
                                    if want and r.sample.constraint is not None])
        shape = StepShape.of(sched.num_new_tokens, [s.num_computed_tokens + n for s, n in
                                                    zip(sched.seqs, sched.num_new_tokens)])
        decode = sum(n for s, n in zip(sched.seqs, sched.num_new_tokens) if s.num_tokens - s.num_computed_tokens == 1)
        t0 = time.perf_counter()
        sampled, logprobs, prompt_lps = self._run(StepInput(sched.seqs, sched.num_new_tokens, sample))
        ms = (time.perf_counter() - t0) * 1e3
        self.cost_model.observe(shape, ms)
        self.num_steps += 1
        self.last_step = StepRecord(self.num_steps, ms, self.config.scheduler.max_num_batched_tokens,
                                    sum(sched.num_new_tokens) - decode, decode, len(sched.seqs), sched.num_admitted,
                                    sched.num_preempted)
        if self.speculator is not None:
            self.speculator.observe(sched.seqs, sched.num_new_tokens, sampled)
        for i, (start, entries) in prompt_lps.items():
            reqs[i].add_prompt_logprobs(start, entries)
        lp_of = {s.seq_id: lp for s, lp in zip(sched.seqs, logprobs) if lp is not None}
        num_before = {s.seq_id: s.num_tokens for s in sched.seqs}
        req_of = {s.seq_id: r for s, r in zip(sched.seqs, reqs)}

        def observe(seq: Sequence, token: int) -> StopMatch | None:
            return self.output_processor.observe(req_of[seq.seq_id], token, lp_of.get(seq.seq_id))

        # the scheduler appends each token, the output processor reads it, check_stop decides; then the outputs
        for seq in self.scheduler.update(sched, sampled, observe):
            out = self.output_processor.process(req_of[seq.seq_id], num_before[seq.seq_id])
            outputs.append(out)
            if out.finished:
                self._forget(seq)
        return outputs

    def _run(self, step: StepInput):
        if self.workers is None:
            return self.runner.run(step)
        self.workers.check()
        try:
            return self.runner.run(step)
        except Exception as e:  # a collective or pipe failed: name the dead rank, if one died
            self.workers.raise_failure(e)
            raise

    def _drain_inbox(self) -> list[RequestOutput]:
        with self._lock:
            for seq in self._adds:  # an abort follows its add, so adding all first is safe
                self.scheduler.add(seq)
            aborts, self._adds, self._aborts = self._aborts, [], []
        outputs = []
        for request_id in aborts:
            if (seq := self.scheduler.abort(request_id)) is not None:
                outputs.append(self.output_processor.final(self._requests[request_id]))
                self._forget(seq)
        return outputs

    def _forget(self, seq: Sequence) -> None:
        with self._lock:
            self._requests.pop(seq.request_id, None)
        if self.speculator is not None:
            self.speculator.release(seq)

    def snapshot(self) -> EngineSnapshot:
        """Who holds which KV blocks and what the last step did (counts and ids only). Only from the thread that
        steps, between steps (AsyncEngine.snapshot asks its loop for one)."""
        with self._lock:
            num_inbox = len(self._adds)
        return take_snapshot(self.scheduler, num_inbox, self.last_step)

    def stats(self) -> EngineStats:
        """The engine's state now. Any thread (counters read without the engine lock: a snapshot, not a fence)."""
        s = self.scheduler.stats
        return EngineStats(self.num_running, self.num_waiting, self.block_manager.usage(),
                           s.num_preemptions, s.prefix_cache_queries, s.prefix_cache_hits,
                           self.speculator.stats if self.speculator is not None else None)
