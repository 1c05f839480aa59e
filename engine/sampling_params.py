"""Per-request sampling and stopping rules, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .errors import InvalidRequestError

if TYPE_CHECKING:
    from .structured import StructuredSpec

MAX_STOP_STRINGS = 4
# Stop strings are delimiters (role markers, "\n\n", fences); 256 characters covers any real one while
# bounding what each request costs: its stop automaton has at most 4 * 256 nodes, its held-back text < 256.
MAX_STOP_STRING_CHARS = 256
# Below this, 1/temperature overflows the logits to inf (1e-310 sampled garbage): treat it as greedy.
MIN_SAMPLING_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    max_tokens: int | None = 16  # None: up to the model's context length
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # None: off; k >= 0: chosen token's logprob plus the top k
    cache_salt: str | None = None  # requests share prefix-cache blocks only with requests of the same salt
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (max_tokens may be 0)
    structured: StructuredSpec | None = None  # grammar the output must match (engine/structured.py)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100] (OpenAI)
    allowed_token_ids: list[int] | None = None  # only these tokens may be sampled
    # vLLM's request priority, lower first (--scheduling-policy priority). vLLM passes it beside the params; here it
    # rides in them, as cache_salt does, so every path that carries a request's params carries it
    priority: int = 0

    def __post_init__(self) -> None:
        if self.seed is not None and (not isinstance(self.seed, int) or not -2**63 <= self.seed < 2**64):
            raise InvalidRequestError(f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}", "seed")
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            raise InvalidRequestError(f"priority must be an integer, got {self.priority!r}", "priority")
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise InvalidRequestError(f"cache_salt must be a string, got {self.cache_salt!r}", "cache_salt")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        floor = 0 if self.prompt_logprobs is not None else 1  # 0: score the prompt, generate nothing
        if self.max_tokens is not None and self.max_tokens < floor:
            raise InvalidRequestError(f"max_tokens must be at least {floor}"
                                      f"{' (0 only with prompt_logprobs)' if floor else ''}, got {self.max_tokens}",
                                      "max_tokens")
        if not 0.0 <= self.temperature <= 2.0:
            raise InvalidRequestError(f"temperature must be in [0, 2], got {self.temperature}", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < -1:
            raise InvalidRequestError(f"top_k must be -1, 0 (off) or positive, got {self.top_k}", "top_k")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError(f"at most {MAX_STOP_STRINGS} stop sequences are allowed, got {len(self.stop)}",
                                      "stop")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop sequences must be non-empty strings", "stop")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise InvalidRequestError(f"stop sequences may be at most {MAX_STOP_STRING_CHARS} characters long",
                                      "stop")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {getattr(self, name)}", name)
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= 20:
                raise InvalidRequestError(f"{name} must be in [0, 20], got {k}", name)
        if self.logit_bias:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            bad = next((v for v in self.logit_bias.values() if not -100.0 <= v <= 100.0), None)
            if bad is not None:
                raise InvalidRequestError(f"logit_bias values must be in [-100, 100], got {bad}", "logit_bias")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise InvalidRequestError("allowed_token_ids must not be empty", "allowed_token_ids")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_SAMPLING_TEMPERATURE

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
