"""KV-cache blocks: allocation, ref counts, prefix caching and lazy LRU eviction.

Pure Python, no tensors: the model runner owns the memory, this owns the bookkeeping.

A block is in exactly one of three states:
  used   -- ref_count > 0, owned by one or more live sequences;
  cached -- ref_count == 0 but holds a published prefix (hash set), reusable until evicted;
  free   -- ref_count == 0, no hash.
Cached and free blocks both sit in `_free_queue` in LRU order; taking a block from its head evicts
whatever prefix it held (lazy eviction), so cached blocks cost nothing until memory is needed.
"""

from __future__ import annotations

import hashlib
import os
from array import array
from collections import Counter, OrderedDict
from collections.abc import Sequence as TokenIds
from dataclasses import dataclass, field

from .sequence import Sequence

# Per-process secret root of every digest chain: block keys cannot be predicted, or precomputed for a
# collision, by anyone outside this process.
_ROOT = os.urandom(32)


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None  # chained digest, set once the block is full, computed and published
    parent: bytes | None = None  # the digest it was chained from; compared on a hit with the tokens
    token_ids: tuple[int, ...] = field(default_factory=tuple)


def root_digest(salt: str | None = None, secret: bytes = _ROOT) -> bytes:
    """Start of a chain: `secret` (this process's, unless the caller keeps its own record), mixed with the
    request's cache salt if any.

    Requests with different salts never share a block, even for identical prompts.
    """
    if not salt:
        return secret
    return hashlib.blake2b(salt.encode("utf-8", "surrogatepass"), key=secret, digest_size=32).digest()


def block_digest(parent: bytes, token_ids: tuple[int, ...]) -> bytes:
    """BLAKE2b-256 over the parent's digest and the block's token ids: a hit implies the whole prefix."""
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=32).digest()


def chain_digests(parent: bytes, token_ids: TokenIds[int], block_size: int, start: int, stop: int) -> list[bytes]:
    """Chained digests of full blocks `start` to `stop - 1` of `token_ids`, `parent` being the digest of block
    `start - 1` (the root when `start` is 0).

    The one definition of a prefix's key: the block manager keys its cache with it and the router
    (server/affinity.py) its record of what each replica was sent, so both agree on where prompts diverge.
    """
    out = []
    for i in range(start, stop):
        parent = block_digest(parent, tuple(token_ids[i * block_size:(i + 1) * block_size]))
        out.append(parent)
    return out


