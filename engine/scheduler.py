"""Token-granularity scheduler: who runs this step, and how many of their tokens.

Each step: running sequences first (oldest first), then waiting ones are admitted in deadline order,
within `max_num_seqs` sequences and `max_num_batched_tokens` tokens. A waiting request's deadline is its
arrival time plus its prompt's estimated prefill time (the step-cost model's measured ms per prompt token),
fixed when it is queued: among requests that arrive together the shortest prompt goes first, which is what
brings the median time to first token down in a burst. A request is only ever overtaken by requests that
arrived before its deadline, so arrivals cannot starve a long prompt: everything queued after its deadline
waits behind it. Nobody overtakes the head of the queue when it does not fit.
A sequence's share is `min(num_tokens - num_computed_tokens, budget left)`, so long prompts are prefilled
in chunks and prefill and decode share a step. Prefill tokens also have a time budget: with a fitted
step-cost model (engine/step_cost.py) a step takes only as many as fit in the step-time target next to
its decodes (the target is what a running stream waits for its next token: by default a multiple of what a
decode step of every admitted and waiting sequence will cost), but always at least MIN_PREFILL_TOKENS, oldest
prompt first, so no prompt starves (a running prompt that finds the time budget spent sits the step out).
When blocks run out the newest running sequence is preempted (blocks freed, recomputed later ahead of every
request not yet started); nothing new is admitted that step. Pure Python: tested without a model.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from pagedserve.engine.block_manager import BlockManager
from pagedserve.engine.config import SchedulerConfig
from pagedserve.engine.sequence import Sequence, SequenceStatus
from pagedserve.engine.step_cost import StepCostModel

MIN_PREFILL_TOKENS = 32  # per step, whatever the time target: prompts always advance
# A deadline's prefill estimate before the cost model has timed any prefill: a CPU's order of magnitude
DEFAULT_PREFILL_MS_PER_TOKEN = 1.0


@dataclass(slots=True)
class SchedulerOutput:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    # True where this step computes the sequence's last known token, so the model must sample one
    sample: list[bool] = field(default_factory=list)
    num_preempted: int = 0
    num_admitted: int = 0  # waiting sequences that started (or restarted after preemption) this step


@dataclass(slots=True)
class SchedulerStats:
    num_preemptions: int = 0
    prompt_tokens_computed: int = 0  # prompt tokens that went through the model (not cache hits)
    generation_tokens: int = 0
    prefix_cache_queries: int = 0  # tokens looked up at admission
    prefix_cache_hits: int = 0  # of which found in the cache


def admission_key(seq: Sequence) -> tuple[bool, float]:
    """Waiting order: preempted sequences first (they had been admitted already), then by deadline."""
    return seq.num_preemptions == 0, seq.deadline


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 cost_model: StepCostModel | None = None) -> None:
        self.config = config
        self.block_manager = block_manager
        self.cost_model = cost_model
        self.waiting: list[Sequence] = []  # by admission_key
        self.running: list[Sequence] = []
        self.stats = SchedulerStats()

    # ---- queue operations ------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        if seq.deadline is None:
            per_token = self.cost_model.ms_per_prefill_token() if self.cost_model is not None else None
            seq.deadline = seq.arrival_time + seq.num_tokens * (per_token or DEFAULT_PREFILL_MS_PER_TOKEN) / 1e3
        bisect.insort(self.waiting, seq, key=admission_key)

    def abort(self, request_id: str) -> Sequence | None:
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.request_id == request_id:
                    self.finish(seq, SequenceStatus.FINISHED_ABORTED, queue)
                    return seq
        return None

    def finish(self, seq: Sequence, status: SequenceStatus, queue: list[Sequence] | None = None) -> None:
        """End a running sequence (EOS, stop string, length), or abort one of `queue`, and release its blocks."""
        (self.running if queue is None else queue).remove(seq)
        self.block_manager.free(seq)
        seq.status = status
        seq.finish_time = time.monotonic()

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- the step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        prefill_budget = self._prefill_time_budget()
        bm = self.block_manager

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if n > 1:  # a prompt chunk (drafts are added below, to decodes only): sized by the step-time budget
                if prefill_budget <= 0:
                    i += 1
                    continue
                n = min(n, prefill_budget)
                prefill_budget -= n
            if seq.spec_token_ids:  # drafts ride along within the budget, and never cause a preemption
                k = min(len(seq.spec_token_ids), budget - n) if n == seq.num_tokens - seq.num_computed_tokens else 0
                if k and not bm.can_allocate(seq, n + k):
                    k = 0
                del seq.spec_token_ids[k:]
                n += k
            while not bm.can_allocate(seq, n):
                victim = self.running.pop()  # the newest
                self._preempt(victim)
                out.num_preempted += 1
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break  # preempted itself: it was the newest, nothing after it
            bm.allocate(seq, n)
            self._emit(out, seq, n)
            budget -= n
            i += 1

        # static batching: a new batch forms only when the previous one has fully drained
        if out.num_preempted == 0 and (self.config.policy == "continuous" or not self.running):
            while self.waiting and len(self.running) < self.config.max_num_seqs:
                if (budget <= 0 or prefill_budget <= 0) and self.config.policy == "continuous":
                    break
                seq = self.waiting[0]
                # prompt logprobs need every prompt position computed: no prefix-cache hit (as vLLM)
                cached = bm.find_cached_prefix(seq) if seq.params.prompt_logprobs is None else []
                n = min(seq.num_tokens - len(cached) * bm.block_size, budget)
                n = min(n, prefill_budget) if n > 1 else n
                prefill_budget -= n
                if not bm.can_allocate(seq, n, cached):
                    break  # nobody overtakes the head of the queue
                self.waiting.pop(0)
                out.num_admitted += 1
                bm.allocate(seq, n, cached)
                seq.num_cached_tokens = len(cached) * bm.block_size
                self.stats.prefix_cache_queries += seq.num_tokens
                self.stats.prefix_cache_hits += seq.num_cached_tokens
                seq.status = SequenceStatus.RUNNING
                if seq.first_scheduled_time is None:
                    seq.first_scheduled_time = time.monotonic()
                self.running.append(seq)
                if n > 0:
                    self._emit(out, seq, n)
                    budget -= n
        return out

    def _prefill_time_budget(self) -> int:
        """Prefill tokens that fit in this step's time target next to its decodes (no limit: the token budget)."""
        target = self.config.max_step_ms
        unlimited = self.config.max_num_batched_tokens
        if self.cost_model is None or target == 0 or self.config.policy != "continuous":
            return unlimited
        decodes = [s.num_tokens for s in self.running if s.num_tokens - s.num_computed_tokens == 1]
        if target is None:
            if not decodes:
                return unlimited  # no stream is waiting for a token: nothing to protect
            # Sized by the batch this burst is heading for, not by the few streams running yet: with two
            # running, twice their cost is a sliver, and a burst's prompts would crawl in behind them.
            batch = self.running + self.waiting[:max(0, self.config.max_num_seqs - len(self.running))]
            target = self.cost_model.default_target_ms(len(batch), sum(s.num_tokens for s in batch))
        fit = self.cost_model.prefill_tokens_within(target, len(decodes), sum(decodes))
        return unlimited if fit is None else max(fit, MIN_PREFILL_TOKENS)

    def _emit(self, out: SchedulerOutput, seq: Sequence, n: int) -> None:
        out.seqs.append(seq)
        out.num_new_tokens.append(n)
        out.sample.append(seq.num_computed_tokens + n >= seq.num_tokens)
        self.stats.prompt_tokens_computed += min(n, max(0, seq.num_prompt_tokens - seq.num_computed_tokens))

    def _preempt(self, seq: Sequence) -> None:
        """Free everything and requeue ahead of the unstarted; it is recomputed (prefix cache permitting)."""
        self.block_manager.free(seq)
        seq.spec_token_ids.clear()
        seq.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.add(seq)

    def update(self, out: SchedulerOutput, sampled: list[int | list[int] | None]) -> list[Sequence]:
        """Advance computed counts, append sampled tokens, finish on token-level stops.

        A speculating sequence gets a list: its accepted draft tokens plus one token of the target's own.
        Rejected drafts are rolled back from `num_computed_tokens` and their blocks given back.
        Returns the sequences that received a token this step (finished ones included).
        """
        got_token = []
        for seq, n, token in zip(out.seqs, out.num_new_tokens, sampled):
            drafts = len(seq.spec_token_ids)
            if not drafts:
                seq.num_computed_tokens += n
                self.block_manager.publish_full_blocks(seq)
            if token is None:
                continue
            tokens = [token] if isinstance(token, int) else token
            if drafts:
                seq.num_computed_tokens += n - (drafts - (len(tokens) - 1))  # accepted drafts' K/V is valid
                seq.spec_token_ids.clear()
            status = None
            for t in tokens:
                seq.append_token(t)
                self.stats.generation_tokens += 1
                status = seq.check_stop_token()
                if status is not None:
                    break  # anything after a stop token is dropped
            got_token.append(seq)
            if status is not None:
                self.finish(seq, status)
            elif drafts:
                self.block_manager.publish_full_blocks(seq)
                self.block_manager.free_tail(seq, seq.num_tokens)
        return got_token
