"""Proposers: where draft tokens come from. Cheap next to the target model, wrong as often as they like."""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..sequence import Sequence


class Proposer(ABC):
    """Guesses the next tokens of a request. The target verifies them, so a bad guess costs time, not output."""

    @abstractmethod
    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        """Up to `max_tokens` draft tokens that continue `seq.token_ids` (may be fewer, or none)."""

    def propose_batch(self, seqs: list[Sequence], max_tokens: list[int]) -> list[list[int]]:
        """One call per step for all speculating requests (a draft model batches them)."""
        return [self.propose(s, k) if k > 0 else [] for s, k in zip(seqs, max_tokens)]

    def release(self, seq: Sequence) -> None:  # noqa: B027 - most proposers keep no per-request state
        """The request is gone: drop any per-request state."""


class NgramProposer(Proposer):
    """Prompt lookup: find the latest earlier occurrence of the request's last n tokens (n from max down to
    min) in its own prompt + output, and propose what followed it. No model; wins where the output quotes
    or edits the input."""

    def __init__(self, min_n: int, max_n: int) -> None:  # 1 <= min_n <= max_n (EngineConfig checks)
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        tokens = np.asarray(seq.token_ids)
        n_tok = len(tokens)
        for n in range(min(self.max_n, n_tok - 1), self.min_n - 1, -1):
            # windows ending before the last token, so every match has at least one token after it
            hits = np.flatnonzero((sliding_window_view(tokens[:-1], n) == tokens[n_tok - n:]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return tokens[start:start + max_tokens].tolist()
        return []
