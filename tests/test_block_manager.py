"""Block manager: exact block ids, ref counts, prefix hits, LRU eviction, integrity. No model."""

import pytest

from pagedserve.engine.block_manager import BlockManager
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.sequence import Sequence


def seq(ids, sid=0):
    return Sequence(sid, f"r{sid}", list(ids), SamplingParams(max_tokens=8), 8)


def compute(bm, s, n):
    """What the scheduler + runner do for n tokens: allocate, 'compute', publish."""
    bm.allocate(s, n)
    s.num_computed_tokens += n
    bm.publish_full_blocks(s)


def test_allocate_and_free_exact_ids():
    bm = BlockManager(8, 4)
    a = seq(range(10))
    compute(bm, a, 10)
    assert a.block_table == [0, 1, 2]
    assert [bm.blocks[i].ref_count for i in range(8)] == [1, 1, 1, 0, 0, 0, 0, 0]
    assert bm.num_free_blocks == 5
    # two full blocks are published, the partial third is not
    assert bm.blocks[0].hash is not None and bm.blocks[1].hash is not None and bm.blocks[2].hash is None
    bm.check_integrity([a])
    bm.free(a)
    assert a.block_table == [] and bm.num_free_blocks == 8 and len(bm.cached_free_blocks()) == 2
    bm.check_integrity([])


def test_append_grows_one_block_at_boundary():
    bm = BlockManager(8, 4)
    a = seq(range(4))
    compute(bm, a, 4)
    assert a.block_table == [0]
    a.token_ids.append(99)  # a sampled token; its K/V is computed next step
    assert bm.blocks_needed(a, 1) == 1
    compute(bm, a, 1)
    assert a.block_table == [0, 1]
    for t in range(3):
        a.token_ids.append(100 + t)
        assert bm.blocks_needed(a, 1) == 0
        compute(bm, a, 1)
    assert a.block_table == [0, 1] and bm.blocks[1].hash is not None


def test_prefix_hit_shares_blocks_and_counts_refs():
    bm = BlockManager(16, 4)
    a = seq(list(range(12)) + [50, 51], sid=0)
    compute(bm, a, a.num_tokens)
    assert a.block_table == [0, 1, 2, 3]
    b = seq(list(range(12)) + [60], sid=1)
    hits = bm.find_cached_prefix(b)
    assert hits == [0, 1, 2]
    assert bm.can_allocate(b, 1, hits)
    bm.allocate(b, 1, hits)
    assert b.block_table == [0, 1, 2, 4] and b.num_computed_tokens == 12
    assert [bm.blocks[i].ref_count for i in range(5)] == [2, 2, 2, 1, 1]
    bm.check_integrity([a, b])


def test_never_a_full_hit():
    """The last prompt token must be computed to get logits: a block-aligned prompt keeps its last block."""
    bm = BlockManager(16, 4)
    a = seq(range(8), sid=0)
    compute(bm, a, 8)
    bm.free(a)
    b = seq(range(8), sid=1)
    assert bm.find_cached_prefix(b) == [0]  # not [0, 1]


def test_hash_collision_is_caught_by_token_compare(monkeypatch):
    import pagedserve.engine.block_manager as mod

    monkeypatch.setattr(mod, "block_digest", lambda parent, tokens: b"42")  # everything collides
    bm = BlockManager(8, 4)
    a = seq(range(5), sid=0)
    compute(bm, a, 5)
    b = seq([9, 9, 9, 9, 9], sid=1)
    assert bm.find_cached_prefix(b) == []


def test_lru_eviction_tail_first():
    """Freed sequences release tail blocks first, so shared heads stay cached longest."""
    bm = BlockManager(6, 2)
    a = seq(range(7), sid=0)  # blocks 0,1,2 full; 3 partial
    compute(bm, a, 7)
    assert a.block_table == [0, 1, 2, 3]
    bm.free(a)
    # unhashed block 3 goes to the head of the queue, then LRU: the tail (2) before the head (0)
    c = seq([100 + i for i in range(9)], sid=1)
    compute(bm, c, 9)  # needs 5 blocks: unhashed 3, free 4 and 5, then evicts 2, then 1
    assert c.block_table == [3, 4, 5, 2, 1]
    d = seq(list(range(2)) + [77], sid=2)
    assert bm.find_cached_prefix(d) == [0]  # the head survived
    bm.check_integrity([c])


def test_eviction_removes_stale_hash():
    bm = BlockManager(2, 2)
    a = seq([1, 2, 3], sid=0)
    compute(bm, a, 3)
    bm.free(a)
    b = seq([7, 8, 9, 10, 11], sid=1)
    assert bm.find_cached_prefix(b) == []
    assert not bm.can_allocate(b, 5)  # 3 blocks needed, 2 exist
    bm.allocate(b, 4)  # evicts the cached [1, 2]
    assert bm.find_cached_prefix(seq([1, 2, 3], sid=2)) == []
    bm.check_integrity([b])


def test_can_allocate_accounts_for_reclaimed_cached_hits():
    bm = BlockManager(3, 2)
    a = seq([1, 2, 3, 4, 5], sid=0)
    compute(bm, a, 5)
    bm.free(a)  # blocks 0, 1 cached; 2 free
    b = seq([1, 2, 3, 4, 9, 9, 9], sid=1)
    hits = bm.find_cached_prefix(b)
    assert hits == [0, 1]
    # 3 more tokens after the hit need 2 blocks, but only 1 is free once the hits are taken
    assert not bm.can_allocate(b, 3, hits)
    assert bm.can_allocate(b, 2, hits)


