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
request not yet started); nothing new is admitted that step.

`scheduling_policy="priority"` (vLLM's): each request carries an integer priority, lower runs first. A step is
filled in order of urgency: at each priority, most urgent first, its running sequences, then its waiting ones (in
the order above). When blocks run out, the least urgent running sequence is preempted (the newest among equals),
even one already given tokens this step (it gives them back), and nothing new is admitted after that in the step.
A waiting request that finds no free seat or KV blocks preempts running sequences strictly less urgent than
itself, least urgent first; they are not readmitted before the next step. With one priority for all it schedules
exactly as fcfs. There is no aging: a steady stream of urgent requests starves less urgent ones (as in vLLM).
Pure Python: tested without a model.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .config import SchedulerConfig
from .sequence import Sequence, SequenceStatus, StopMatch
from .step_cost import StepCostModel

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
    started: list[Sequence] = field(default_factory=list)  # of which scheduled for the very first time
    # waiting sequences, never scheduled yet, that hold a seat: a free sequence slot and free KV blocks for their
    # whole prompt are there for them, and only this step's token budgets keep their prefill for a later step
    seated: list[Sequence] = field(default_factory=list)


@dataclass(slots=True)
class _Budget:
    """What is left of a step's budgets as it is filled."""

    tokens: int  # of max_num_batched_tokens
    prefill: int  # prompt tokens within the step-time target


@dataclass(slots=True)
class SchedulerStats:
    num_preemptions: int = 0
    prompt_tokens_computed: int = 0  # prompt tokens that went through the model (not cache hits)
    generation_tokens: int = 0
    prefix_cache_queries: int = 0  # tokens looked up at admission
    prefix_cache_hits: int = 0  # of which found in the cache


def check_stop(seq: Sequence, match: StopMatch | None = None) -> SequenceStatus | None:
    """Whether `seq` ends after the token just appended (a prompt-only request: after its prompt), and why. The one
    place a finish is decided; only an abort (the client's decision) ends a request otherwise.

    In this order: a prompt-only request (max_tokens=0) is done ("length"); a stop string (`match`, from the output
    processor), EOS or a stop token ends it as "stop", even on the last allowed token; max_tokens as "length"; a
    complete grammar as "stop" only before that."""
    if seq.max_tokens == 0:
        return SequenceStatus.FINISHED_LENGTH
    if match is StopMatch.STOP_STRING:
        return SequenceStatus.FINISHED_STOPPED
    last = seq.token_ids[-1]
    if (not seq.params.ignore_eos and last in seq.eos_token_ids) or last in seq.params.stop_token_ids:
        return SequenceStatus.FINISHED_STOPPED
    if seq.num_output_tokens >= seq.max_tokens:
        return SequenceStatus.FINISHED_LENGTH
    if match is StopMatch.GRAMMAR_COMPLETE:
        return SequenceStatus.FINISHED_STOPPED
    return None


# Reads a token just appended to a sequence (the output processor: text, stop strings, grammar)
Observe = Callable[[Sequence, int], StopMatch | None]


def append_until_stop(seq: Sequence, tokens: list[int], observe: Observe | None = None) -> SequenceStatus | None:
    """Append a step's tokens to `seq` one by one, each read by `observe` and then judged by `check_stop`: the first
    that ends the request is its last (accepted drafts after it never happened). A prompt-only request appends
    nothing. Returns how it ended, or None."""
    for t in tokens:
        match = None
        if seq.max_tokens:
            seq.append_token(t)
            match = observe(seq, t) if observe is not None else None
        if (status := check_stop(seq, match)) is not None:
            return status
    return None


def admission_key(seq: Sequence) -> tuple[bool, float]:
    """Waiting order: preempted sequences first (they had been admitted already), then by deadline."""
    return seq.num_preemptions == 0, seq.deadline


def priority_admission_key(seq: Sequence) -> tuple[int, bool, float]:
    """Waiting order of the priority policy: by priority (lower first), then as fcfs."""
    return seq.params.priority, seq.num_preemptions == 0, seq.deadline


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 cost_model: StepCostModel | None = None) -> None:
        self.config = config
        self.block_manager = block_manager
        self.cost_model = cost_model
        self.by_priority = config.scheduling_policy == "priority"
        self.key = priority_admission_key if self.by_priority else admission_key
        self.waiting: list[Sequence] = []  # by self.key
        self.running: list[Sequence] = []
        self.stats = SchedulerStats()

    # ---- queue operations ------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        if seq.deadline is None:
            per_token = self.cost_model.ms_per_prefill_token() if self.cost_model is not None else None
            seq.deadline = seq.arrival_time + seq.num_tokens * (per_token or DEFAULT_PREFILL_MS_PER_TOKEN) / 1e3
        bisect.insort(self.waiting, seq, key=self.key)

    def abort(self, request_id: str) -> Sequence | None:
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.request_id == request_id:
                    self.finish(seq, SequenceStatus.FINISHED_ABORTED, queue)
                    return seq
        return None

    def finish(self, seq: Sequence, status: SequenceStatus, queue: list[Sequence] | None = None) -> None:
        """End a running sequence (as `check_stop` decided), or abort one of `queue`, and release its blocks: the
        only place a sequence's status becomes a finished one."""
        (self.running if queue is None else queue).remove(seq)
        self.block_manager.free(seq)
        seq.status = status
        seq.finish_time = time.monotonic()

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- the step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        left = _Budget(self.config.max_num_batched_tokens, self._prefill_time_budget())
        evicted: list[Sequence] = []  # preempted to make room for a waiting request: they wait for the next step
        # static batching: a new batch forms only when the previous one has fully drained
        admitting = self.config.policy == "continuous" or not self.running
        if not self.by_priority:
            self._schedule_running(out, left)
            if admitting and out.num_preempted == 0:
                self._admit(out, left, evicted)
            return self._seat(out)
        # The priority policy fills the step in order of urgency: at each priority, most urgent first, the running
        # sequences, then the waiting ones. With one priority for all, that is fcfs's order.
        seen: set[int] = set()
        while True:
            level = self.waiting[0].params.priority if admitting and self.waiting else None
            preempted = out.num_preempted
            self._schedule_running(out, left, seen, level)
            if level is None:
                return self._seat(out)
            if out.num_preempted > preempted:  # blocks ran out: nothing new is admitted in this step
                admitting = False
                continue
            admitting = self._admit(out, left, evicted, level)
            seen.update(id(s) for s in out.seqs)  # those just admitted have had their share

    def _schedule_running(self, out: SchedulerOutput, left: _Budget, seen: set[int] | None = None,
                          level: int | None = None) -> None:
        """Running sequences in order, each as many of its tokens as the budgets allow; when blocks run out,
        `_victim` is preempted. Priority policy: only those of at most `level` (all: None) not `seen` yet, which
        then are."""
        bm = self.block_manager
        i = 0
        while i < len(self.running) and left.tokens > 0:
            seq = self.running[i]
            if seen is not None:
                if id(seq) in seen or (level is not None and seq.params.priority > level):
                    i += 1
                    continue
                seen.add(id(seq))
            n = min(seq.num_tokens - seq.num_computed_tokens, left.tokens)
            if n > 1:  # a prompt chunk (drafts are added below, to decodes only): sized by the step-time budget
                if left.prefill <= 0:
                    i += 1
                    continue
                n = min(n, left.prefill)
                left.prefill -= n
            if seq.spec_token_ids:  # drafts ride along within the budget, and never cause a preemption
                whole = n == seq.num_tokens - seq.num_computed_tokens
                k = min(len(seq.spec_token_ids), left.tokens - n) if whole else 0
                if k and not bm.can_allocate(seq, n + k):
                    k = 0
                del seq.spec_token_ids[k:]
                n += k
            while not bm.can_allocate(seq, n):
                victim = self._victim()
                if next(j for j, s in enumerate(self.running) if s is victim) < i:
                    i -= 1  # scheduled earlier in this step (priority policy only): it gives its tokens back
                left.tokens += self._preempt_running(out, victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted itself; under fcfs it was the newest, so nothing comes after it
            bm.allocate(seq, n)
            self._emit(out, seq, n)
            left.tokens -= n
            i += 1

    def _admit(self, out: SchedulerOutput, left: _Budget, evicted: list[Sequence], level: int | None = None) -> bool:
        """Waiting sequences in queue order (priority policy: those of priority `level`), while seats, blocks and
        budgets last; nobody overtakes the head. Under the priority policy the head takes a seat or blocks from
        running sequences strictly less urgent than it. True if it stopped only at the end of `level`."""
        bm = self.block_manager
        while self.waiting:
            if (left.tokens <= 0 or left.prefill <= 0) and self.config.policy == "continuous":
                return False
            seq = self.waiting[0]
            if level is not None and seq.params.priority != level:
                return True
            if any(seq is v for v in evicted):
                return False
            if len(self.running) >= self.config.max_num_seqs:
                victim = self._victim(less_urgent_than=seq)
                if victim is None:
                    return False
                left.tokens += self._preempt_running(out, victim)
                evicted.append(victim)
                continue
            # prompt logprobs need every prompt position computed: no prefix-cache hit (as vLLM)
            cached = bm.find_cached_prefix(seq) if seq.params.prompt_logprobs is None else []
            n = min(seq.num_tokens - len(cached) * bm.block_size, left.tokens)
            n = min(n, left.prefill) if n > 1 else n
            while not bm.can_allocate(seq, n, cached) and (victim := self._victim(less_urgent_than=seq)):
                left.tokens += self._preempt_running(out, victim)
                evicted.append(victim)
            if not bm.can_allocate(seq, n, cached):
                return False  # nobody overtakes the head of the queue
            left.prefill -= n
            self.waiting.pop(0)
            out.num_admitted += 1
            bm.allocate(seq, n, cached)
            seq.num_cached_tokens = len(cached) * bm.block_size
            self.stats.prefix_cache_queries += seq.num_tokens
            self.stats.prefix_cache_hits += seq.num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
                out.started.append(seq)
            self.running.append(seq)
            if n > 0:
                self._emit(out, seq, n)
                left.tokens -= n
        return False

    def _seat(self, out: SchedulerOutput) -> SchedulerOutput:
        """Fill `out.seated`: the head of the queue, in order, as far as free seats and free blocks (for whole prompts,
        no cache hit counted) reach. Their wait from here is only for the prefill of the prompts ahead of them, as
        in llama.cpp's slots: a server's queue-wait bound counts them as started. Nobody while a static batch runs."""
        if self.config.policy != "continuous" and self.running:
            return out
        seats = self.config.max_num_seqs - len(self.running)
        free = self.free_blocks_after_running_prompts()
        for seq in self.waiting[:max(0, seats)]:
            free -= self.block_manager.blocks_needed(seq, seq.num_tokens)
            if free < 0:
                break
            if seq.first_scheduled_time is None:
                out.seated.append(seq)
        return out

    def free_blocks_after_running_prompts(self) -> int:
        """Free blocks less those the running sequences' unfinished prompts will still take. Any thread (an estimate
        while another thread steps)."""
        bm = self.block_manager
        return bm.num_free_blocks - sum(bm.blocks_needed(s, s.num_tokens - s.num_computed_tokens)
                                        for s in list(self.running))

    def _victim(self, less_urgent_than: Sequence | None = None) -> Sequence | None:
        """The running sequence to preempt. When blocks run out: fcfs's newest, or the priority policy's least
        urgent (the newest among equals). To make room for the waiting `less_urgent_than` (priority policy only):
        that sequence if it is strictly less urgent, else None."""
        if not self.by_priority:
            return self.running[-1] if less_urgent_than is None else None
        victim = max(reversed(self.running), key=lambda s: s.params.priority, default=None)
        if less_urgent_than is not None and (victim is None or
                                             victim.params.priority <= less_urgent_than.params.priority):
            return None
        return victim

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

    def _preempt_running(self, out: SchedulerOutput, seq: Sequence) -> int:
        """Preempt a running sequence, taking back what this step already gave it; returns those tokens."""
        self.running.remove(seq)
        out.num_preempted += 1
        n = 0
        for i, s in enumerate(out.seqs):
            if s is seq:
                n = out.num_new_tokens[i]
                self.stats.prompt_tokens_computed -= min(n, max(0, seq.num_prompt_tokens - seq.num_computed_tokens))
                del out.seqs[i], out.num_new_tokens[i], out.sample[i]
                break
        if any(s is seq for s in out.started):  # admitted in this very step: it has not started after all
            out.started.remove(seq)
            seq.first_scheduled_time = None
        self._preempt(seq)
        return n

    def _preempt(self, seq: Sequence) -> None:
        """Free everything and requeue ahead of the unstarted; it is recomputed (prefix cache permitting)."""
        self.block_manager.free(seq)
        seq.spec_token_ids.clear()
        seq.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.add(seq)

    def update(self, out: SchedulerOutput, sampled: list[int | list[int] | None],
               observe: Observe | None = None) -> list[Sequence]:
        """The step's postprocessing: advance computed counts, append sampled tokens (each read by `observe`),
        finish the sequences `check_stop` ends and release their blocks.

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
            before = seq.num_tokens
            status = append_until_stop(seq, tokens, observe)
            self.stats.generation_tokens += seq.num_tokens - before
            got_token.append(seq)
            if status is not None:
                self.finish(seq, status)
            elif drafts:
                self.block_manager.publish_full_blocks(seq)
                self.block_manager.free_tail(seq, seq.num_tokens)
        return got_token
