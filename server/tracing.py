"""Request ids, the line each generation request logs when it ends, and its trace span (`--otlp-traces-endpoint`).

The `X-Request-Id` a client or its load balancer sends names the request: in the log line, in /v1/engine/state
(its engine requests are `<id>-<i>`, one per choice) and in the response's own `X-Request-Id`, which every answer
carries (errors, 401s and streams included). A request without one, or with one that is not a safe id (at most
`MAX_ID_CHARS` of `A-Z a-z 0-9 . _ : -`: it goes into logs and JSON), gets a fresh `req-<hex>`, and a bad one is
logged: a trace header is never worth refusing a request for (nginx and vLLM do the same).

OpenTelemetry is imported by server/otel.py alone, and that only when tracing is on (`tracing_from`).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..engine.output_processor import RequestMetrics
from .protocol import Usage, new_id

if TYPE_CHECKING:
    from .otel import Tracing

logger = logging.getLogger(__name__)

HEADER = "X-Request-Id"
REQUEST_KEY = "pagedserve.request"  # scope["state"][REQUEST_KEY]: the request's RequestRecord
MAX_ID_CHARS = 128
_SAFE_ID = re.compile(rb"[A-Za-z0-9._:-]{1,%d}" % MAX_ID_CHARS)
# the routes that generate, with their GenAI operation names: each logs a line when it ends, and has a span
GENERATION = {"/v1/chat/completions": "chat", "/v1/completions": "text_completion", "/v1/messages": "chat"}
TRACE_HEADERS = (b"traceparent", b"tracestate")  # W3C trace context: the caller's trace, if any


def safe_id(value: bytes | None) -> str | None:
    """The header's value if it is a safe id, else None."""
    return value.decode("ascii") if value is not None and _SAFE_ID.fullmatch(value) else None


@dataclass
class ChoiceRecord:
    """One engine request of a response, as a trace shows it. `first_ns` / `last_ns`: when this process saw its
    first and last output (time.time_ns()); they anchor the engine's stamps, which are time.monotonic() of the
    process that ran it (a replica's may be another host's)."""

    engine_id: str
    metrics: RequestMetrics | None
    first_ns: int | None
    last_ns: int | None
    finish_reason: str | None
    completion_tokens: int
    cached_tokens: int

    def wall_ns(self, stamp: float | None) -> int | None:
        """An engine stamp in this process's wall clock: relative to the first token (else the finish), whose
        output this process saw arrive."""
        m = self.metrics
        if stamp is None or m is None:
            return None
        if m.first_token_time is not None and self.first_ns is not None:
            ref, ref_ns = m.first_token_time, self.first_ns
        elif m.finish_time is not None and self.last_ns is not None:
            ref, ref_ns = m.finish_time, self.last_ns
        else:
            return None
        return ref_ns - round((ref - stamp) * 1e9)


@dataclass
class RequestRecord:
    """What a request's log line and span say: set by the middleware (id, route, status) and the pipeline
    (server/serving.py: the response id, usage, the engine requests)."""

    request_id: str
    method: str = ""
    path: str = ""
    model: str | None = None  # the served model's name
    start_ns: int = field(default_factory=time.time_ns)
    status: int | None = None
    response_id: str | None = None
    usage: Usage | None = None
    choices: list[ChoiceRecord] = field(default_factory=list)

    def finish(self, usage: Usage, outs: list[Any], streams: list[Any]) -> None:
        """The pipeline's results: `outs` are its Collected choices, `streams` their engine requests."""
        self.usage = usage
        self.choices = [ChoiceRecord(s.request_id, o.metrics, o.first_ns, o.last_ns, o.finish_reason, len(o.tokens),
                                     o.num_cached_tokens) for s, o in zip(streams, outs)]

    def log_line(self, end_ns: int) -> str:
        u = self.usage
        tokens = "prompt_tokens=- completion_tokens=- cached_tokens=-" if u is None else (
            f"prompt_tokens={u.prompt_tokens} completion_tokens={u.completion_tokens} "
            f"cached_tokens={u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0}")
        reasons = ",".join(str(c.finish_reason) for c in self.choices) or "-"
        return (f"request_id={self.request_id} {self.method} {self.path} status={self.status or '-'} {tokens} "
                f"finish_reason={reasons} seconds={(end_ns - self.start_ns) / 1e9:.3f}")


