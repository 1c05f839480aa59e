"""Prefix-cache affinity: which replica most likely holds a request's prompt prefix in its KV cache.

The router-side twin of the engine's prefix cache: a prompt's key is the engine's own chain
(`chain_digests` in engine/block_manager.py) over the blocks a hit may cover (`max_hit_blocks`), so two
prompts share digests exactly as far as an engine would share cached blocks. The chain starts from a secret of
this ingress mixed with the request's cache namespace (its `cache_salt`, with the API key's namespace when
keys are isolated), so tenants never match each other's prefixes: where a request goes says nothing about what
another tenant sent.

Per replica we keep an approximate, bounded LRU record of the digests it was sent (the engine evicts on its own;
we only age entries out). A request goes to the replica with the longest recorded prefix unless load is
imbalanced beyond both thresholds (SGLang's `balance_abs` / `balance_rel`), then to the least loaded; with no
useful match, to the shorter queue of two random replicas (power of two choices). Pure Python, no Ray: the Ray
`RequestRouter` (server/ray_router.py) only adapts its inputs and outputs.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import takewhile

from ..engine.block_manager import chain_digests, max_hit_blocks, root_digest

# A record entry's length. The router keeps up to `max_blocks_per_replica` of them per replica and every request
# carries its chain to Ray's router; a collision there only sends a request to a colder replica, never changes a
# token, so half of the engine's digest is plenty.
RECORD_DIGEST_BYTES = 16


@dataclass(frozen=True, slots=True)
class RoutingKey:
    """What the router sees of a request: its prompt's block digests, and replicas to try last."""

    blocks: tuple[bytes, ...] = ()
    avoid: tuple[str, ...] = ()  # replicas that refused this request or died under it


def block_chain(token_ids: Sequence[int], block_size: int, secret: bytes, namespace: str | None = None) -> tuple[
        bytes, ...]:
    """Digests of the blocks a prefix-cache hit could cover, shortened to `RECORD_DIGEST_BYTES`.

    Keyed by the ingress's `secret` rather than the engine's per-process root: these digests are compared only
    with each other, never with a replica's, so the key is the record owner's to hold (and a test's to pin)."""
    chain = chain_digests(root_digest(namespace, secret), token_ids, block_size, 0,
                          max_hit_blocks(len(token_ids), block_size))
    return tuple(d[:RECORD_DIGEST_BYTES] for d in chain)


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """One replica's state as it last published it (`record_routing_stats`)."""

    replica: str
    num_running: int = 0
    num_waiting: int = 0
    can_admit: bool = True  # below its own admission limit
    drain_rate: float | None = None  # requests started per second while a queue drains (None: not measured)

    @property
    def load(self) -> int:
        return self.num_running + self.num_waiting

    @classmethod
    def of(cls, replica: str, stats: Mapping | None) -> ReplicaLoad:
        """From a routing-stats dict (empty before the replica's first report: assumed idle)."""
        s = stats or {}
        limit = s.get("max_waiting_requests")
        waiting = int(s.get("num_waiting", 0))
        return cls(replica, int(s.get("num_running", 0)), waiting, limit is None or waiting < limit,
                   s.get("drain_rate"))


class PrefixAffinity:
    def __init__(self, max_blocks_per_replica: int = 8192, balance_abs: int = 8, balance_rel: float = 1.5,
                 min_match: float = 0.1, seed: int | None = None) -> None:
        self.max_blocks = max_blocks_per_replica
        self.balance_abs, self.balance_rel = balance_abs, balance_rel
        self.min_match = min_match  # matched share of the prompt's blocks below which affinity is not worth it
        self._served: dict[str, OrderedDict[bytes, None]] = {}
        self._rng = random.Random(seed)

    def match(self, replica: str, blocks: Sequence[bytes]) -> int:
        """Leading blocks of the chain this replica was sent (a chain: the first miss ends the prefix)."""
        served = self._served.get(replica, {})
        return sum(1 for _ in takewhile(served.__contains__, blocks))

    def record(self, replica: str, blocks: Sequence[bytes]) -> None:
        """The replica was sent these blocks: it will hold them until its cache evicts them."""
        served = self._served.setdefault(replica, OrderedDict())
        for b in blocks:
            served[b] = None
            served.move_to_end(b)
        while len(served) > self.max_blocks:
            served.popitem(last=False)

    def forget(self, replica: str) -> None:
        """A dead replica's cache died with it (its replacement starts cold under a new id)."""
        self._served.pop(replica, None)

    def imbalanced(self, loads: Sequence[ReplicaLoad]) -> bool:
        hi, lo = max(x.load for x in loads), min(x.load for x in loads)
        return hi - lo > self.balance_abs and hi > self.balance_rel * lo

    def rank(self, loads: Sequence[ReplicaLoad], key: RoutingKey | None) -> list[list[str]]:
        """Tiers of replica ids, best first (Ray tries a tier's shorter queue first, then the next tier). Every
        replica appears once: full and avoided ones last, so their own admission can still answer (a 429)."""
        key = key or RoutingKey()
        ok = [x for x in loads if x.can_admit and x.replica not in key.avoid]
        first = self._first_tier(ok, key.blocks) if ok else []
        tiers = [first, [x.replica for x in ok if x.replica not in first],
                 [x.replica for x in loads if not x.can_admit and x.replica not in key.avoid],
                 [x.replica for x in loads if x.replica in key.avoid]]
        return [t for t in tiers if t]

    def _first_tier(self, ok: Sequence[ReplicaLoad], blocks: Sequence[bytes]) -> list[str]:
        """The least loaded if load is imbalanced, else the longest useful match, else two at random."""
        if len(ok) > 1 and self.imbalanced(ok):
            lo = min(x.load for x in ok)
            return [x.replica for x in ok if x.load == lo]
        matches = {x.replica: self.match(x.replica, blocks) for x in ok}
        best = max(matches.values())
        if best and best >= self.min_match * len(blocks):
            return [r for r, m in matches.items() if m == best]
        return self._rng.sample(list(matches), min(2, len(matches)))
