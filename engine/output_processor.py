"""From sampled tokens to what a client sees: detokenized text, stop strings, logprobs, grammar, finish reasons.

Per request a `RequestState` holds an incremental detokenizer, a stop-string matcher, the logprobs held back
while their text is held back, and the prompt logprobs as the prompt is computed. The processor only reads the
sequence, in two moves per step: `observe` reads each token as the scheduler appends it (detokenizing it, feeding
the stop-string matcher and the grammar) and reports a stop string or a complete grammar, which the scheduler's
`check_stop` turns into a finish (so accepted speculative drafts after a stop never reach the sequence); then
`process` turns what the step appended into one `RequestOutput`.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from .sampler import SampleRequest, TokenLogprob
from .sequence import Sequence, SequenceStatus, StopMatch
from .tokenizer import IncrementalDetokenizer, StopStringMatcher

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
    stop_string: str | None = None  # once finished: the stop string that ended it, if one did


@dataclass
class RequestState:
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


class OutputProcessor:
    """Stateless between requests; reads sequences, never changes them (their state is the scheduler's)."""

    def observe(self, req: RequestState, token: int, logprob: TokenLogprob | None) -> StopMatch | None:
        """Read a token just appended to `req.seq`: advance its grammar, detokenize it, hold its logprob with its
        text, look for a stop string. Reports what may end the request; the scheduler's `check_stop` decides."""
        match = None
        constraint = req.sample.constraint
        if constraint is not None and constraint.matcher is not None:  # constrained requests do not speculate
            if self._advance_grammar(req, token):
                match = StopMatch.GRAMMAR_COMPLETE
        delta = req.detokenizer.push([token])
        if logprob is not None:  # requests with logprobs do not speculate: one token
            req.held_logprobs.append((req.text_fed, logprob))
        req.text_fed += len(delta)
        req.stop.feed(delta)
        return StopMatch.STOP_STRING if req.stop.stopped else match

    def process(self, req: RequestState, num_before: int) -> RequestOutput:
        """Output for the tokens appended since `num_before` (several when drafts were accepted), once the step's
        stop check has run: a finished request releases what it held back, except text a stop string cut off."""
        seq = req.seq
        tokens = seq.token_ids[num_before:]
        text = req.stop.take(final=seq.is_finished)
        req.text_sent += len(text)
        lps = self._release_logprobs(req, everything=seq.is_finished and not req.stop.stopped)
        if seq.is_finished:
            return self.final(req, tokens, text, lps)
        return self._output(req, tokens, text, lps)

    def final(self, req: RequestState, tokens: list[int] = (), text: str = "", lps: list = ()) -> RequestOutput:
        """The request's last output (finished, or aborted: then whatever text was held back goes out too)."""
        tokens, lps = list(tokens), list(lps)
        if req.seq.status is SequenceStatus.FINISHED_ABORTED:
            text += req.stop.take(final=True)
            lps += self._release_logprobs(req, everything=True)
        req.held_logprobs.clear()  # what is left was cut off by a stop string
        return self._output(req, tokens, text, lps)

    @staticmethod
    def _advance_grammar(req: RequestState, token: int) -> bool:
        """Feed the accepted token to the request's grammar; True once the grammar is complete."""
        seq, matcher = req.seq, req.sample.constraint.matcher
        if matcher.num_consumed != seq.num_output_tokens - 1:
            matcher.sync(seq.output_token_ids[:-1])
        if not matcher.accept(token):
            logger.warning("request %s: token %d rejected by its grammar: %s", seq.request_id, token, matcher.error)
        return matcher.is_terminated

    @staticmethod
    def _release_logprobs(req: RequestState, everything: bool) -> list[TokenLogprob]:
        held, out = req.held_logprobs, []
        while held and (everything or held[0][0] < req.text_sent):
            out.append(held.popleft()[1])
        return out

    @staticmethod
    def _output(req: RequestState, tokens: list[int], text: str, lps: list) -> RequestOutput:
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
            stop_string=req.stop.matched if seq.is_finished else None,
        )