def request_record(conn: HTTPConnection) -> RequestRecord:
    """The request's record (`RequestIds` made it); a fresh one where that middleware is not in front."""
    state = conn.scope.setdefault("state", {})
    if REQUEST_KEY not in state:
        state[REQUEST_KEY] = RequestRecord(new_id("req"), conn.scope.get("method", ""), conn.scope.get("path", ""))
    return state[REQUEST_KEY]


class RequestIds:
    """The outermost layer (outside the API key and body guards, so their refusals carry the id too): names each
    HTTP request, echoes the name in every response's header, and for the generation routes logs a line when the
    response has been sent (a stream's last event included) and, with `tracing`, ends its span. `echo`: False where
    a proxy in front echoes the id already (Ray Serve's, which also makes one when none came). `on_end`: told of
    every HTTP request once its answer has gone (the per-route request counter)."""

    def __init__(self, app: ASGIApp, model: str | None = None, tracing: Tracing | None = None,
                 echo: bool = True, on_end: Callable[[RequestRecord], None] | None = None) -> None:
        self.app = app
        self.model = model
        self.tracing = tracing
        self.echo = echo
        self.on_end = on_end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = scope.get("headers") or []
        given = next((v for k, v in headers if k.lower() == b"x-request-id"), None)
        rid = safe_id(given)
        if rid is None:
            rid = new_id("req")
            if given is not None:  # repr: control characters stay escaped in the log
                logger.warning("request %s: ignored an X-Request-Id that is not a safe id (at most %d of A-Z a-z "
                               "0-9 . _ : -): %r", rid, MAX_ID_CHARS, given[:MAX_ID_CHARS])
        record = RequestRecord(rid, scope.get("method", ""), scope.get("path", ""), self.model)
        scope.setdefault("state", {})[REQUEST_KEY] = record
        operation = GENERATION.get(record.path) if record.method == "POST" else None
        span = None
        if operation is not None and self.tracing is not None:
            span = self.tracing.start(record, operation, {k.lower(): v for k, v in headers if k.lower()
                                                          in TRACE_HEADERS})
        echo = (HEADER.lower().encode(), rid.encode())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
                if self.echo:
                    message = {**message, "headers": [*(h for h in message.get("headers", [])
                                                        if h[0].lower() != echo[0]), echo]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except BaseException:
            record.status = record.status or 500  # Starlette's outer error layer answers it
            raise
        finally:
            if self.on_end is not None:
                self.on_end(record)
            if operation is not None:
                end_ns = time.time_ns()
                logger.info("%s", record.log_line(end_ns))
                if span is not None:
                    try:
                        self.tracing.end(span, record, end_ns)
                    except Exception:  # noqa: BLE001 - a trace is never worth an error once the answer has gone
                        logger.exception("request %s: its span could not be recorded", record.request_id)


def traces_url(endpoint: str) -> str:
    """An OTLP/HTTP collector's address as given, or with the traces path (`/v1/traces`) when it has none, as
    OTEL_EXPORTER_OTLP_ENDPOINT is read: `http://collector:4318` and `http://collector:4318/v1/traces` both work."""
    return endpoint if urlsplit(endpoint).path not in ("", "/") else endpoint.rstrip("/") + "/v1/traces"


def tracing_from(endpoint: str | None) -> Tracing | None:
    """Spans to the OTLP/HTTP collector at `endpoint`; None (and no OpenTelemetry import) without one."""
    if endpoint is None:
        return None
    from .otel import Tracing

    return Tracing(traces_url(endpoint))
