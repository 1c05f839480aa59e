"""A measured model of what a step costs, so the scheduler can size prefill chunks by time.

    step ms ~= fixed + per_prefill_token * prefill tokens + per_decode * decode sequences
               + per_context_token * context tokens the decodes attend to

fitted online by least squares over the most recent steps the runner actually timed (exponentially
forgotten, so it follows load changes; coefficients kept >= 0). The scheduler asks it the inverse
question: how many prefill tokens fit in this step's time target next to these decodes? Speculative
decoding asks what one more token costs next to a batch of decodes (a draft token being verified is a
multi-token query like a prompt chunk, so it costs `per_prefill_token`).

The default target (`max_step_ms` unset) is DEFAULT_TARGET_FACTOR times the predicted cost of a decode step of
every sequence the scheduler holds (running and waiting, up to its batch limit): the inter-token time the
streams will see anyway once the prompts are in. A running stream's wait for its next token stays within that
multiple while a burst's prompts are prefilled, and the prompts get the rest of every step. The scheduler
applies it only while some stream is decoding (otherwise the token budget rules).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

FEATURES = ("fixed", "prefill_tokens", "decode_seqs", "context_tokens")
MIN_SAMPLES = 8  # fitted only after this many timed steps, some with prefill, some without
WINDOW = 256
HALF_LIFE = 64  # steps: older samples weigh half as much
# Step target, in decode steps of the admitted batch: larger lets a burst's prompts prefill in fewer steps (TTFT),
# smaller keeps the streams' token gaps even (TPOT p99 against p50); the sweep that chose it is in docs/performance.md
DEFAULT_TARGET_FACTOR = 4.0


@dataclass(frozen=True, slots=True)
class StepShape:
    """What a step computes, as the cost model sees it."""

    prefill_tokens: int  # tokens of sequences with more than one new token
    decode_seqs: int  # sequences with exactly one new token
    context_tokens: int  # sum of those decodes' context lengths (what their attention reads)

    @classmethod
    def of(cls, num_new_tokens: list[int], context_lens: list[int]) -> StepShape:
        prefill = sum(n for n in num_new_tokens if n > 1)
        decodes = [c for n, c in zip(num_new_tokens, context_lens) if n == 1]
        return cls(prefill, len(decodes), sum(decodes))

    def row(self) -> list[float]:
        return [1.0, float(self.prefill_tokens), float(self.decode_seqs), float(self.context_tokens)]


class StepCostModel:
    """Online least-squares fit of step time; `coef` is None until enough varied steps were seen."""

    def __init__(self) -> None:
        self._samples: deque[tuple[list[float], float]] = deque(maxlen=WINDOW)
        self.reset()

    def reset(self) -> None:
        self._samples.clear()
        self.coef: np.ndarray | None = None
        self._since_fit = 0

    def observe(self, shape: StepShape, ms: float) -> None:
        self._samples.append((shape.row(), ms))
        self._since_fit += 1
        # refit often while young, then every 8 steps (a 4x4 solve: microseconds, but not every step)
        if self._since_fit >= (1 if len(self._samples) < 64 else 8):
            self._fit()

    def _fit(self) -> None:
        self._since_fit = 0
        if len(self._samples) < MIN_SAMPLES:
            return
        x = np.array([r for r, _ in self._samples])
        y = np.array([ms for _, ms in self._samples])
        if not (x[:, 1] > 0).any() or not (x[:, 1] == 0).any():
            return  # prefill cost is not separable from the rest yet
        w = np.sqrt(0.5 ** (np.arange(len(y))[::-1] / HALF_LIFE))
        active = list(range(len(FEATURES)))
        while True:  # drop features whose coefficient comes out negative (noise), refit the rest
            xs = x[:, active] * w[:, None]
            scale = np.sqrt((xs ** 2).sum(0)) + 1e-12  # unit columns: features differ by 1e4 in size
            xn = xs / scale
            sol = np.linalg.solve(xn.T @ xn + 1e-6 * np.eye(len(active)), xn.T @ (y * w)) / scale
            negative = [a for a, c in zip(active, sol) if c < 0]
            if not negative:
                break
            active = [a for a in active if a not in negative]
            if not active:
                return
        coef = np.zeros(len(FEATURES))
        coef[active] = sol
        if coef[1] <= 0:
            return  # prefill looks free: no basis for sizing chunks
        self.coef = coef

    def ms_per_prefill_token(self) -> float | None:
        return None if self.coef is None else float(self.coef[1])

    def decode_ms(self, decode_seqs: int, context_tokens: int) -> float | None:
        """Predicted time of a step of these decodes alone (None: not fitted)."""
        if self.coef is None:
            return None
        return float(np.dot(self.coef, StepShape(0, decode_seqs, context_tokens).row()))

    def default_target_ms(self, decode_seqs: int, context_tokens: int) -> float | None:
        """The step-time target when none is set: DEFAULT_TARGET_FACTOR x a decode step of this batch."""
        base = self.decode_ms(decode_seqs, context_tokens)
        return None if base is None else DEFAULT_TARGET_FACTOR * base

    def prefill_tokens_within(self, target_ms: float | None, decode_seqs: int, context_tokens: int) -> int | None:
        """Most prefill tokens a step with these decodes can take and stay under target_ms (None: no limit
        known)."""
        if self.coef is None or target_ms is None:
            return None
        return max(0, int((target_ms - self.decode_ms(decode_seqs, context_tokens)) / self.coef[1]))

    def extra_token_cost(self, decode_seqs: int, context_tokens: int) -> float | None:
        """One more token in a step of these decodes, as a fraction of that step's time (None: not fitted)."""
        base = self.decode_ms(decode_seqs, context_tokens)
        if base is None or base <= 0:
            return None
        return float(self.coef[1]) / base

    def describe(self) -> str:
        if self.coef is None:
            return "step cost model: not fitted yet"
        return "step cost model: " + ", ".join(f"{n} {c:.4g} ms" for n, c in zip(FEATURES, self.coef))
