"""`EngineClient`: the one surface a server drives (vLLM's `vllm/engine/protocol.py`).

Two implement it: the single `AsyncEngine` (engine/async_engine.py: one engine in this process) and the Ray fleet
(server/fleet.py: replicas behind one admission). The server (server/app.py, server/serving.py) reads nothing
else: what it tokenizes and checks with (`input_processor`: the tokenizer, the context length), admission
(`reserve`), `submit`, the counts, `stats()` (speculative decoding's counters included) and the live view
(`snapshot`, which only a single engine serves).

A request's life on this surface: `reserve` holds places in the queue before anything is tokenized (the 429 comes
from here), build an `EngineRequest` with `input_processor.process` off the event loop (the 400s come from there),
`submit` it with one place of the reservation, read its `OutputStream`, `close()` it.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from .async_engine import AdmissionLimits
    from .input_processor import EngineRequest, InputProcessor
    from .llm_engine import EngineStats
    from .output_processor import RequestOutput
    from .snapshot import EngineSnapshot


class NoEngineViewError(Exception):
    """The client has no single engine to show (the Ray fleet: each replica has its own pool)."""


class QueuePlaces:
    """The count of queue places admission granted and no request holds yet: the only one, for either client."""

    __slots__ = ("reserved",)

    def __init__(self) -> None:
        self.reserved = 0

    def hold(self, count: int) -> Reservation:
        self.reserved += count
        return Reservation(self, count)


class Reservation:
    """QueuePlaces granted by `EngineClient.reserve`. Each goes to the engine with one request (`submit` takes it, even
    when it then refuses the request) or back to the queue: `release()`, or leaving a `with` block, gives back
    whatever was not handed over, so no path (a 400, a cancelled build, a refusal halfway) can leak one."""

    __slots__ = ("_places", "left")

    def __init__(self, places: QueuePlaces, count: int) -> None:
        self._places = places
        self.left = count

    def take(self) -> None:
        """One place goes to the request being submitted."""
        if self.left <= 0:
            raise RuntimeError("no place left in this reservation")
        self.left -= 1
        self._places.reserved -= 1

    def release(self) -> None:
        self._places.reserved -= self.left
        self.left = 0

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class OutputStream(Protocol):
    """One submitted request's outputs. `close()` before the end aborts it (the client left)."""

    request_id: str  # what the engine runs it as (suffixed while the id asked for is still in use)
    finished: bool

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    @property
    def scheduled(self) -> bool:
        """The engine has given it tokens or seated it (a free seat of --max-num-seqs and its prompt's KV blocks
        wait for it): from then on it is never refused for its wait (or it ended)."""

    async def wait_started(self) -> None:
        """Until the first output; raises what ended the request before one."""

    def close(self) -> None: ...


class EngineClient(ABC):
    """What a server drives; see the module's docstring. Every method runs on the event loop unless it says so."""

    input_processor: InputProcessor  # tokenizes and checks requests exactly as the engine will; any thread
    limits: AdmissionLimits

    @property
    @abstractmethod
    def alive(self) -> bool:
        """False once no request can be served (the engine died, the client shut down)."""

    @property
    @abstractmethod
    def num_waiting(self) -> int:
        """Admitted requests not running yet, reservations included."""

    @property
    @abstractmethod
    def in_flight(self) -> int:
        """Admitted requests that have not ended yet: reserved, waiting or running."""

    @abstractmethod
    def reserve(self, count: int = 1) -> Reservation:
        """QueuePlaces for `count` requests, before anything is tokenized; raises OverloadedError (the 429) when the
        queue is full or a new request would start too late, EngineDeadError when nothing can be served."""

    @abstractmethod
    def submit(self, request: EngineRequest, places: Reservation, tenant: str | None = None) -> OutputStream:
        """Hand a built request to the engine with one of `places` (taken even when this raises OverloadedError:
        too many prompt tokens queued). `tenant`: the API key's id, for `tenant_of`."""

    @abstractmethod
    def expected_wait(self) -> float | None:
        """Seconds until one more request would start, as measured while queues drained (None before that): the
        only estimate a request is refused on before it has waited."""

    @abstractmethod
    def estimated_wait(self, ahead: int | None = None) -> float | None:
        """Seconds until `ahead` (default: all) of the requests waiting now have started: at the measured drain rate
        where there is one, else estimated from what the engine knows (None: nothing known)."""

    def retry_after(self, wait: float | None = None) -> float:
        """Whole seconds in [1, 60] until a retry would likely be admitted: `wait`, by default the estimated time
        until every request waiting now has started."""
        wait = self.estimated_wait() if wait is None else wait
        return float(min(60, max(1, math.ceil(wait or 0))))

    @abstractmethod
    def stats(self) -> EngineStats | Mapping[str, EngineStats]:
        """The engine's counts now (the Ray fleet: per replica, for a `replica` label)."""

    @abstractmethod
    async def snapshot(self, timeout: float) -> EngineSnapshot:
        """The engine's state at its next step boundary, for the live view; NoEngineViewError where there is no
        single engine to show."""

    @abstractmethod
    def tenant_of(self, request_id: str) -> str | None:
        """The tenant that submitted a live request; None for unknown ids."""

    @abstractmethod
    def fail_all(self, error: BaseException) -> None:
        """End every request in flight with `error`: one not started yet raises it from `wait_started`, a running
        one from its stream (a server's stream then sends it as an error event). Their engine work is aborted."""

    @abstractmethod
    def shutdown(self) -> None: ...
