"""Ray Serve request routers for the engine replicas: ours (prefix-cache affinity) and Ray's default.

Both live in the ingress's process (a deployment handle builds its router where it is called) and register
there (server/fleet.py's `STATS_SOURCES`), so the ingress reads every replica's published stats for its
admission, Retry-After and /metrics. The registry cannot live here: Ray ships this module to the ingress by
value, so its globals there are a copy nobody else sees.
The policy itself is server/affinity.py; this module only adapts Ray's alpha `RequestRouter` API to it.
Imported only when serving on Ray.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from . import fleet  # the module, not its dict: by value, a dict would be shipped as a copy
from .affinity import PrefixAffinity, ReplicaLoad, RoutingKey


def replica_stats(router: RequestRouter) -> dict[str, Mapping]:
    """Replica id -> what it last published through `record_routing_stats` ({} before the first report)."""
    return {rid.unique_id: dict(r.routing_stats or {}) for rid, r in list(router.curr_replicas.items())}


def _key(pending: PendingRequest | None) -> RoutingKey | None:
    key = pending.kwargs.get("key") if pending is not None else None
    return key if isinstance(key, RoutingKey) else None


class PrefixCacheRouter(RequestRouter):
    """Longest recorded prefix unless imbalanced, else power of two (server/affinity.py). Not FIFO on purpose:
    a choice made for one request's prefix must serve that request, not the oldest one waiting."""

    def initialize_state(self, **kwargs) -> None:
        self.affinity = PrefixAffinity(**kwargs)
        fleet.STATS_SOURCES[self._deployment_id.name] = functools.partial(replica_stats, self)

    def load(self, r: RunningReplica) -> ReplicaLoad:
        """Published stats lag (a period); requests this router sent since then count too, so a burst of
        same-prefix requests can still look imbalanced."""
        x = ReplicaLoad.of(r.replica_id.unique_id, r.routing_stats)
        ongoing = self.replica_queue_len_cache.get(r.replica_id) or 0
        return dataclasses.replace(x, num_waiting=max(x.num_waiting, ongoing - x.num_running))

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is not None:  # every replica is in some tier: a failed round means all are busy
            pending_request.routing_context.should_backoff = True
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        tiers = self.affinity.rank([self.load(r) for r in candidate_replicas], _key(pending_request))
        return [[by_id[i] for i in tier] for tier in tiers]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        key = _key(pending_request)
        if key is not None and key.blocks:
            self.affinity.record(replica_id.unique_id, key.blocks)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.affinity.forget(replica_id.unique_id)


class DefaultRouter(PowerOfTwoChoicesRequestRouter):
    """Ray's default router, unchanged, but registered: the baseline the benchmark compares ours with."""

    def initialize_state(self, **kwargs) -> None:
        super().initialize_state(**kwargs)
        fleet.STATS_SOURCES[self._deployment_id.name] = functools.partial(replica_stats, self)
