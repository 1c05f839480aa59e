"""`GET /v1/engine/state`: the live view's one JSON document, and the sliding windows its latencies come from.

Counts and ids only: no prompt or output text, no token ids, no prefix digests. With API keys, a key sees its own
requests' ids; other tenants' sequences appear by their engine sequence number alone (their blocks still count:
the pool is shared memory, and how full it is is everyone's business).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel, Field

from ..engine.output_processor import RequestOutput
from ..engine.snapshot import CACHED, FREE, SHARED, USED, EngineSnapshot
from ..engine.spec_decode import SpecStats

LATENCY_WINDOW_S = 60.0  # TTFT / TPOT percentiles over the requests of the last minute
RATE_WINDOW_S = 5.0  # tokens/s over the last few seconds: live, yet not one step's noise
MAX_SAMPLES = 4096  # per window, whatever the traffic: the view costs bounded memory


class LiveWindow:
    """Recent token counts, TTFTs and TPOTs, fed with each step's outputs on the event loop (a few appends)."""

    def __init__(self) -> None:
        self.tokens: deque[tuple[float, int]] = deque(maxlen=MAX_SAMPLES)
        self.ttft: deque[tuple[float, float]] = deque(maxlen=MAX_SAMPLES)
        self.tpot: deque[tuple[float, float]] = deque(maxlen=MAX_SAMPLES)

    def observe(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        n = 0
        for out in outputs:
            k = len(out.new_token_ids)
            n += k
            m = out.metrics
            if k and out.num_output_tokens == k and m.ttft is not None:  # its first tokens
                self.ttft.append((now, m.ttft))
            if out.finished and out.num_output_tokens > 1 and m.first_token_time is not None \
                    and m.finish_time is not None:
                self.tpot.append((now, (m.finish_time - m.first_token_time) / (out.num_output_tokens - 1)))
        if n:
            self.tokens.append((now, n))

    def tokens_per_s(self, now: float) -> float:
        return sum(n for t, n in self.tokens if t >= now - RATE_WINDOW_S) / RATE_WINDOW_S

    @staticmethod
    def recent(samples: deque[tuple[float, float]], now: float) -> list[float]:
        return [v for t, v in samples if t >= now - LATENCY_WINDOW_S]


class Percentiles(BaseModel):
    count: int
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None

    @classmethod
    def of(cls, values: list[float], scale: float = 1e3) -> Percentiles:
        if not values:
            return cls(count=0)
        # (statistics.quantiles needs two values; of one value twice, every percentile is that value)
        q = statistics.quantiles(values * 2 if len(values) == 1 else values, n=100, method="inclusive")
        return cls(count=len(values), p50=q[49] * scale, p90=q[89] * scale, p99=q[98] * scale)


class StepState(BaseModel):  # the engine's StepRecord, field for field
    index: int = Field(description="steps run so far")
    ms: float = Field(description="the last step's forward pass and sampling")
    budget_tokens: int = Field(description="the step's token budget (max_num_batched_tokens)")
    prefill_tokens: int
    decode_tokens: int
    num_seqs: int
    num_admitted: int = Field(description="waiting requests that started in that step")
    num_preempted: int


class SequenceState(BaseModel):
    seq_id: int = Field(description="the engine's sequence number (colours the pool)")
    request_id: str | None = Field(description="only for the caller's own requests")
    mine: bool
    status: Literal["running", "waiting"]
    prompt_tokens: int
    output_tokens: int
    computed_tokens: int
    cached_tokens: int = Field(description="prefix-cache hit at admission")
    preemptions: int
    constrained: bool
    blocks: list[int] = Field(description="its block table: KV block ids in order")


class KVState(BaseModel):
    num_blocks: int
    block_size: int
    used: int = Field(description="blocks held by exactly one sequence")
    shared: int = Field(description="blocks held by several sequences (a common prefix)")
    cached: int = Field(description="unreferenced blocks that keep a prefix for a later hit")
    free: int
    usage: float = Field(description="(used + shared) / num_blocks")
    pool: str = Field(description=f"one character per block id: '{FREE}' free, '{CACHED}' cached, '{USED}' used, "
                                  f"'{SHARED}' shared")


class PrefixCacheState(BaseModel):
    queries: int = Field(description="prompt tokens looked up")
    hits: int
    hit_rate: float | None


class SpecDecodeState(BaseModel):
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: float | None


class EngineState(BaseModel):
    object: Literal["engine.state"] = "engine.state"
    model: str
    running: int
    waiting: int
    preempted: int = Field(description="waiting requests that had been running (recomputed when resumed)")
    num_preemptions: int = Field(description="since start")
    constrained: int = Field(description="live requests whose output a grammar constrains")
    rejected_429: int = Field(description="requests refused as overloaded since start")
    tokens_per_s: float = Field(description=f"generated tokens per second over the last {RATE_WINDOW_S:g} s")
    ttft_ms: Percentiles = Field(description=f"time to first token, requests of the last {LATENCY_WINDOW_S:g} s")
    tpot_ms: Percentiles = Field(description=f"time per output token, requests of the last {LATENCY_WINDOW_S:g} s")
    step: StepState | None
    kv: KVState
    prefix_cache: PrefixCacheState
    spec_decode: SpecDecodeState | None
    sequences: list[SequenceState]


def engine_state(snap: EngineSnapshot, model: str, tenant: str | None, tenant_of: Callable[[str], str | None],
                 live: LiveWindow, rejected_429: int, spec: SpecStats | None) -> EngineState:
    """The document for one caller: `tenant` is its API key's id (None without keys), `tenant_of` maps a live request
    id to its submitter's (EngineClient.tenant_of)."""
    now = time.monotonic()
    seqs = [SequenceState(seq_id=s.seq_id, request_id=s.request_id if tenant_of(s.request_id) == tenant else None,
                          mine=tenant_of(s.request_id) == tenant, status="running" if s.running else "waiting",
                          prompt_tokens=s.num_prompt_tokens, output_tokens=s.num_output_tokens,
                          computed_tokens=s.num_computed_tokens, cached_tokens=s.num_cached_tokens,
                          preemptions=s.num_preemptions, constrained=s.constrained, blocks=list(s.block_table))
            for s in snap.sequences]
    used, shared = snap.count(USED), snap.count(SHARED)
    waiting = [s for s in snap.sequences if not s.running]
    return EngineState(
        model=model, running=len(seqs) - len(waiting), waiting=len(waiting) + snap.num_inbox,
        preempted=sum(1 for s in waiting if s.num_preemptions), num_preemptions=snap.num_preemptions,
        constrained=sum(1 for s in snap.sequences if s.constrained), rejected_429=rejected_429,
        tokens_per_s=live.tokens_per_s(now), ttft_ms=Percentiles.of(live.recent(live.ttft, now)),
        tpot_ms=Percentiles.of(live.recent(live.tpot, now)),
        step=None if snap.step is None else StepState.model_validate(snap.step, from_attributes=True),
        kv=KVState(num_blocks=snap.num_blocks, block_size=snap.block_size, used=used, shared=shared,
                   cached=snap.count(CACHED), free=snap.count(FREE), usage=(used + shared) / snap.num_blocks,
                   pool=snap.pool),
        prefix_cache=PrefixCacheState(queries=snap.prefix_cache_queries, hits=snap.prefix_cache_hits,
                                      hit_rate=snap.prefix_cache_hits / snap.prefix_cache_queries
                                      if snap.prefix_cache_queries else None),
        spec_decode=None if spec is None else SpecDecodeState(
            drafts=spec.num_drafts, draft_tokens=spec.num_draft_tokens, accepted_tokens=spec.num_accepted_tokens,
            acceptance_rate=spec.acceptance_rate),
        sequences=seqs)