def test_double_free_detected():
    bm = BlockManager(4, 2)
    a = seq([1, 2, 3], sid=0)
    compute(bm, a, 3)
    table = list(a.block_table)
    bm.free(a)
    a.block_table = table
    with pytest.raises(RuntimeError, match="double free"):
        bm.free(a)


def test_integrity_detects_leak():
    bm = BlockManager(4, 2)
    a = seq([1, 2, 3], sid=0)
    compute(bm, a, 3)
    with pytest.raises(AssertionError):
        bm.check_integrity([])  # a's references are not accounted for by any live sequence
    bm.blocks[0].ref_count = 0  # corrupt: unreferenced but not in the free queue
    with pytest.raises(AssertionError, match="leak"):
        bm.check_integrity()


def test_parent_chain_collision_attempt(monkeypatch):
    """A digest that ignored the parent (the CVE-2025-25183 class) still cannot make a block hit out of
    context: a hit also needs the block's recorded parent digest, not just its own tokens."""
    import pagedserve.engine.block_manager as mod

    monkeypatch.setattr(mod, "block_digest", lambda parent, tokens: hash(tokens).to_bytes(8, "little", signed=True))
    bm = BlockManager(16, 4)
    a = seq([9, 9, 9, 9, 1, 2, 3, 4, 5], sid=0)  # block 1 = [1, 2, 3, 4] after a [9, 9, 9, 9] head
    compute(bm, a, 9)
    bm.free(a)
    b = seq([1, 2, 3, 4, 5, 6], sid=1)  # same tokens as a's block 1, but as a first block
    assert bm.find_cached_prefix(b) == []


def test_digests_chain_the_whole_prefix_and_are_computed_once(monkeypatch):
    import pagedserve.engine.block_manager as mod

    real, calls = mod.block_digest, []
    monkeypatch.setattr(mod, "block_digest", lambda parent, tokens: calls.append(tokens) or real(parent, tokens))
    bm = BlockManager(16, 4)
    a, b = seq([1, 2, 3, 4, 5, 6, 7, 8, 0], sid=0), seq([0, 2, 3, 4, 5, 6, 7, 8, 0], sid=1)
    assert bm.digests(a, 2)[1] != bm.digests(b, 2)[1]  # same second block, different first: different digest
    for _ in range(3):  # the scheduler retries a blocked head of the queue every step
        bm.find_cached_prefix(a)
    compute(bm, a, 9)
    assert len(calls) == 4  # two blocks each of a and b, once
    assert a.num_published_blocks == 2 and [bm.blocks[b].hash for b in a.block_table[:2]] == a.block_digests[:2]
    assert all(len(d) == 32 for d in a.block_digests)


def test_cache_salt_separates_identical_prompts():
    bm = BlockManager(16, 4)
    ids = list(range(9))
    mk = lambda sid, salt: Sequence(sid, f"r{sid}", ids, SamplingParams(max_tokens=8, cache_salt=salt), 8)
    compute(bm, mk(0, "tenant-a"), 9)
    assert bm.find_cached_prefix(mk(1, "tenant-a")) == [0, 1]
    assert bm.find_cached_prefix(mk(2, "tenant-b")) == []
    assert bm.find_cached_prefix(mk(3, None)) == []
    assert mod_root_differs()


def mod_root_differs() -> bool:
    """The root is random per process: a digest cannot be precomputed elsewhere."""
    import subprocess
    import sys

    code = ("from pagedserve.engine.block_manager import block_digest, root_digest; "
            "print(block_digest(root_digest(), (1,)).hex())")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
            for _ in range(2)}
    return len(outs) == 2


def test_chain_digests_continues_a_chain_from_any_block():
    """The shared chain (the router uses it too): computing blocks 2.. from block 1's digest gives the same
    digests as computing all of them from the root, and each depends on the salt through the root."""
    from pagedserve.engine.block_manager import chain_digests, root_digest

    ids = list(range(20))
    whole = chain_digests(root_digest(), ids, 4, 0, 5)
    assert len(set(whole)) == 5
    assert whole[:2] + chain_digests(whole[1], ids, 4, 2, 5) == whole
    assert chain_digests(root_digest(), ids, 4, 0, 0) == []
    assert set(chain_digests(root_digest("t"), ids, 4, 0, 5)).isdisjoint(whole)
    assert root_digest(secret=b"k" * 32) == b"k" * 32 and root_digest("t", b"k" * 32) != root_digest("t")


def test_preemption_keeps_digests_but_forgets_what_it_published():
    """After `free` (preemption), the digests stay cached on the sequence and the re-admitted prefix hits."""
    bm = BlockManager(16, 4)
    a = seq(range(10))
    compute(bm, a, 10)
    assert a.num_published_blocks == 2 and len(a.block_digests) == 2
    bm.free(a)
    assert a.num_published_blocks == 0 and len(a.block_digests) == 2
    hits = bm.find_cached_prefix(a)
    assert hits == [0, 1]
    bm.allocate(a, 2, hits)
    assert a.num_published_blocks == 2 and a.num_computed_tokens == 8
    bm.check_integrity([a])
