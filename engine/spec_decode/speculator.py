"""Speculative decoding's control loop: who speculates this step, how far (adaptive γ), and the counters.

γ is chosen per request from the chapter's formula. With per-token acceptance α, a verification pass
of γ drafts yields (1 − α^(γ+1)) / (1 − α) tokens in expectation; it costs one target step plus γ
draft steps (each a fraction c of a target step) plus γ extra tokens in the target's batch (each a
fraction e of the step, from a linear fit of measured step times against scheduled tokens). γ maximises

    speed-up(γ) = (1 − α^(γ+1)) / (1 − α) / (1 + γ·c + γ·e)

and γ = 0 (no speculation) wins unless some γ beats 1. α is estimated online per request (decayed
counts, prior = the engine-wide rate); a request switched off is probed again with γ = 1 after a
back-off that doubles while probes keep failing, so a change of regime (prose → quoting) is noticed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..sequence import Sequence
from ..step_cost import StepCostModel
from .proposer import Proposer

ALPHA_PRIOR = 0.5  # before anything is measured
PRIOR_WEIGHT = 2.0  # pseudo-trials of the engine-wide rate in a request's estimate
DECAY = 0.8  # per verification: acceptance drifts within a request (quoting, then free text)
EXTRA_TOKEN_COST_PRIOR = 0.05  # fraction of a step per extra token until the cost model is fitted
MAX_BACKOFF = 64


def expected_tokens(alpha: float, gamma: int) -> float:
    """Tokens per verification pass: the accepted drafts plus the target's own."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def speedup(alpha: float, gamma: int, draft_cost: float, extra_token_cost: float) -> float:
    return expected_tokens(alpha, gamma) / (1.0 + gamma * (draft_cost + extra_token_cost))


def best_gamma(alpha: float, max_gamma: int, draft_cost: float, extra_token_cost: float,
               margin: float = 0.02) -> int:
    """argmax of the speed-up over 0..max_gamma; 0 unless speculating beats plain decoding by `margin`."""
    best, best_s = 0, 1.0 + margin
    for g in range(1, max_gamma + 1):
        s = speedup(alpha, g, draft_cost, extra_token_cost)
        if s > best_s:
            best, best_s = g, s
    return best


@dataclass(slots=True)
class _RequestState:
    accepted: float = 0.0  # decayed counts
    trials: float = 0.0
    skip: int = 0  # steps left before the next probe
    backoff: int = 1


@dataclass
class SpecStats:
    """Counters under vLLM's meaning: a draft is one proposal of ≥ 1 tokens for one request."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens per verification pass, the target's own included (vLLM's definition)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None


class Speculator:
    def __init__(self, proposer: Proposer, max_gamma: int, cost: StepCostModel | None = None) -> None:
        self.proposer = proposer
        self.max_gamma = max_gamma  # >= 1 (EngineConfig checks)
        self.adaptive = True  # tests and benchmarks switch it off to draft at every step
        self.stats = SpecStats(accepted_per_pos=[0] * max_gamma)
        self.cost = cost or StepCostModel()  # the engine's, fed every step's time
        self.draft_cost = 0.0  # c: seconds per draft round / seconds per target step (decayed mean)
        self._requests: dict[int, _RequestState] = {}
        self._global_accepted = 0.0
        self._global_trials = 0.0
        self._last_batch = (1, 0)  # decode sequences and their context tokens in the last decode-only step

    # ---- before scheduling ----------------------------------------------------------------------
    def propose(self, running: list[Sequence]) -> None:
        """Set each running request's draft tokens for this step (empty where it does not speculate)."""
        seqs, gammas = [], []
        for seq in running:
            seq.spec_token_ids = []
            g = self.gamma(seq)
            if g > 0:
                seqs.append(seq)
                gammas.append(g)
        if not seqs:
            return
        t0 = time.perf_counter()
        drafts = self.proposer.propose_batch(seqs, gammas)
        seconds = time.perf_counter() - t0
        for seq, d in zip(seqs, drafts):
            seq.spec_token_ids = list(d)
        step_ms = self.cost.decode_ms(*self._last_batch)
        if step_ms:
            c = seconds * 1e3 / max(gammas) / step_ms
            self.draft_cost = 0.9 * self.draft_cost + 0.1 * c if self.stats.num_drafts else c

    def gamma(self, seq: Sequence) -> int:
        """How many drafts `seq` gets this step (0 = plain decoding)."""
        remaining = seq.max_tokens - seq.num_output_tokens - 1  # drafts past max_tokens would be wasted
        p = seq.params
        if (seq.num_tokens - seq.num_computed_tokens != 1 or remaining < 1 or p.logprobs is not None
                or p.structured is not None or p.logit_bias or p.allowed_token_ids is not None):
            # prefilling; about to end; logprobs are reported per sampled token, not verified ones; token masks
            # (grammar, bias) are applied by the sampler, not by the verifier
            return 0
        cap = min(self.max_gamma, remaining)
        if not self.adaptive:
            return cap
        st = self._requests.setdefault(seq.seq_id, _RequestState())
        if st.skip > 0:
            st.skip -= 1
            return 0
        extra = self.cost.extra_token_cost(*self._last_batch)
        g = best_gamma(self.alpha(seq), cap, self.draft_cost, EXTRA_TOKEN_COST_PRIOR if extra is None else extra)
        if g == 0:  # switched off: probe again later, later still while probes keep failing
            st.skip = st.backoff
            st.backoff = min(2 * st.backoff, MAX_BACKOFF)
            return 1 if st.trials == 0 else 0  # a request's first step always measures
        st.backoff = 1
        return g

    def alpha(self, seq: Sequence) -> float:
        prior = (self._global_accepted + ALPHA_PRIOR * PRIOR_WEIGHT) / (self._global_trials + PRIOR_WEIGHT)
        st = self._requests.get(seq.seq_id)
        if st is None:
            return prior
        return min(0.99, (st.accepted + prior * PRIOR_WEIGHT) / (st.trials + PRIOR_WEIGHT))

    # ---- after the forward pass -------------------------------------------------------------------
    def observe(self, seqs: list[Sequence], num_new_tokens: list[int], sampled: list) -> None:
        """Record acceptance and the step's batch. Call before `Scheduler.update` clears the drafts."""
        decode_only = True
        for seq, n, tokens in zip(seqs, num_new_tokens, sampled):
            k = len(seq.spec_token_ids)
            if n != 1 + k or tokens is None:
                decode_only = False
            if not k or tokens is None:
                continue
            a = len(tokens) - 1
            self.stats.num_drafts += 1
            self.stats.num_draft_tokens += k
            self.stats.num_accepted_tokens += a
            for pos in range(a):
                self.stats.accepted_per_pos[pos] += 1
            seq.num_draft_tokens += k
            seq.num_accepted_tokens += a
            trials = a + (1 if a < k else 0)  # positions actually tested: up to the first rejection
            st = self._requests.setdefault(seq.seq_id, _RequestState())
            st.accepted = DECAY * st.accepted + a
            st.trials = DECAY * st.trials + trials
            self._global_accepted = 0.99 * self._global_accepted + a
            self._global_trials = 0.99 * self._global_trials + trials
        if decode_only and seqs:
            self._last_batch = (len(seqs), sum(s.num_computed_tokens + 1 for s in seqs))

    def release(self, seq: Sequence) -> None:
        self._requests.pop(seq.seq_id, None)
        self.proposer.release(seq)
