"""Connection hygiene for a server that faces clients directly: uvicorn's h11 protocol with three rules.

1. A request's line and headers must arrive within `header_timeout_s` of the connection opening (or of its
   previous response ending): a socket that sends nothing, or trickles its headers a byte at a time, is closed
   (with a 408 when it had begun a request), so silent sockets cannot pile up.
2. The connection cap counts sockets, and idle ones (no request in flight) give way: a connection that arrives at
   the cap closes the connection that has been idle longest; only when every connection carries a request does
   the newcomer get a 503 with Retry-After, then a close.
3. Every refusal at this level is OpenAI's error JSON, never plain text.

uvicorn alone has no header deadline (its keep-alive timer starts after a first response) and its
`limit_concurrency` counts idle sockets and answers in plain text: a client that opens sockets and sends nothing
fills the cap, and every user is locked out (docs/performance.md, "Connections", has the flood that showed it).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import time

from uvicorn.protocols.http.h11_impl import H11Protocol

from .protocol import error_body


def is_loopback(host: str) -> bool:
    """Literal loopback addresses and `localhost` only: no DNS lookup decides whether a server may run without
    an API key or a benchmark may load a host (a name may resolve to anything)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"

RETRY_AFTER_S = 1  # a refused connection may retry at once: idle ones are reaped as they expire


def raw_error(status: int, reason: str, message: str, type_: str, code: str) -> bytes:
    """A whole HTTP/1.1 error response (written without h11: there may be no request to answer)."""
    body = json.dumps(error_body(message, type_, None, code)).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"retry-after: {RETRY_AFTER_S}\r\nconnection: close\r\n\r\n")
    return head.encode() + body


def protocol_class(header_timeout_s: float, max_connections: int | None) -> type[H11Protocol]:
    """The protocol uvicorn runs for each connection (`uvicorn.Config(http=...)`), with these limits."""

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            self.idle_since: float | None = time.monotonic()
            self.partial = False  # bytes of a request whose headers are not complete yet
            self.header_timer: asyncio.TimerHandle | None = None
            if max_connections is not None and len(self.connections) > max_connections and not self._make_room():
                transport.write(raw_error(503, "Service Unavailable", "the server is at its connection limit; "
                                          "retry shortly", "service_unavailable", "too_many_connections"))
                transport.close()
                return
            self._arm()

        def _make_room(self) -> bool:
            """Close the connection idle longest (not this one); False if every other one is busy."""
            idle = [p for p in self.connections if p is not self and getattr(p, "idle_since", None) is not None]
            if not idle:
                return False
            oldest = min(idle, key=lambda p: p.idle_since)
            oldest.idle_since = None
            oldest.transport.close()
            return True

        def _arm(self) -> None:
            self._disarm()
            self.header_timer = self.loop.call_later(header_timeout_s, self._header_timeout)

        def _disarm(self) -> None:
            if getattr(self, "header_timer", None) is not None:
                self.header_timer.cancel()
                self.header_timer = None

        def _header_timeout(self) -> None:
            self.header_timer = None
            if self.transport.is_closing():
                return
            if self.partial:
                self.transport.write(raw_error(408, "Request Timeout", "the request line and headers did not "
                                               f"arrive within {header_timeout_s:g} s", "invalid_request_error",
                                               "request_timeout"))
            self.idle_since = None
            self.transport.close()

        def _request_started(self) -> bool:
            """Whether the current request's headers are in (a cycle is running or has run for it)."""
            return self.cycle is not None and not self.cycle.response_complete

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._request_started():
                self._disarm()
                self.idle_since, self.partial = None, False
            elif not self.transport.is_closing():
                self.partial = True

        def on_response_complete(self) -> None:
            super().on_response_complete()  # may start a pipelined request at once
            if not self.transport.is_closing() and not self._request_started():
                self.idle_since, self.partial = time.monotonic(), False
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            self.idle_since = None
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            self.transport.write(raw_error(400, "Bad Request", msg, "invalid_request_error", "invalid_http"))
            self.transport.close()

    return GuardedH11Protocol
