"""LLMEngine (online: add_request / abort / step) and LLM (offline: generate)."""

from __future__ import annotations

import copy
import itertools
import logging
import threading
import time
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field

import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig, bundled_model_path, make_config, resolve_dtype
from engine.errors import ContextLengthExceededError, InvalidRequestError
from engine.model_runner import ModelRunner, StepInput
from engine.models.llama import LlamaModel
from engine.models.loader import build_model, load_config
from engine.sampler import SampleRequest, TokenLogprob
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus
from engine.structured import StructuredOutputs
from engine.tokenizer import IncrementalDetokenizer, StopStringMatcher, load_tokenizer

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestMetrics:
    """time.monotonic() stamps."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request. `text` is the new text since the previous output."""

    request_id: str
    new_token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    metrics: RequestMetrics
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class _Request:
    seq: Sequence
    detokenizer: IncrementalDetokenizer
    stop: StopStringMatcher
    sample: SampleRequest


class LLMEngine:
    """The engine loop's state. `add_request` and `abort` may be called from any thread; `step` from one.

    Requests enter through a locked inbox that `step` drains, so the scheduler itself is only ever
    touched by the thread that steps.
    """

    def __init__(self, config: EngineConfig | None = None, *, model: LlamaModel | None = None,
                 tokenizer=None, **kwargs) -> None:
        """`model` / `tokenizer` may be passed pre-built (tests and benchmarks share one load)."""
        config = config or make_config(**kwargs)
        model_path = config.model or bundled_model_path()
        self.config = config
        self.model_path = model_path
        self.model_config = load_config(model_path)
        self.device = config.torch_device()
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.tokenizer or model_path)
        max_len = config.max_model_len or self.model_config.max_position_embeddings
        if max_len > self.model_config.max_position_embeddings:
            raise ValueError(f"max_model_len={max_len} exceeds the model's context length "
                             f"{self.model_config.max_position_embeddings}")
        t0 = time.perf_counter()
        torch.manual_seed(config.seed)
        if model is None:
            model = build_model(model_path, self.model_config, self.dtype, self.device, max_len, config.seed)
        elif model.rope.max_positions < max_len:
            raise ValueError(f"the given model was built for {model.rope.max_positions} positions < {max_len}")
        self.runner = ModelRunner(config, self.model_config, model, self.device, self.dtype)
        if self.runner.kv_capacity_tokens < max_len:
            logger.warning("KV cache holds %d tokens < max_model_len %d: capping max_model_len",
                           self.runner.kv_capacity_tokens, max_len)
            max_len = self.runner.kv_capacity_tokens
        self.max_model_len = max_len
        self.block_manager = BlockManager(self.runner.num_blocks, config.cache.block_size,
                                          config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        # The engine thread detokenizes while other threads encode: HF fast tokenizers mutate state on
        # encode ("Already borrowed"), so the detokenizer gets its own copy.
        self._detok_tokenizer = copy.deepcopy(self.tokenizer)
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids |= {self.tokenizer.eos_token_id}
        self.structured = StructuredOutputs(self.tokenizer, self.model_config.vocab_size)
        self._requests: dict[str, _Request] = {}
        self._inbox: list[tuple[str, object]] = []
        self._lock = threading.Lock()
        self._seq_ids = itertools.count()
        logger.info(
            "model %s (%s, %s on %s) loaded in %.1fs; KV cache: %d blocks x %d tokens = %d tokens, "
            "%d bytes/token, %.2f GiB", model_path, self.model_config.architecture, self.dtype, self.device,
            time.perf_counter() - t0, self.runner.num_blocks, config.cache.block_size,
            self.runner.kv_capacity_tokens, self.runner.kv_bytes_per_token, self.runner.kv_cache_bytes() / 2**30)

    # ---- requests -----------------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer: pass token ids", "prompt")
            return list(self.tokenizer.encode(prompt, add_special_tokens=True)) if prompt else []
        return list(prompt)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Check a tokenized request; return its resolved max_tokens. Raises InvalidRequestError."""
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("the prompt is empty", "prompt")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt_token_ids):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})", "prompt")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n
        if n + max_tokens > self.max_model_len or max_tokens < 1:
            raise ContextLengthExceededError(n, max(max_tokens, 1), self.max_model_len)
        self.structured.check(params)
        return max_tokens

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> int:
        """Queue a request (a string or token ids). Returns the prompt's token count."""
        params = params or SamplingParams()
        ids = self.tokenize(prompt)
        max_tokens = self.validate(ids, params)
        seq = Sequence(next(self._seq_ids), request_id, ids, params, max_tokens, self.eos_token_ids,
                       arrival_time=arrival_time or time.monotonic())
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        req = _Request(seq, IncrementalDetokenizer(self._detok_tokenizer, ids), StopStringMatcher(params.stop),
                       SampleRequest(params, [], generator, self.structured.constraint_for(params)))
        with self._lock:
            if request_id in self._requests:
                raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
            self._requests[request_id] = req
            self._inbox.append(("add", seq))
        return len(ids)

    def abort(self, request_id: str) -> None:
        with self._lock:
            if request_id in self._requests:
                self._inbox.append(("abort", request_id))

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._requests)

    @property
    def num_waiting(self) -> int:
        """Requests not running yet: queued in the scheduler, or added since the last step. Any thread."""
        with self._lock:
            pending = sum(1 for op, _ in self._inbox if op == "add")
        return pending + self.scheduler.num_waiting

    # ---- the step -----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduler step + forward pass. Returns an output for every request that changed."""
        outputs = self._drain_inbox()
        sched = self.scheduler.schedule()
        if not sched.seqs:
            return outputs
        reqs = [self._requests[s.request_id] for s in sched.seqs]
        for r in reqs:
            if r.sample.params.needs_penalties:
                r.sample.output_token_ids = r.seq.output_token_ids
        sample = [r.sample if want else None for r, want in zip(reqs, sched.sample)]
        self.structured.begin_step([(r.sample.constraint, r.seq) for r, want in zip(reqs, sched.sample)
                                    if want and r.sample.constraint is not None])
        sampled, logprobs = self.runner.run(StepInput(sched.seqs, sched.num_new_tokens, sample))
        lp_of = {s.seq_id: lp for s, lp in zip(sched.seqs, logprobs) if lp is not None}
        for seq in self.scheduler.update(sched, sampled):
            outputs.append(self._emit(self._requests[seq.request_id], lp_of.get(seq.seq_id)))
        return outputs

    def _drain_inbox(self) -> list[RequestOutput]:
        with self._lock:
            inbox, self._inbox = self._inbox, []
        outputs = []
        for op, item in inbox:
            if op == "add":
                self.scheduler.add(item)
            else:
                seq = self.scheduler.abort(item)
                if seq is not None:
                    outputs.append(self._finish_output(self._requests[item], [], "", []))
        return outputs

    def _emit(self, req: _Request, logprob: TokenLogprob | None) -> RequestOutput:
        seq = req.seq
        token = seq.token_ids[-1]
        if req.sample.constraint is not None and req.sample.constraint.matcher is not None:
            self._advance_grammar(req, token)
        req.stop.feed(req.detokenizer.push([token]))
        if req.stop.stopped and not seq.is_finished:
            self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)
        text = req.stop.take(final=seq.is_finished)
        lps = [logprob] if logprob is not None else []
        if seq.is_finished:
            return self._finish_output(req, [token], text, lps)
        return self._output(req, [token], text, lps)

    def _advance_grammar(self, req: _Request, token: int) -> None:
        """Feed the accepted token to the request's grammar; a complete grammar ends the request ("stop")."""
        seq, matcher = req.seq, req.sample.constraint.matcher
        if matcher.num_consumed != seq.num_output_tokens - 1:
            matcher.sync(seq.output_token_ids[:-1])
        if not matcher.accept(token):
            logger.warning("request %s: token %d rejected by its grammar: %s", seq.request_id, token, matcher.error)
        if matcher.is_terminated and not seq.is_finished:
            self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)

    def _finish_output(self, req: _Request, tokens: list[int], text: str, lps: list) -> RequestOutput:
        with self._lock:
            self._requests.pop(req.seq.request_id, None)
        if req.seq.status is SequenceStatus.FINISHED_ABORTED:
            text += req.stop.take(final=True)
        return self._output(req, tokens, text, lps)

    @staticmethod
    def _output(req: _Request, tokens: list[int], text: str, lps: list) -> RequestOutput:
        seq = req.seq
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=tokens,
            text=text,
            finished=seq.is_finished,
            finish_reason=seq.status.value if seq.is_finished else None,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            metrics=RequestMetrics(seq.arrival_time, seq.first_scheduled_time, seq.first_token_time,
                                   seq.finish_time),
            logprobs=lps,
        )