def max_hit_blocks(num_tokens: int, block_size: int) -> int:
    """Full blocks a prefix-cache hit may cover for `num_tokens` tokens: never the block of the last token,
    which must be computed to get logits for sampling."""
    return (num_tokens - 1) // block_size


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._hash_to_block: dict[bytes, int] = {}

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (free plus evictable cached)."""
        return len(self._free_queue)

    def cached_free_blocks(self) -> list[int]:
        """Unreferenced blocks that still hold a published prefix (reusable on a hit, evicted when taken)."""
        return [b for b in self._free_queue if self.blocks[b].hash is not None]

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free_queue)

    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_needed(self, seq: Sequence, num_new_tokens: int, num_cached: int = 0) -> int:
        """New blocks for `num_new_tokens` more tokens after a prefix-cache hit of `num_cached` blocks."""
        total = seq.num_computed_tokens + num_cached * self.block_size + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table) - num_cached)

    # ---- prefix cache --------------------------------------------------------------------------
    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix of `seq`'s tokens.

        Never the whole sequence: see `max_hit_blocks`.
        """
        if not self.enable_prefix_caching:
            return []
        max_blocks = max_hit_blocks(seq.num_tokens, self.block_size)
        digests = self.digests(seq, max_blocks)
        hits: list[int] = []
        parent = root_digest(seq.params.cache_salt)
        for i in range(max_blocks):
            block_id = self._hash_to_block.get(digests[i])
            if block_id is None:
                break
            block = self.blocks[block_id]
            # Defence in depth: a digest collision would also have to match the tokens and the parent.
            if block.parent != parent or block.token_ids != self._tokens(seq, i):
                break
            hits.append(block_id)
            parent = digests[i]
        return hits

    def _tokens(self, seq: Sequence, i: int) -> tuple[int, ...]:
        return tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])

    def digests(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """Chained digests of `seq`'s first `num_blocks` full blocks, each computed once and kept on `seq`
        (tokens are only ever appended, so a full block's digest never changes, even across preemption)."""
        cache = seq.block_digests
        if len(cache) < num_blocks:
            parent = cache[-1] if cache else root_digest(seq.params.cache_salt)
            cache.extend(chain_digests(parent, seq.token_ids, self.block_size, len(cache), num_blocks))
        return cache

    # ---- allocation ----------------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, num_new_tokens: int, cached: list[int] = ()) -> bool:
        """Whether `allocate(seq, num_new_tokens, cached)` would succeed."""
        # Cached hits that are currently unreferenced sit in the free queue: taking them shrinks it.
        reclaimed = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        return self.blocks_needed(seq, num_new_tokens, len(cached)) <= len(self._free_queue) - reclaimed

    def allocate(self, seq: Sequence, num_new_tokens: int, cached: list[int] = ()) -> None:
        """Grow `seq`'s block table to hold `num_new_tokens` more tokens (after any `cached` prefix).

        `cached` is what `find_cached_prefix` returned; only valid for a sequence with no blocks yet.
        """
        if cached:
            assert not seq.block_table and seq.num_computed_tokens == 0
            for block_id in cached:
                self._ref(block_id)
                seq.block_table.append(block_id)
            # a hit's blocks are published already, under the digests `find_cached_prefix` just computed
            seq.num_published_blocks = len(cached)
            seq.num_computed_tokens = len(cached) * self.block_size
        for _ in range(self.blocks_needed(seq, num_new_tokens)):
            seq.block_table.append(self._take_free_block())

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free_queue[block_id]
        block.ref_count += 1

    def _take_free_block(self) -> int:
        if not self._free_queue:
            raise RuntimeError("out of KV-cache blocks (the scheduler should have preempted)")
        block_id, _ = self._free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # lazy eviction of a cached prefix
            if self._hash_to_block.get(block.hash) == block_id:
                del self._hash_to_block[block.hash]
            block.hash = block.parent = None
            block.token_ids = ()
        block.ref_count = 1
        return block_id

    def publish_full_blocks(self, seq: Sequence) -> None:
        """Register the sequence's newly completed (full and computed) blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        digests = self.digests(seq, num_full)
        for i in range(seq.num_published_blocks, num_full):
            h = digests[i]
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and h not in self._hash_to_block:
                block.hash = h
                block.parent = digests[i - 1] if i else root_digest(seq.params.cache_salt)
                block.token_ids = self._tokens(seq, i)
                self._hash_to_block[h] = block.block_id
            # else: an identical block is already published (computed twice concurrently): keep that one
        seq.num_published_blocks = max(seq.num_published_blocks, num_full)

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references, tail first so shared heads stay cached longest (LRU)."""
        for block_id in reversed(seq.block_table):
            self._unref(block_id)
        seq.block_table.clear()
        seq.num_published_blocks = 0
        seq.num_computed_tokens = 0

    def free_tail(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the blocks past the first `num_tokens` tokens (slots of rejected draft tokens).

        Those blocks never hold a published prefix: only computed, verified blocks are published.
        """
        keep = -(-num_tokens // self.block_size)
        while len(seq.block_table) > keep:
            block_id = seq.block_table.pop()
            block = self.blocks[block_id]
            assert block.hash is None and seq.num_published_blocks <= keep, "a published block past the tail"
            self._unref(block_id)

    def _unref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise RuntimeError(f"double free of block {block_id}")
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free_queue[block_id] = None
            if block.hash is None:  # nothing to reuse: at the head, so it is taken before cached blocks
                self._free_queue.move_to_end(block_id, last=False)

    # ---- integrity -----------------------------------------------------------------------------
    def check_integrity(self, live_seqs: list[Sequence] | None = None) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent: the free queue holds exactly the unreferenced
        blocks and no ref count is negative; every hash maps to a block that carries it; with `live_seqs`, ref
        counts equal table occurrences."""
        if negative := [b.block_id for b in self.blocks if b.ref_count < 0]:
            raise AssertionError(f"blocks {negative} have negative ref counts")
        unreferenced = {b.block_id for b in self.blocks if b.ref_count == 0}
        if leaked := sorted(unreferenced - self._free_queue.keys()):
            raise AssertionError(f"unreferenced blocks {leaked} are not in the free queue (leak)")
        if extra := sorted(self._free_queue.keys() - unreferenced):
            raise AssertionError(f"blocks {extra} in the free queue are referenced or unknown")
        if stale := [b for h, b in self._hash_to_block.items() if self.blocks[b].hash != h]:
            raise AssertionError(f"the hash table points at blocks {stale}, which no longer hold those prefixes")
        if live_seqs is not None:
            held = Counter(b for seq in live_seqs for b in seq.block_table)
            if wrong := [b.block_id for b in self.blocks if held[b.block_id] != b.ref_count]:
                raise AssertionError(f"blocks {wrong}: ref counts differ from the sequences holding them")
