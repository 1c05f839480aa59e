"""What the engine is doing right now, for a live view: who holds which KV blocks, the last step's shape.

Counts and ids only: no token ids, no text, no prefix digests. `take` reads the scheduler and the block manager, so
it runs on the thread that steps, between two steps (AsyncEngine asks its loop for one; nothing is built unless
someone asks), where the block manager's books balance.
"""

from __future__ import annotations

from dataclasses import dataclass

from .block_manager import BlockManager
from .scheduler import Scheduler
from .sequence import Sequence

# One character per block in `EngineSnapshot.pool`: a compact picture of the pool (a 100k-block GPU pool is 100 kB)
FREE, CACHED, USED, SHARED = ".", "c", "u", "s"


@dataclass(frozen=True, slots=True)
class StepRecord:
    """The shape of one engine step: what filled its token budget."""

    index: int  # steps run so far, this one included
    ms: float  # the forward pass and sampling
    budget_tokens: int  # max_num_batched_tokens
    prefill_tokens: int  # prompt tokens computed (chunks, recomputation after preemption)
    decode_tokens: int  # one per decoding sequence, plus its draft tokens when speculating
    num_seqs: int
    num_admitted: int  # waiting requests that started this step
    num_preempted: int


@dataclass(frozen=True, slots=True)
class SequenceSnapshot:
    seq_id: int
    request_id: str
    running: bool  # else waiting (queued, or preempted and waiting to be recomputed)
    num_prompt_tokens: int
    num_output_tokens: int
    num_computed_tokens: int
    num_cached_tokens: int  # prefix-cache hit at its last admission
    num_preemptions: int
    constrained: bool  # a grammar (JSON schema, tools, regex) masks its tokens
    block_table: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    num_blocks: int
    block_size: int
    pool: str  # FREE / CACHED / USED / SHARED per block id
    sequences: tuple[SequenceSnapshot, ...]  # running (oldest first), then waiting (in admission order)
    num_inbox: int  # added since the last step, not yet seen by the scheduler
    num_preemptions: int  # since start
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int
    step: StepRecord | None  # the last step that ran a batch

    def count(self, state: str) -> int:
        return self.pool.count(state)


def _sequence(seq: Sequence, running: bool) -> SequenceSnapshot:
    return SequenceSnapshot(seq.seq_id, seq.request_id, running, seq.num_prompt_tokens, seq.num_output_tokens,
                            seq.num_computed_tokens, seq.num_cached_tokens, seq.num_preemptions,
                            seq.params.structured is not None, tuple(seq.block_table))


def pool_picture(bm: BlockManager, seqs: list[Sequence]) -> str:
    """FREE / CACHED / USED / SHARED per block. O(blocks): free-queue entries, then the live block tables."""
    pool = bytearray(FREE.encode() * bm.num_blocks)
    blocks = bm.blocks
    for b in bm.cached_free_blocks():
        pool[b] = ord(CACHED)
    used, shared = ord(USED), ord(SHARED)
    for seq in seqs:
        for b in seq.block_table:
            pool[b] = shared if blocks[b].ref_count > 1 else used
    return pool.decode()


def take(scheduler: Scheduler, num_inbox: int, step: StepRecord | None) -> EngineSnapshot:
    """The snapshot; call it from the stepping thread, between steps."""
    bm, stats = scheduler.block_manager, scheduler.stats
    seqs = [_sequence(s, True) for s in scheduler.running] + [_sequence(s, False) for s in scheduler.waiting]
    return EngineSnapshot(bm.num_blocks, bm.block_size,
                          pool_picture(bm, scheduler.running + scheduler.waiting), tuple(seqs), num_inbox,
                          stats.num_preemptions, stats.prefix_cache_queries, stats.prefix_cache_hits, step)