@dataclass(slots=True)
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    num_cached_tokens: int
    metrics: RequestMetrics | None
    logprobs: list[TokenLogprob] = field(default_factory=list)


class LLM:
    """Offline batch generation: `LLM().generate(["Hello"], SamplingParams(max_tokens=32))`."""

    def __init__(self, model: str | None = None, *, engine: LLMEngine | None = None, **kwargs) -> None:
        self.engine = engine or LLMEngine(make_config(model=model, **kwargs))
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: str | list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[GenerationResult]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(sampling_params, SequenceABC):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError("need one SamplingParams per prompt")
        base = next(self.engine._seq_ids)
        ids = [f"gen-{base}-{i}" for i in range(len(prompts))]
        prompt_ids = {}
        for rid, prompt, params in zip(ids, prompts, sampling_params):
            prompt_ids[rid] = self.engine.tokenize(prompt)
            self.engine.add_request(rid, prompt_ids[rid], params)
        done: dict[str, GenerationResult] = {}
        results = {rid: GenerationResult(rid, prompt_ids[rid], "", [], "", 0, None) for rid in ids}
        while len(done) < len(ids):
            for out in self.engine.step():
                res = results[out.request_id]
                res.text += out.text
                res.token_ids.extend(out.new_token_ids)
                res.logprobs.extend(out.logprobs)
                if out.finished:
                    res.finish_reason, res.num_cached_tokens, res.metrics = (
                        out.finish_reason, out.num_cached_tokens, out.metrics)
                    done[out.request_id] = res
        return [done[rid] for rid in ids]
