"""LLMEngine (online: add_request / abort / step) and LLM (offline: generate)."""

from __future__ import annotations

import atexit
import copy
import gc
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field

import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig, bundled_model_path, make_config, resolve_dtype
from engine.errors import ContextLengthExceededError, InvalidRequestError
from engine.model_runner import ModelRunner, StepInput
from engine.models.llama import LlamaModel
from engine.models.loader import build_model, load_config
from engine.quant.loading import QuantSpec
from engine.sampler import SampleRequest, TokenLogprob
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus
from engine.spec_decode import build_speculator
from engine.step_cost import StepCostModel, StepShape
from engine.structured import StructuredOutputs
from engine.tokenizer import IncrementalDetokenizer, StopStringMatcher, apply_chat_template, load_tokenizer

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
    # with SamplingParams.prompt_logprobs: one entry per prompt token, None for the first; on the first output
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_draft_tokens: int = 0  # speculative decoding: drafted for this request so far
    num_accepted_tokens: int = 0  # of which accepted


@dataclass
class _Request:
    seq: Sequence
    detokenizer: IncrementalDetokenizer
    stop: StopStringMatcher
    sample: SampleRequest
    # A token's logprob goes out with its text: held while the stop matcher holds the text back, dropped
    # if a stop string cuts it off. Entries: (offset of the token's text in the output, logprob).
    held_logprobs: deque[tuple[int, TokenLogprob]] = field(default_factory=deque)
    text_fed: int = 0  # characters of output text given to the stop matcher
    text_sent: int = 0  # of which released
    prompt_logprobs: list[TokenLogprob | None] | None = None  # filled as the prompt is computed
    prompt_logprobs_sent: bool = False

    def add_prompt_logprobs(self, start: int, entries: list[TokenLogprob]) -> None:
        """Entries for prompt tokens start+1...; a recompute after preemption overwrites equal values."""
        self.prompt_logprobs[start + 1:start + 1 + len(entries)] = entries


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
            quant = QuantSpec.from_options(config.quantization, config.quant_group_size, config.quantize_lm_head)
            model = build_model(model_path, self.model_config, self.dtype, self.device, max_len, config.seed, quant)
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
        self.cost_model = StepCostModel()  # fitted from timed steps; sizes prefill chunks by time
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.cost_model)
        self.speculator = build_speculator(config, self.model_config, self.runner.num_blocks, max_len, self.device)
        # The engine thread detokenizes while other threads encode: HF fast tokenizers mutate state on
        # encode ("Already borrowed"), so the detokenizer gets its own copy.
        self._detok_tokenizer = copy.deepcopy(self.tokenizer)
        self._tokenizer_lock = threading.Lock()  # encoding from several threads: one at a time
        # No token is longer than this many characters, so a longer text cannot fit the context: it is
        # refused without tokenizing it (a normalizer may merge characters, hence the slack).
        self._max_token_chars = 0
        if self.tokenizer is not None:
            self._max_token_chars = max((len(t) for t in self.tokenizer.get_vocab()), default=1)
            backend = getattr(self.tokenizer, "backend_tokenizer", None)
            if backend is None or backend.normalizer is not None:
                self._max_token_chars *= 4
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
        # Everything built so far (model, tokenizer, ~8.5e5 objects) lives as long as the engine: frozen, the cyclic
        # GC's full collections stop re-scanning it. Unfrozen, one took 333 ms here (frozen: 0.2 ms): a stall for every
        # stream whenever a server's allocations trigger one. vLLM freezes its start-up heap the same way.
        gc.collect()
        gc.freeze()
        atexit.register(gc.unfreeze)  # let the interpreter's last collection see them (nanobind reports leaks)

    # ---- requests -----------------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt. Any thread; O(prompt size), so servers call it off their event loop."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer: pass token ids", "prompt")
            self.check_prompt_chars(len(prompt), "prompt")
            with self._tokenizer_lock:
                return list(self.tokenizer.encode(prompt, add_special_tokens=True)) if prompt else []
        return list(prompt)

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Chat messages (and tools, for templates that take them) -> prompt token ids. Any thread."""
        with self._tokenizer_lock:
            return apply_chat_template(self.tokenizer, messages, tools=tools)

    def check_prompt_chars(self, num_chars: int, param: str = "prompt") -> None:
        """Refuse a text that cannot fit the context whatever its tokens, before paying to tokenize it."""
        limit = self.max_model_len * self._max_token_chars
        if self._max_token_chars and num_chars > limit:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens, and the prompt has "
                f"{num_chars} characters: more than {limit} cannot fit. Please reduce the prompt.", param,
                "context_length_exceeded")

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Check a tokenized request; return its resolved max_tokens. Raises InvalidRequestError."""
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("the prompt is empty", "prompt")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n
        if n + max_tokens > self.max_model_len or (max_tokens < 1 and params.max_tokens is None):  # before O(n)
            raise ContextLengthExceededError(n, max(max_tokens, 1), self.max_model_len)
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt_token_ids):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})", "prompt")
        self.structured.check(params)
        return max_tokens

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> int:
        """Queue a request (a string or token ids). Returns the prompt's token count."""
        params = params or SamplingParams()
        ids = self.tokenize(prompt)
        max_tokens = self.validate(ids, params)
        with self._lock:  # checked early too, so that a duplicate costs nothing below
            if request_id in self._requests:
                raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        seq = Sequence(next(self._seq_ids), request_id, ids, params, max_tokens, self.eos_token_ids,
                       arrival_time=arrival_time or time.monotonic())
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        req = _Request(seq, IncrementalDetokenizer(self._detok_tokenizer, ids), StopStringMatcher(params.stop),
                       SampleRequest(params, [], generator, self.structured.constraint_for(params)))
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None] * len(ids)
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
        """Requests not running yet: queued in the scheduler, or added since the last step. Any thread.

        The inbox moves into the scheduler under the same lock, so no request is ever counted in neither.
        """
        with self._lock:
            return sum(1 for op, _ in self._inbox if op == "add") + self.scheduler.num_waiting

    # ---- the step -----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduler step + forward pass. Returns an output for every request that changed."""
        outputs = self._drain_inbox()
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
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
        shape = StepShape.of(sched.num_new_tokens, [s.num_computed_tokens + n for s, n in
                                                    zip(sched.seqs, sched.num_new_tokens)])
        t0 = time.perf_counter()
        sampled, logprobs, prompt_lps = self.runner.run(StepInput(sched.seqs, sched.num_new_tokens, sample))
        elapsed = time.perf_counter() - t0
        self.cost_model.observe(shape, elapsed * 1e3)
        if self.speculator is not None:
            self.speculator.observe(sched.seqs, sched.num_new_tokens, sampled, elapsed)
        for i, (start, entries) in prompt_lps.items():
            reqs[i].add_prompt_logprobs(start, entries)
        # max_tokens=0 (prompt scoring): the prompt is done, nothing is generated
        prompt_only = [r for i, r in enumerate(reqs) if r.seq.max_tokens == 0 and sampled[i] is not None]
        sampled = [None if r.seq.max_tokens == 0 else t for r, t in zip(reqs, sampled)]
        lp_of = {s.seq_id: lp for s, lp in zip(sched.seqs, logprobs) if lp is not None}
        num_before = {s.seq_id: s.num_tokens for s in sched.seqs}
        for seq in self.scheduler.update(sched, sampled):
            outputs.append(self._emit(self._requests[seq.request_id], lp_of.get(seq.seq_id),
                                      num_before[seq.seq_id]))
        for r in prompt_only:
            self.scheduler.finish(r.seq, SequenceStatus.FINISHED_LENGTH)
            outputs.append(self._finish_output(r, [], "", []))
        return outputs

    def _drain_inbox(self) -> list[RequestOutput]:
        with self._lock:
            inbox, self._inbox = self._inbox, []
            for op, item in inbox:  # an abort follows its add in the inbox, so adding all first is safe
                if op == "add":
                    self.scheduler.add(item)
        outputs = []
        for op, item in inbox:
            if op == "abort":
                seq = self.scheduler.abort(item)
                if seq is not None:
                    outputs.append(self._finish_output(self._requests[item], [], "", []))
        return outputs

    def _emit(self, req: _Request, logprob: TokenLogprob | None, num_before: int) -> RequestOutput:
        """Output for the tokens appended since `num_before` (several when drafts were accepted)."""
        seq = req.seq
        tokens = seq.token_ids[num_before:]
        for j, token in enumerate(tokens):
            if req.sample.constraint is not None and req.sample.constraint.matcher is not None:
                self._advance_grammar(req, token)  # constrained requests do not speculate: one token
            delta = req.detokenizer.push([token])
            if logprob is not None:  # requests with logprobs do not speculate: one token
                req.held_logprobs.append((req.text_fed, logprob))
            req.text_fed += len(delta)
            req.stop.feed(delta)
            if req.stop.stopped:
                del seq.token_ids[num_before + j + 1:]  # accepted drafts after a stop string never happened
                tokens = tokens[:j + 1]
                if not seq.is_finished:
                    self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)
                else:  # the stop string completed on the last allowed token: it stopped, it was not cut short
                    seq.status = SequenceStatus.FINISHED_STOPPED
                break
        text = req.stop.take(final=seq.is_finished)
        req.text_sent += len(text)
        lps = self._release_logprobs(req, everything=seq.is_finished and not req.stop.stopped)
        if seq.is_finished:
            return self._finish_output(req, tokens, text, lps)
        return self._output(req, tokens, text, lps)

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
        if self.speculator is not None:
            self.speculator.release(req.seq)
        if req.seq.status is SequenceStatus.FINISHED_ABORTED:
            text += req.stop.take(final=True)
            lps = lps + self._release_logprobs(req, everything=True)
        req.held_logprobs.clear()  # what is left was cut off by a stop string
        return self._output(req, tokens, text, lps)

    @staticmethod
    def _release_logprobs(req: _Request, everything: bool) -> list[TokenLogprob]:
        held, out = req.held_logprobs, []
        while held and (everything or held[0][0] < req.text_sent):
            out.append(held.popleft()[1])
        return out

    @staticmethod
    def _output(req: _Request, tokens: list[int], text: str, lps: list) -> RequestOutput:
        seq = req.seq
        prompt_lps = None
        if req.prompt_logprobs is not None and not req.prompt_logprobs_sent and (tokens or seq.is_finished):
            prompt_lps, req.prompt_logprobs_sent = req.prompt_logprobs, True
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
            prompt_logprobs=prompt_lps,
            num_draft_tokens=seq.num_draft_tokens,
            num_accepted_tokens=seq.num_accepted_tokens,
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
    prompt_logprobs: list[TokenLogprob | None] | None = None


