"""The ingress's engine: N engine replicas behind one admission, shaped like the one AsyncEngine the pipeline
(server/serving.py) drives, so chat, completions, SSE, errors and usage are the single server's own code.

It implements the same `EngineClient` (engine/client.py) as the single AsyncEngine. A request is tokenized and
checked here (an `InputProcessor` like the replicas'), then dispatched: the router picks a
replica, which answers first `Admitted` or `Refused` (its own admission, the authority on its queue), then
`Scheduled` once its engine has given the request tokens (from then on it is never refused for its wait), then the
engine's outputs. What happens on the way, in order:
  - refused: the next replica is tried (the router ranks the refusers last); when every replica has refused,
    the client gets our 429 with a Retry-After from the whole fleet's drain rate (before any replica has
    measured one: the soonest start a replica estimates from its step-cost model);
  - the replica died before the first output: retried once, elsewhere (nothing was sent to the client: the
    pipeline sends a stream's status line only after the first output);
  - the replica died after it: the stream ends with an error event coded `replica_died` (a non-streamed
    request gets a 503 with that code). A request is never replayed once a client has seen part of it.
Ray-free: `dispatch` (server/ray_app.py) is the only thing that talks to Ray, and translates its errors.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import aclosing
from dataclasses import dataclass

from ..engine.async_engine import AdmissionLimits, EngineDeadError, OverloadedError, unused_id
from ..engine.client import EngineClient, NoEngineViewError, QueuePlaces, Reservation
from ..engine.input_processor import EngineRequest, InputProcessor
from ..engine.llm_engine import EngineStats
from ..engine.output_processor import RequestOutput
from ..engine.sampling_params import SamplingParams
from ..engine.snapshot import EngineSnapshot
from .affinity import ReplicaLoad, RoutingKey, block_chain

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Admitted:
    """A replica's first answer: the request is in its engine."""

    replica: str


@dataclass(frozen=True, slots=True)
class Scheduled:
    """A replica's answer once its engine has given the request tokens: its prefill has begun."""

    replica: str


@dataclass(frozen=True, slots=True)
class Refused:
    """A replica's only answer when its own admission says no (its queue is full or too slow)."""

    replica: str
    message: str
    reason: str  # for the rejection counter: queue_full, queue_wait


class ReplicaLostError(EngineDeadError):
    """The replica serving a request died (or could not be reached) under it."""

    code = "replica_died"
    public_message = "the replica serving this request died; the request was not completed (retry it)"


# Deployment name -> a function returning each replica's last published stats: the router of that deployment in
# this process registers one (server/ray_router.py), the Fleet reads it.
STATS_SOURCES: dict[str, Callable[[], dict[str, Mapping]]] = {}


def published_stats(deployment: str) -> dict[str, Mapping]:
    return STATS_SOURCES.get(deployment, dict)()  # {} until that router registers


Item = Admitted | Scheduled | Refused | RequestOutput
Dispatch = Callable[[str, list[int], SamplingParams, RoutingKey], AsyncIterator[Item]]


def engine_stats(stats: Mapping) -> EngineStats:
    """A replica's routing-stats dict as the metrics' snapshot type."""
    return EngineStats(int(stats.get("num_running", 0)), int(stats.get("num_waiting", 0)),
                       float(stats.get("kv_cache_usage", 0.0)), int(stats.get("num_preemptions", 0)),
                       int(stats.get("prefix_cache_queries", 0)), int(stats.get("prefix_cache_hits", 0)), None)


class Fleet(EngineClient):
    """`dispatch` runs one request on some replica; `replica_stats` is what each replica last published
    (replica id -> its `record_routing_stats` dict; empty when unknown)."""

    def __init__(self, input_processor: InputProcessor, dispatch: Dispatch,
                 replica_stats: Callable[[], dict[str, Mapping]], limits: AdmissionLimits, block_size: int,
                 on_outputs: Callable[[list[RequestOutput]], None] | None = None) -> None:
        self.input_processor = input_processor
        self.dispatch = dispatch
        self.replica_stats = replica_stats
        self.limits = limits
        self.block_size = block_size
        self.on_outputs = on_outputs
        self.secret = os.urandom(32)  # the router's chain is keyed per ingress: nobody can precompute it
        self._places = QueuePlaces()
        self._closed = False
        self._live: dict[str, FleetStream] = {}  # by id: requests whose remote call has not ended

    # ---- what the pipeline and the app read ------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return not self._closed

    def loads(self) -> list[ReplicaLoad]:
        return [ReplicaLoad.of(r, s) for r, s in self.replica_stats().items()]

    def stats(self) -> dict[str, EngineStats]:
        """Per replica, for /metrics (a `replica` label on each gauge and counter)."""
        return {r: engine_stats(s) for r, s in self.replica_stats().items() if s}

    @property
    def num_waiting(self) -> int:
        return sum(x.num_waiting for x in self.loads()) + self._places.reserved

    @property
    def in_flight(self) -> int:
        return len(self._live) + self._places.reserved

    async def snapshot(self, timeout: float) -> EngineSnapshot:
        raise NoEngineViewError("each replica has its own engine")

    def tenant_of(self, request_id: str) -> str | None:
        return None  # no engine view here to show a tenant its ids

    def fail_all(self, error: BaseException) -> None:
        """Each request's remote call is cancelled, which aborts it in its replica's engine."""
        for stream in list(self._live.values()):
            stream.fail(error)

    def expected_wait(self) -> float | None:
        """Seconds until one more request would start anywhere: everything waiting in the fleet over the sum of
        the replicas' drain rates (None until some replica has measured one)."""
        rate = sum(x.drain_rate for x in self.loads() if x.drain_rate)
        return self.num_waiting / rate if rate else None

    def estimated_wait(self, ahead: int | None = None) -> float | None:
        """Seconds until `ahead` (default: all) of the requests waiting in the fleet have started, at the sum of the
        replicas' drain rates; before any replica has measured one, the soonest start any replica estimates for a
        request of its own (its `estimated_wait`, from its step-cost model), as a retry may go to any (None until
        some replica has published one)."""
        rate = sum(x.drain_rate for x in self.loads() if x.drain_rate)
        if rate:
            return (self.num_waiting if ahead is None else ahead) / rate
        estimates = [s["estimated_wait"] for s in self.replica_stats().values() if s.get("estimated_wait") is not None]
        return min(estimates, default=None)

    # ---- admission and submission ----------------------------------------------------------------------
    def reserve(self, count: int = 1) -> Reservation:
        """Refuse early when every replica last reported a full queue; the replicas still decide for real."""
        if self._closed:
            raise EngineDeadError("the ingress is shutting down")
        loads = self.loads()
        if loads and not any(x.can_admit for x in loads):
            raise OverloadedError(f"server overloaded: all {len(loads)} replicas have full queues",
                                  self.retry_after())
        return self._places.hold(count)

    def submit(self, request: EngineRequest, places: Reservation, tenant: str | None = None) -> FleetStream:
        """`tenant` (the engine view's per-key ids) is the single server's: the fleet serves no engine view. The
        replica runs the request under its id (suffixed while another live request has it, as an AsyncEngine
        does), so the ingress's log and the replica's name one request alike; the replica builds the request
        again from its ids and params with its own input processor (its engine's grammar matcher included)."""
        places.take()
        ids, params = request.prompt_token_ids, request.params
        key = RoutingKey(block_chain(ids, self.block_size, self.secret, params.cache_salt))
        request_id = unused_id(request.request_id, self._live.__contains__)
        stream = FleetStream(self, request_id, ids, params, key)
        self._live[request_id] = stream
        stream._task.add_done_callback(lambda _: self._live.pop(request_id, None))
        return stream

    def shutdown(self) -> None:
        self._closed = True


