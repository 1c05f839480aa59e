"""One request's state as the scheduler and block manager see it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from .sampling_params import SamplingParams


class StopMatch(enum.Enum):
    """What the output processor read in a new token that may end its request; the scheduler's `check_stop`
    decides whether it does."""

    STOP_STRING = "stop_string"  # a stop string ends within this token's text: nothing after it is output
    GRAMMAR_COMPLETE = "grammar_complete"  # the request's grammar allows no token but EOS after this one


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"


@dataclass(slots=True)
class Sequence:
    """Token ids (prompt + output) and how many of them have K/V in the cache.

    vLLM v1's form: there are no prefill/decode phases. Each step the scheduler lets
    `num_computed_tokens` catch up with `num_tokens`; a token is sampled when they meet.
    """

    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved against the context length
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    # admission order (scheduler): arrival + the prompt's estimated prefill time, set when first queued
    deadline: float | None = None

    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit at the last admission
    block_table: list[int] = field(default_factory=list)
    # chained digests of its full blocks, computed once: tokens are only appended, so they outlive preemption
    block_digests: list[bytes] = field(default_factory=list)
    num_published_blocks: int = 0  # leading blocks of `block_table` already offered to the prefix cache
    status: SequenceStatus = SequenceStatus.WAITING
    num_preemptions: int = 0
    # speculative decoding: draft tokens scheduled after the known ones, verified by the next forward pass
    spec_token_ids: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0  # drafted and verified so far
    num_accepted_tokens: int = 0  # of which the target accepted
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def is_finished(self) -> bool:
        return self.status is not SequenceStatus.WAITING and self.status is not SequenceStatus.RUNNING

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