class LLM:
    """Offline batch generation: `LLM().generate(["Hello"], SamplingParams(max_tokens=32))`."""

    def __init__(self, model: str | None = None, *, engine: LLMEngine | None = None, **kwargs) -> None:
        if kwargs.get("max_step_ms") is None:
            # Every result comes back at the end, so no stream's inter-token time needs protecting: the
            # server's default step-time target would only cost throughput (64 prose requests: ~15 % once
            # the cost model is fitted). A number given here still applies.
            kwargs["max_step_ms"] = 0
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
        for rid, prompt, params in zip(ids, prompts, sampling_params):  # all checked before any is queued
            prompt_ids[rid] = self.engine.tokenize(prompt)
            self.engine.validate(prompt_ids[rid], params or SamplingParams())
        done: dict[str, GenerationResult] = {}
        results = {rid: GenerationResult(rid, prompt_ids[rid], "", [], "", 0, None) for rid in ids}
        submitted: list[str] = []
        try:
            for rid, params in zip(ids, sampling_params):
                self.engine.add_request(rid, prompt_ids[rid], params)
                submitted.append(rid)
            self._run(ids, results, done)
        except BaseException:  # nothing of this call may stay queued (KeyboardInterrupt included)
            for rid in submitted:
                if rid not in done:
                    self.engine.abort(rid)
            try:
                while any(rid not in done for rid in submitted) and self.engine.has_unfinished():
                    for out in self.engine.step():  # drain the aborts so the blocks come back now
                        if out.finished:
                            done[out.request_id] = results.get(out.request_id)
            except Exception:  # noqa: BLE001 - the engine itself is broken: the first error is the one to raise
                logger.exception("could not drain aborted requests")
            raise
        return [done[rid] for rid in ids]

    def _run(self, ids: list[str], results: dict[str, GenerationResult], done: dict) -> None:
        while len(done) < len(ids):
            for out in self.engine.step():
                res = results[out.request_id]
                res.text += out.text
                res.token_ids.extend(out.new_token_ids)
                res.logprobs.extend(out.logprobs)
                if out.prompt_logprobs is not None:
                    res.prompt_logprobs = out.prompt_logprobs
                if out.finished:
                    res.finish_reason, res.num_cached_tokens, res.metrics = (
                        out.finish_reason, out.num_cached_tokens, out.metrics)
                    done[out.request_id] = res
