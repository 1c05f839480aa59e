"""The router's prefix-cache affinity (server/affinity.py) without Ray: block digests, the longest recorded prefix
against load, and each replica's bounded LRU record of what it was sent."""

from __future__ import annotations

from pagedserve.server.affinity import PrefixAffinity, ReplicaLoad, RoutingKey, block_chain

SECRET = b"s" * 32


def test_block_chain_is_block_aligned_prefix_shared_and_namespaced():
    a = block_chain(list(range(40)), 16, SECRET)
    b = block_chain(list(range(32)) + [7] * 8, 16, SECRET)
    assert len(a) == 2 and a == b  # two full blocks before the last token; the tail does not count
    assert block_chain(list(range(33)), 16, SECRET) == a  # the 33rd token is the one always computed
    assert block_chain(list(range(32)), 16, SECRET) == a[:1]
    c = block_chain([1] + list(range(1, 40)), 16, SECRET)
    assert c[0] != a[0] and c[1] != a[1]  # a chain: a change early changes every later digest
    assert set(block_chain(list(range(40)), 16, SECRET, "key:t1")).isdisjoint(a)  # tenants never match
    assert set(block_chain(list(range(40)), 16, b"x" * 32)).isdisjoint(a)  # nor does another ingress's secret


def test_longest_prefix_wins_until_imbalanced():
    aff = PrefixAffinity(balance_abs=4, balance_rel=1.5, seed=0)
    p1, p2 = block_chain(list(range(100)), 16, SECRET), block_chain(list(range(100, 200)), 16, SECRET)
    aff.record("r1", p1)
    aff.record("r2", p2[:2])
    idle = [ReplicaLoad("r1"), ReplicaLoad("r2")]
    assert aff.rank(idle, RoutingKey(p1))[0] == ["r1"]
    assert aff.rank(idle, RoutingKey(p2))[0] == ["r2"]
    # a longer partial match beats a shorter one
    aff.record("r1", p2[:4])
    assert aff.rank(idle, RoutingKey(p2))[0] == ["r1"]
    # imbalanced beyond both thresholds: the least loaded, whatever it holds
    busy = [ReplicaLoad("r1", num_running=8, num_waiting=2), ReplicaLoad("r2", num_running=1)]
    assert aff.rank(busy, RoutingKey(p1)) == [["r2"], ["r1"]]
    # within the thresholds: affinity still wins
    near = [ReplicaLoad("r1", num_running=4), ReplicaLoad("r2", num_running=1)]
    assert aff.rank(near, RoutingKey(p1))[0] == ["r1"]


def test_no_match_is_power_of_two_and_full_or_avoided_replicas_go_last():
    aff = PrefixAffinity(seed=1)
    loads = [ReplicaLoad(f"r{i}") for i in range(4)]
    tiers = aff.rank(loads, RoutingKey(block_chain(list(range(50)), 16, SECRET)))
    assert len(tiers[0]) == 2 and sorted(tiers[0] + tiers[1]) == ["r0", "r1", "r2", "r3"]
    full = [ReplicaLoad("r0", can_admit=False), ReplicaLoad("r1"), ReplicaLoad("r2")]
    aff.record("r0", block_chain(list(range(50)), 16, SECRET))
    tiers = aff.rank(full, RoutingKey(block_chain(list(range(50)), 16, SECRET), avoid=("r1",)))
    assert tiers == [["r2"], ["r0"], ["r1"]]  # the cached one is full: it may only refuse, so it comes late
    assert aff.rank([ReplicaLoad("r0", can_admit=False)], None) == [["r0"]]  # its own admission answers: 429


def test_the_record_is_a_bounded_lru_and_a_dead_replica_is_forgotten():
    aff = PrefixAffinity(max_blocks_per_replica=3)
    chain = block_chain(list(range(100)), 16, SECRET)
    aff.record("r", chain)
    assert aff.match("r", chain) == 0  # the oldest (the head of the chain) aged out first
    aff.record("r", chain[:3])
    assert aff.match("r", chain) == 3
    aff.forget("r")
    assert aff.match("r", chain) == 0


def test_replica_load_from_published_stats():
    x = ReplicaLoad.of("r", {"num_running": 3, "num_waiting": 4, "max_waiting_requests": 4, "drain_rate": 2.0})
    assert x.load == 7 and not x.can_admit and x.drain_rate == 2.0
    assert ReplicaLoad.of("r", {}).can_admit  # before its first report: assumed idle


def test_a_block_sent_again_is_recent_again():
    """The record is an LRU, not a FIFO: a block sent again (a request that hit it) moves to the recent end, so
    what ages out is the block sent longest ago, not the one recorded first."""
    aff = PrefixAffinity(max_blocks_per_replica=3)
    old, mid, new = (block_chain(list(range(k, k + 17)), 16, SECRET) for k in (0, 100, 200))
    aff.record("r", old)
    aff.record("r", mid)
    aff.record("r", new)
    aff.record("r", old)  # a hit: `old` is the most recent now
    aff.record("r", block_chain(list(range(300, 317)), 16, SECRET))  # one block past the bound: one ages out
    assert [aff.match("r", chain) for chain in (old, mid, new)] == [1, 0, 1]


def test_router_chain_is_the_engines_chain_over_the_blocks_a_hit_may_cover():
    """One chain for both sides: with the engine's root, the router's digests are the block manager's, shortened,
    and they stop exactly where the engine's hits stop (never the last token's block)."""
    import pagedserve.engine.block_manager as bm_mod
    from pagedserve.engine.block_manager import BlockManager
    from pagedserve.engine.sampling_params import SamplingParams
    from pagedserve.engine.sequence import Sequence

    for n in (1, 4, 5, 8, 9, 13):
        ids = list(range(100, 100 + n))
        bm = BlockManager(16, 4)
        first = Sequence(0, "a", ids, SamplingParams(max_tokens=8), 8)
        bm.allocate(first, n)
        first.num_computed_tokens = n
        bm.publish_full_blocks(first)
        again = Sequence(1, "b", ids, SamplingParams(max_tokens=8), 8)
        hits = bm.find_cached_prefix(again)
        chain = block_chain(ids, 4, bm_mod._ROOT)
        assert len(chain) == len(hits) == bm_mod.max_hit_blocks(n, 4) == (n - 1) // 4
        assert list(chain) == [d[:16] for d in again.block_digests[:len(hits)]]
