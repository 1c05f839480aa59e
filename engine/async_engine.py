"""Runs LLMEngine.step in its own thread and bridges outputs to asyncio, one queue per request: the single server's
`EngineClient` (engine/client.py), with its admission (queue limits, the expected wait, Retry-After)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from . import allocator
from .client import EngineClient, QueuePlaces, Reservation
from .config import check_options, opt
from .input_processor import EngineRequest, InputProcessor
from .llm_engine import EngineStats, LLMEngine
from .output_processor import RequestOutput
from .snapshot import EngineSnapshot

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop crashed; no request can be served until restart."""

    code = "engine_dead"  # the error body's code; subclasses name other deaths (a replica's: replica_died)
    public_message: str | None = None  # what a client may read (None: the server's generic line, no details)


class ShuttingDownError(EngineDeadError):
    """The server stopped (SIGTERM, Ctrl-C, a drained replica) before this request finished."""

    code = "server_shutting_down"
    public_message = "the server is shutting down; the request was not completed (retry it)"


class OverloadedError(RuntimeError):
    def __init__(self, message: str, retry_after: float, reason: str = "queue_full") -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.reason = reason  # for the rejection counter: queue_full, queue_wait


@dataclass(frozen=True)
class AdmissionLimits:
    max_waiting_requests: int | None = opt(
        256, "requests allowed to wait for a slot (admitted, not yet running); more get 429 + Retry-After",
        bound=">= 1")
    max_queued_tokens: int | None = opt(None, "prompt tokens allowed to wait; more get 429 + Retry-After",
                                        bound=">= 1")
    max_queue_wait_s: float | None = opt(
        120.0, "longest a request may wait to be scheduled (its prefill to begin, or a free seat and the KV blocks "
               "for its prompt to wait for it behind the prefill ahead): one whose estimated start (queue "
               "depth over the measured start rate) is later gets 429 + Retry-After at once, and one still not "
               "scheduled then gets 429 instead of silence; once scheduled, a request is never refused for its wait, "
               "however long its prefill (0: no bound)", bound=">= 0")

    def __post_init__(self) -> None:
        check_options(self)


# How many recent gaps between starts the start rate is measured over
RATE_WINDOW = 64
# How often a busy loop hands freed heap memory back (allocator.release_freed), and once on going idle: the
# engine keeps freed blocks for reuse (engine/allocator.py), so without it the resident set creeps up over hours
# of varied batch shapes by what the heap happens to hold free, and between trims it holds what the steps since
# freed. Trimming costs milliseconds.
TRIM_EVERY_S = 20.0


def unused_id(request_id: str, in_use: Callable[[str], bool]) -> str:
    """`request_id`, or `request_id#2`, `#3`, ... while that is in use: the same X-Request-Id twice at once, or a
    client's retry before its first attempt's abort has reached the engine, must not clash there (the engine refuses
    an id it holds). '#' is outside the ids a client may send (server/tracing.py), so no client can name a suffixed id.
    """
    rid, k = request_id, 1
    while in_use(rid):
        k += 1
        rid = f"{request_id}#{k}"
    return rid


@dataclass(slots=True, eq=False)
class _Stream:
    num_prompt_tokens: int
    tenant: str | None  # who submitted it (a server's API key id), so a live view shows each its own ids
    queue: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)
    started: bool = False  # first output seen
    submitted: float = field(default_factory=time.monotonic)
    first: asyncio.Event = field(default_factory=asyncio.Event)  # set by the first output (or the engine's death)
    error: BaseException | None = None  # what ended the request before its first output
    # set once the scheduler has given it tokens (or by the first output, or the engine's death); stays set through
    # a preemption: a request that has started is never refused for its wait
    scheduled: asyncio.Event = field(default_factory=asyncio.Event)


