"""LLM: offline batch generation over an LLMEngine, `LLM().generate(["Hello"], SamplingParams(max_tokens=32))`."""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field

from .config import make_config
from .llm_engine import LLMEngine
from .output_processor import RequestMetrics
from .sampler import TokenLogprob
from .sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_calls = itertools.count()  # request ids stay unique across calls and LLM objects sharing an engine


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
            # server's default step-time target would only cost throughput, once the cost model is fitted
            # (figures: docs/performance.md). A number given here still applies.
            kwargs["max_step_ms"] = 0
        self.engine = engine or LLMEngine(make_config(model=model, **kwargs))
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: str | list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 priority: list[int] | None = None) -> list[GenerationResult]:
        """`priority`: one per prompt, lower first, with `scheduling_policy="priority"` (vLLM's keyword; it
        overrides each SamplingParams' own)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(sampling_params, SequenceABC):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError("need one SamplingParams per prompt")
        if priority is not None:
            if len(priority) != len(prompts):
                raise ValueError("need one priority per prompt")
            sampling_params = [dataclasses.replace(p or SamplingParams(), priority=x)
                               for p, x in zip(sampling_params, priority)]
        base = next(_calls)
        ids = [f"gen-{base}-{i}" for i in range(len(prompts))]
        # all built and checked before any is queued
        requests = [self.engine.input_processor.process(rid, prompt, params)
                    for rid, prompt, params in zip(ids, prompts, sampling_params)]
        done: dict[str, GenerationResult] = {}
        results = {r.request_id: GenerationResult(r.request_id, r.prompt_token_ids, "", [], "", 0, None)
                   for r in requests}
        submitted: list[str] = []
        try:
            for request in requests:
                self.engine.add(request)
                submitted.append(request.request_id)
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