class FleetStream:
    """One request's outputs from whichever replica runs it: an OutputStream (engine/client.py), as AsyncEngine's
    RequestStream is. `close()` before the end cancels the remote call, which aborts the request in that replica's
    engine."""

    def __init__(self, fleet: Fleet, request_id: str, ids: list[int], params: SamplingParams,
                 key: RoutingKey) -> None:
        self.fleet, self.request_id = fleet, request_id
        self.finished = False
        self.replica: str | None = None
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._first = asyncio.Event()  # the first output, or the error that ended the request before one
        self._scheduled = False  # its replica's engine has given it tokens (kept across a retry elsewhere)
        self._error: BaseException | None = None
        self._task = asyncio.get_running_loop().create_task(self._pump(ids, params, key))

    async def _pump(self, ids: list[int], params: SamplingParams, key: RoutingKey) -> None:
        try:
            await self._run(ids, params, key)
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            if not self._first.is_set():
                self._error = e
            self._queue.put_nowait(e)
        finally:
            self._scheduled = True
            self._first.set()

    async def _run(self, ids: list[int], params: SamplingParams, key: RoutingKey) -> None:
        avoid: list[str] = []
        retried = False  # a replica's death before the first output is retried once
        while True:
            refused = None
            try:
                async with aclosing(self.fleet.dispatch(self.request_id, ids, params,
                                                        RoutingKey(key.blocks, tuple(avoid)))) as items:
                    async for item in items:
                        if isinstance(item, Admitted):
                            self.replica = item.replica
                        elif isinstance(item, Scheduled):
                            self._scheduled = True
                        elif isinstance(item, Refused):
                            refused = item
                            break
                        else:
                            self._scheduled = True
                            self._first.set()
                            self._queue.put_nowait(item)
                            if self.fleet.on_outputs is not None:
                                self.fleet.on_outputs([item])
                            if item.finished:
                                return
                if refused is None:  # the replica's generator ended without a finished output
                    raise ReplicaLostError(f"replica {self.replica} ended request {self.request_id} early")
            except ReplicaLostError:
                if self._first.is_set() or retried:
                    raise
                retried = True
                logger.warning("request %s: replica %s lost before its first output; retrying elsewhere",
                               self.request_id, self.replica)
                if self.replica is not None:
                    avoid.append(self.replica)
                self.replica = None
                continue
            avoid.append(refused.replica)
            n = max(1, len(self.fleet.replica_stats()))
            if len(set(avoid)) >= n or len(avoid) > n:  # bounded even if the router keeps picking a refuser
                raise OverloadedError(f"{refused.message} (every replica refused)", self.fleet.retry_after(),
                                      refused.reason)

    # ---- OutputStream's surface --------------------------------------------------------------------------
    def __aiter__(self) -> FleetStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.close()
            raise item
        if item.finished:
            self.finished = True
        return item

    @property
    def scheduled(self) -> bool:
        """Its replica's engine has given it tokens (or it ended)."""
        return self._scheduled

    async def wait_started(self) -> None:
        """Until the first output; raises what ended the request before one (a refusal: OverloadedError)."""
        await self._first.wait()
        if self._error is not None:
            raise self._error

    def fail(self, error: BaseException) -> None:
        """End the request with `error` (see Fleet.fail_all)."""
        self.close()
        self._scheduled = True
        if not self._first.is_set():
            self._error = error
            self._first.set()
        self._queue.put_nowait(error)

    def close(self) -> None:
        if not self._task.done():
            self._task.cancel()