class AsyncEngine(EngineClient):
    """One LLMEngine stepping in its own thread; each submitted request's outputs arrive on a RequestStream."""

    def __init__(self, engine: LLMEngine, limits: AdmissionLimits | None = None,
                 on_outputs: Callable[[list[RequestOutput]], None] | None = None) -> None:
        self.engine = engine
        engine.warm_up()  # before any request can arrive: its steps are the engine's own
        self.limits = limits or AdmissionLimits()
        self.on_outputs = on_outputs  # metrics hook, called on the event loop
        self.error: BaseException | None = None
        self._streams: dict[str, _Stream] = {}
        self._places = QueuePlaces()  # admitted requests not yet handed to the engine
        self._queued_tokens = 0
        # gaps between consecutive first outputs while requests were waiting: how fast the queue drains when it
        # has to. A gap counts only if the request starting was already waiting at the start before it: idle time
        # between bursts is no drain, nor is the wait after the requests that were queued then left unstarted.
        self._start_gaps: deque[float] = deque(maxlen=RATE_WINDOW)
        self._last_start: tuple[float, int] | None = None  # (when, requests then waiting)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake = threading.Event()
        # snapshots for a live view: the event loop asks, the engine thread builds one between two steps
        self._want_snapshot = threading.Event()
        self._snapshot_waiters: list[asyncio.Future[EngineSnapshot]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- lifecycle -------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="pagedserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self.error is None and self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        engine = self.engine
        trimmed, busy = time.monotonic(), False
        try:
            while not self._stop.is_set():
                if self._want_snapshot.is_set():  # a dashboard asked: between steps, the books balance
                    self._want_snapshot.clear()
                    self._loop.call_soon_threadsafe(self._deliver_snapshot, engine.snapshot())
                if busy and (not engine.has_unfinished() or time.monotonic() - trimmed > TRIM_EVERY_S):
                    allocator.release_freed()
                    trimmed, busy = time.monotonic(), False
                if not engine.has_unfinished():
                    engine.check_health()  # a tensor-parallel worker that dies while idle ends the loop too
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                busy = True
                outputs = engine.step(self._on_scheduled)
                if outputs:
                    self._loop.call_soon_threadsafe(self._dispatch, outputs)
        except BaseException as e:  # noqa: BLE001 - the loop must report any death
            logger.exception("engine loop died")
            self.error = e
            self._loop.call_soon_threadsafe(self._died, e)

    def _on_scheduled(self, request_ids: list[str]) -> None:
        """The engine thread, before a step's forward pass: these requests start in it."""
        self._loop.call_soon_threadsafe(self._mark_scheduled, request_ids)

    # ---- event-loop side ---------------------------------------------------------------------------
    def _mark_scheduled(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            stream = self._streams.get(request_id)
            if stream is None or stream.scheduled.is_set():
                continue
            stream.scheduled.set()
            now = time.monotonic()
            last = self._last_start
            if last is not None and last[1] > 0 and stream.submitted <= last[0]:
                self._start_gaps.append(now - last[0])
            self._last_start = (now, self.num_waiting)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if not stream.started:
                stream.started = True
                stream.first.set()
                stream.scheduled.set()  # ended before it was scheduled (aborted while it waited)
                self._queued_tokens -= stream.num_prompt_tokens
            stream.queue.put_nowait(out)
        if self.on_outputs is not None:
            self.on_outputs(outputs)

    def _died(self, error: BaseException) -> None:
        self.fail_all(EngineDeadError(f"engine loop died: {error!r}"))
        self._deliver_snapshot(EngineDeadError(f"engine loop died: {error!r}"))

    @property
    def input_processor(self) -> InputProcessor:
        return self.engine.input_processor

    @property
    def in_flight(self) -> int:
        return len(self._streams) + self._places.reserved

    def fail_all(self, error: BaseException) -> None:
        """On the event loop. Each stream that takes its error closes itself, which aborts it in the engine."""
        for stream in self._streams.values():
            if not stream.started:
                stream.error = error
            stream.queue.put_nowait(error)
            stream.first.set()
            stream.scheduled.set()

    def _deliver_snapshot(self, snapshot: EngineSnapshot | BaseException) -> None:
        waiters, self._snapshot_waiters = self._snapshot_waiters, []
        for fut in waiters:
            if fut.done():  # its caller timed out
                continue
            if isinstance(snapshot, BaseException):
                fut.set_exception(snapshot)
            else:
                fut.set_result(snapshot)

    async def snapshot(self, timeout: float = 10.0) -> EngineSnapshot:
        """The engine's state at the next step boundary (at most one step away; at once when idle). Callers at the
        same moment share one snapshot, and nothing is built while nobody asks: the loop pays only when watched."""
        if not self.alive:
            raise EngineDeadError(f"engine loop died: {self.error!r}")
        fut = asyncio.get_running_loop().create_future()
        self._snapshot_waiters.append(fut)
        self._want_snapshot.set()
        self._wake.set()
        return await asyncio.wait_for(fut, timeout)

    def tenant_of(self, request_id: str) -> str | None:
        """Who submitted a live request (`submit`'s tenant); None for unknown ids."""
        stream = self._streams.get(request_id)
        return None if stream is None else stream.tenant

    @property
    def num_waiting(self) -> int:
        """Admitted requests that are not running yet (reservations included)."""
        return self.engine.num_waiting + self._places.reserved

    @property
    def num_running(self) -> int:
        return self.engine.num_running

    def stats(self) -> EngineStats:
        """The engine's snapshot, with admitted requests not yet handed to it counted as waiting."""
        return dataclasses.replace(self.engine.stats(), num_waiting=self.num_waiting)

    def expected_wait(self, waiting: int | None = None) -> float | None:
        """Seconds until one more request would start: the requests waiting ahead of it (default: all waiting now)
        times the measured gap between starts (first scheduled) while a queue drains (None before any was
        measured; 0 with nobody waiting)."""
        if not self._start_gaps:
            return None
        return (self.num_waiting if waiting is None else waiting) * sum(self._start_gaps) / len(self._start_gaps)

    def estimated_wait(self, ahead: int | None = None) -> float:
        """Seconds until `ahead` (default: all) of the requests waiting now have started: at the measured gap between
        starts, else the engine's own estimate from its step-cost model (LLMEngine.estimated_wait)."""
        ahead = self.num_waiting if ahead is None else ahead
        if self._start_gaps:
            return ahead * sum(self._start_gaps) / len(self._start_gaps)
        return self.engine.estimated_wait(ahead)

    def drain_rate(self) -> float | None:
        """Requests started per second while a queue drains (None before any was measured): what a fleet of
        replicas adds up to estimate its own wait (server/fleet.py)."""
        if not self._start_gaps:
            return None
        mean = sum(self._start_gaps) / len(self._start_gaps)
        return 1.0 / mean if mean > 0 else None

    def reserve(self, count: int = 1) -> Reservation:
        """Admission control, called before any tokenizing: places in the queue for `count` requests, each judged
        as if the ones before it were already waiting. Raises OverloadedError when the queue is full or a new
        request would not start within max_queue_wait_s."""
        if self.error is not None:
            raise EngineDeadError(f"engine loop died: {self.error!r}")
        limit = self.limits.max_waiting_requests
        bound = self.limits.max_queue_wait_s
        for k in range(count):
            waiting = self.num_waiting + k
            if limit is not None and waiting >= limit:
                raise OverloadedError(f"server overloaded: {waiting} requests already waiting (limit {limit})",
                                      self.retry_after(self.estimated_wait(waiting - limit + 1)))
            wait = self.expected_wait(waiting)
            if bound and wait is not None and wait > bound:
                raise OverloadedError(f"server overloaded: a new request would start in about {wait:.0f} s, later "
                                      f"than the {bound:g} s allowed (--max-queue-wait-s)",
                                      self.retry_after(wait - bound), reason="queue_wait")
        return self._places.hold(count)

    def in_use(self, request_id: str) -> bool:
        """Whether a stream or the engine still holds `request_id` (the engine forgets an aborted one only at its
        next step; a stream outlives its request until the consumer closes it)."""
        return request_id in self._streams or self.engine.has_request(request_id)

    def submit(self, request: EngineRequest, places: Reservation, tenant: str | None = None) -> RequestStream:
        """Hand a request built by `input_processor.process` to the engine, with one of `places` (taken even when
        this raises OverloadedError, past the queued-token limit). The caller must `close()` the stream. It runs
        as its `request_id`, or with a suffix while that is still in use (`unused_id`); the stream's `request_id`
        says which."""
        places.take()
        n = len(request.prompt_token_ids)
        limit = self.limits.max_queued_tokens
        if limit is not None and self._queued_tokens > 0 and self._queued_tokens + n > limit:
            raise OverloadedError(f"server overloaded: {self._queued_tokens} prompt tokens queued "
                                  f"(limit {limit})",
                                  self.retry_after(self.engine.prefill_time(self._queued_tokens + n - limit)))
        if (rid := unused_id(request.request_id, self.in_use)) != request.request_id:
            logger.info("request id %s is still in use in the engine; running it as %s", request.request_id, rid)
            request = dataclasses.replace(request, request_id=rid)
        seated = self.engine.has_seat(n)  # a seat is free for it now: it waits only for the prefill ahead
        self.engine.add(request)
        stream = _Stream(n, tenant)
        self._streams[request.request_id] = stream
        self._queued_tokens += n
        if seated:
            self._mark_scheduled([request.request_id])
        self._wake.set()
        return RequestStream(self, request.request_id, stream)

    def _close(self, request_id: str, stream: _Stream, finished: bool) -> None:
        if self._streams.pop(request_id, None) is None:
            return
        if not stream.started:
            self._queued_tokens -= stream.num_prompt_tokens
        if not finished:
            self.engine.abort(request_id)
            self._wake.set()


class RequestStream:
    """Async iterator over one request's outputs; `close()` before the end aborts it (client gone)."""

    def __init__(self, engine: AsyncEngine, request_id: str, stream: _Stream) -> None:
        self.engine = engine
        self.request_id = request_id
        self._stream = stream
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._stream.queue.get()
        if isinstance(item, BaseException):
            self.close()
            raise item
        if item.finished:
            self.finished = True
            self.engine._close(self.request_id, self._stream, True)
        return item

    @property
    def started(self) -> bool:
        """It has its first output (or ended)."""
        return self._stream.first.is_set()

    @property
    def scheduled(self) -> bool:
        """The scheduler has given it tokens: its prefill has begun (or it ended)."""
        return self._stream.scheduled.is_set()

    async def wait_started(self) -> None:
        """Until the first output; raises what ended the request before one (the engine's death, a shutdown)."""
        await self._stream.first.wait()
        if self._stream.error is not None:
            self.close()
            raise self._stream.error

    async def wait_scheduled(self) -> None:
        await self._stream.scheduled.wait()

    def close(self) -> None:
        self.engine._close(self.request_id, self._stream, self.finished)
