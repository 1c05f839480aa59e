"""The HTTP app: routes (OpenAI's, and Anthropic's Messages), errors in each route's dialect, SSE. The pipeline is
server/serving.py."""

from __future__ import annotations

import asyncio
import functools
import importlib.resources
import logging
import threading
from collections.abc import Callable, Mapping
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi_offline import FastAPIOffline
from pydantic import BaseModel
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.async_engine import AsyncEngine, EngineDeadError, ShuttingDownError
from ..engine.client import EngineClient, NoEngineViewError
from ..engine.llm_engine import EngineStats, LLMEngine
from .anthropic import MessagesEndpoint, count_tokens
from .anthropic_protocol import AnthropicError, CountTokensRequest, MessagesRequest, MessagesResponse, TokenCount
from .config import ServerConfig
from .connections import protocol_class
from .engine_state import EngineState, LiveWindow, engine_state
from .errors import error_answer
from .guards import ApiKeyAuth, BodyLimit
from .metrics import Metrics
from .protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    document_limits,
    now,
)
from .serving import APIError, ChatEndpoint, CompletionEndpoint, Serving, engine_dead, tenant
from .tracing import HEADER, RequestIds, RequestRecord, request_record, tracing_from

if TYPE_CHECKING:
    from .otel import Tracing

logger = logging.getLogger(__name__)

__all__ = ["ServerConfig", "create_app", "uvicorn_config"]

# The status codes each route answers with, as the OpenAPI document states them (every one in OpenAI's error shape)
ERRORS = {
    400: "Invalid request: the error's `param` names the field. Besides what this document states, a request is "
         "refused for what no JSON schema can state: a prompt over the context length, or one that tokenizes to "
         "nothing; a regex, grammar or JSON schema (guided_*, response_format, the parameters of tools that must be "
         "called) that the grammar engine cannot compile; a named tool_choice that is not among `tools`; more "
         "sequences (prompts x n) than may wait at once (--max-waiting-requests)",
    401: "Missing or wrong API key (when the server has keys)",
    404: "Unknown model",
    408: "The request body did not arrive within --body-timeout-s",
    413: "The request body is larger than --max-body-bytes",
    429: "Overloaded: retry after Retry-After seconds (also in retry-after-ms)",
    503: "The model is loading or the server is shutting down (both with Retry-After), or the engine died",
}
DRAIN_POLL_S = 0.05  # how often a drain looks whether the requests in flight have ended
FAIL_GRACE_S = 5.0  # after a drain's timeout: how long the ended requests get to send their error answers
STATE_TIMEOUT_S = 10.0  # /v1/engine/state waits at most this long for the engine's next step boundary
# The page (server/web/): its own files only. No inline script or style, so markup that model output might smuggle
# into the DOM could not run even if the renderer let it through.
WEB = importlib.resources.files("pagedserve.server") / "web"
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' "
                "data:; connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
                "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}
_RETRY_AFTER = {"Retry-After": {"description": "whole seconds to wait before retrying", "schema": {"type": "integer"}},
                "retry-after-ms": {"description": "the same, in milliseconds", "schema": {"type": "integer"}}}


# The Messages routes' statuses where they differ from OpenAI's (every one in Anthropic's error shape)
MESSAGES_ERRORS = {**ERRORS, 503: "The engine died (api_error)",
                   529: "overloaded_error: the model is loading or the server is shutting down; retry after "
                        "Retry-After seconds"}


# One server-sent event (OpenAPI 3.1: a sequential media type's schema is an item's), as an SSE parser reads it
SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {
    "type": "string", "description": "a chunk's JSON, an error's JSON (in OpenAI's shape), or [DONE] (the last)"}}}
MESSAGES_EVENT = {"type": "object", "required": ["event", "data"], "properties": {
    "event": {"type": "string", "description": "the event's type: message_start, content_block_start, ping, "
              "content_block_delta, content_block_stop, message_delta, message_stop, or error"},
    "data": {"type": "string", "description": "the event's JSON (its `type` is the event's name)"}}}
# Anthropic's keep-alive: an idle stream gets `event: ping` events, which its SDKs skip
ANTHROPIC_PING = functools.partial(ServerSentEvent, event="ping", data='{"type": "ping"}', sep="\n")


def _errors(*codes: int, model: type[BaseModel] = ErrorResponse,
            descriptions: dict[int, str] = ERRORS) -> dict[int, dict[str, Any]]:
    return {c: {"model": model, "description": descriptions[c],
                **({"headers": _RETRY_AFTER} if c in (429, 529) else {})} for c in codes}


def _messages_errors(*codes: int) -> dict[int, dict[str, Any]]:
    return _errors(*codes, model=AnthropicError, descriptions=MESSAGES_ERRORS)


def _generation(model: type[BaseModel]) -> dict[int, dict[str, Any]]:
    return {200: {"description": f"A {model.__name__}; with `stream: true`, server-sent events (`data: <chunk "
                                 "JSON>`, then `data: [DONE]`)",
                  "content": {"text/event-stream": {"schema": SSE_EVENT}}},
            **_errors(400, 401, 404, 408, 413, 429, 503)}


class Health(BaseModel):
    status: str = "ok"


def openapi_document(app: FastAPI, vocab_size: int | None = None, max_output_tokens: int | None = None,
                     priorities: bool | None = None, model_name: str | None = None) -> dict[str, Any]:
    """FastAPI's document without the 422 it adds to routes with a body: validation errors here are 400s. With the
    model's vocabulary size (once loaded), --max-output-tokens, whether priorities are scheduled (not: only
    priority 0 is accepted) and the served model's name, it states those limits too."""
    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    document_limits(doc, vocab_size, max_output_tokens, priorities, model_name)
    for path in doc.get("paths", {}).values():
        for op in path.values():
            op.get("responses", {}).pop("422", None)
    for name in ("HTTPValidationError", "ValidationError"):
        doc.get("components", {}).get("schemas", {}).pop(name, None)
    return doc


class ServerState:
    """What the routes need; `client` is set once the model has loaded (`app.state.pagedserve`)."""

    def __init__(self, config: ServerConfig) -> None:
        self.client: EngineClient | None = None  # an AsyncEngine, or a Fleet of replicas on Ray
        self.load_error: BaseException | None = None
        self.draining = False  # set by `drain`: no new requests, /ready says 503
        self.on_load_error: Callable[[], None] | None = None  # `pagedserve serve` stops the server
        self.metrics = Metrics(config.served_model_name, self.stats)
        self.live = LiveWindow()  # the live view's recent latencies and token rate

    def observe(self, outputs) -> None:
        """Each step's outputs, on the event loop."""
        self.metrics.observe(outputs)
        self.live.observe(outputs)

    def stats(self) -> EngineStats | Mapping[str, EngineStats] | None:
        if self.client is None or not self.client.alive:  # a dead engine's gauges would be stale
            return None
        return self.client.stats()

    def check_alive(self) -> None:
        """Liveness: raises once the process can no longer serve (the load failed, the engine loop died)."""
        if self.load_error is not None or (self.client is not None and not self.client.alive):
            self.ready_client()

    def admitting_client(self) -> EngineClient:
        """The client, for a new request: refused while draining."""
        if self.draining:
            raise APIError(503, "the server is shutting down", "service_unavailable", code="server_shutting_down",
                           headers={"Retry-After": "1"})
        return self.ready_client()

    async def drain(self, timeout_s: float) -> None:
        """A graceful stop: admit nothing new, let what runs finish for up to `timeout_s`, then end the rest with
        an error (a stream's error event and [DONE], a 503 otherwise) and wait for those answers to go out."""
        self.draining = True
        client = self.client
        if client is None or not client.alive:
            return
        loop = asyncio.get_running_loop()
        logger.info("draining: %d requests in flight, %g s to finish", client.in_flight, timeout_s)
        deadline = loop.time() + timeout_s
        while client.in_flight and loop.time() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        if client.in_flight:
            logger.warning("draining: ending %d requests still in flight after %g s", client.in_flight, timeout_s)
            client.fail_all(ShuttingDownError())
            deadline = loop.time() + FAIL_GRACE_S
            while client.in_flight and loop.time() < deadline:
                await asyncio.sleep(DRAIN_POLL_S)

    def ready_client(self) -> EngineClient:
        if self.client is None:
            if self.load_error is not None:
                raise APIError(503, "the model failed to load (see the server log)", "service_unavailable",
                               code="engine_unavailable")
            raise APIError(503, "the model is still loading", "service_unavailable", code="engine_loading",
                           headers={"Retry-After": "5"})
        if not self.client.alive:
            raise engine_dead(EngineDeadError())
        return self.client


def start_local(engine: LLMEngine, config: ServerConfig, on_outputs: Callable, loop) -> AsyncEngine:
    """The single server: the engine's own thread, bridged to this event loop."""
    aeng = AsyncEngine(engine, config.limits, on_outputs=on_outputs)
    aeng.start(loop)
    return aeng


def create_app(engine_factory: Callable[[], Any], config: ServerConfig, start: Callable = start_local,
               tracing: Tracing | None = None, echo_ids: bool = True) -> FastAPI:
    """`engine_factory` runs in a background thread at start-up; /ready answers 503 until it returns. `start`
    turns what it built into the EngineClient the pipeline drives: an AsyncEngine here, a Fleet of replicas on Ray
    (server/ray_app.py), called as start(built, config, on_outputs, loop). `tracing`: where request spans go
    (server/otel.py's Tracing; default: --otlp-traces-endpoint's collector, if set). `echo_ids`: answer with the
    request's X-Request-Id (not where a proxy in front does it already: Ray's)."""
    state = ServerState(config)
    tracing = tracing or tracing_from(config.otlp_traces_endpoint)
    serving = Serving(state.admitting_client, config.served_model_name, config.prefix_cache_per_key,
                      config.disconnect_poll_s, config.max_output_tokens)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loop = asyncio.get_running_loop()

        def load() -> None:
            try:
                state.client = start(engine_factory(), config, state.observe, loop)  # an AsyncEngine warms up first
            except BaseException as e:  # noqa: BLE001 - reported through /health and /ready
                logger.exception("model failed to load")
                state.load_error = e
                if state.on_load_error is not None:
                    state.on_load_error()
                return
            logger.info("ready: serving %s (max_model_len %d)", config.served_model_name,
                        state.client.input_processor.max_model_len)

        threading.Thread(target=load, name="pagedserve-load", daemon=True).start()
        yield
        if state.client is not None:
            state.client.shutdown()
        if tracing is not None:
            tracing.shutdown()  # sends the spans still batched

    api_paths: set[str] = set()  # the routes the request counter names (a bounded set of labels), once defined

    def count_request(record: RequestRecord) -> None:
        if record.path in api_paths:
            state.metrics.request(record.path, record.status)

    # FastAPIOffline serves /docs from the package's own Swagger UI files (no CDN), like every route behind the API key
    # when there is one; /openapi.json is FastAPI's route over our document
    app = FastAPIOffline(title="pagedserve", version="0.1.0", lifespan=lifespan, redoc_url=None,
                         static_url="/docs/assets",
                         description="An OpenAI-compatible LLM server: /v1/chat/completions, "
                         "/v1/completions, /v1/models; Anthropic's Messages API: /v1/messages, "
                         "/v1/messages/count_tokens; /health (liveness), /ready (readiness), /metrics; "
                         "/v1/engine/state (the live view's data); a chat page and a live view of the "
                         "engine at / and /dashboard.")
    document = functools.cache(functools.partial(openapi_document, app, max_output_tokens=config.max_output_tokens,
                                                   model_name=config.served_model_name))

    def openapi() -> dict[str, Any]:  # built again once, when the model has loaded
        inputs = state.client.input_processor if state.client is not None else None
        return document(vocab_size=getattr(inputs, "vocab_size", None),
                        priorities=None if inputs is None else inputs.scheduling_policy == "priority")

    app.openapi = openapi
    app.state.pagedserve = state
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes, timeout_s=config.body_timeout_s)
    app.add_middleware(ApiKeyAuth, keys=config.api_keys())  # before the body guard: no body is read for a bad key
    # outermost: every answer carries the request's id, a 401 or 413 too
    app.add_middleware(RequestIds, model=config.served_model_name, tracing=tracing, echo=echo_ids,
                       on_end=count_request)

    # ---- errors: in the route's dialect (server/errors.py), OpenAI's shape unless it is Anthropic's -------------
    def error(request: Request, status: int, message: str, type_: str = "invalid_request_error",
              param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None,
              extra: dict[str, str] | None = None) -> JSONResponse:
        status, body, headers = error_answer(request.url.path, status, message, type_, param, code, headers)
        return JSONResponse(body, status, headers={**(headers or {}), **(extra or {})} or None)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        if exc.reason:
            state.metrics.reject(exc.reason)
        return error(request, exc.status, exc.message, exc.type, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        first = next(iter(exc.errors()), {})
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        ctx = first.get("ctx") or {}
        if first.get("type") == "json_invalid":
            message, param = f"invalid JSON body: {ctx.get('error', first.get('msg'))}", None
        elif "param" in ctx:  # our own model-level checks name the field they refuse
            message, param = first.get("msg", "invalid value"), ctx["param"]
        else:
            message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid value')}"
            param = loc[0] if loc else None
        state.metrics.reject("invalid_request")
        return error(request, 400, message, "invalid_request_error", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error(request, exc.status_code, str(exc.detail), type_, headers=exc.headers)  # 405: Allow

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        logger.exception("unhandled error")  # the details go to the log, never to the client
        # answered by Starlette's outermost layer, outside RequestIds: the id is added here
        return error(request, 500, "internal server error", "internal_server_error", code="internal_error",
                     extra={HEADER: request_record(request).request_id} if echo_ids else None)

    # ---- routes ------------------------------------------------------------------------------------------
    @app.get("/health", response_model=Health, responses=_errors(503))
    async def health():
        """Liveness: 200 while the process can serve, loading and draining included; 503 once the model failed to
        load or the engine loop died (restart it). Never behind the API key."""
        state.check_alive()
        return Health()

    @app.get("/ready", response_model=Health, responses=_errors(503))
    async def ready():
        """Readiness: 200 once the model is loaded and the engine loop runs, until the server starts draining
        (SIGTERM); 503 otherwise, so a load balancer sends requests elsewhere. Never behind the API key."""
        state.admitting_client()
        return Health()

    @app.get("/v1/models", response_model=ModelList, responses=_errors(401, 503))
    async def models():
        inputs = state.ready_client().input_processor
        name = config.served_model_name
        return ModelList(data=[ModelCard(id=name, created=now(), root=name, max_model_len=inputs.max_model_len)])

    @app.get("/metrics", response_class=PlainTextResponse, responses={
        200: {"description": "Prometheus text format, under vLLM's metric names",
              "content": {"text/plain": {"schema": {"type": "string"}}}}, **_errors(401)})
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/engine/state", response_model=EngineState, responses=_errors(401, 404, 503))
    async def engine_state_(raw: Request):
        """What the engine is doing now: counts, the last step, the KV pool block by block, who holds what; ids
        only for the caller's own requests, never any text. Built by the engine loop between two steps. (With
        --replicas each replica has its own pool: 404.)"""
        client = state.ready_client()
        try:
            snap = await client.snapshot(STATE_TIMEOUT_S)
        except NoEngineViewError as e:
            raise APIError(404, "the engine view is served by a single server, not by --replicas",
                           "invalid_request_error", code="not_found") from e
        except EngineDeadError as e:
            raise engine_dead(e) from e
        except asyncio.TimeoutError as e:  # one step longer than this: a huge prefill chunk on a slow machine
            raise APIError(503, f"the engine did not finish its step within {STATE_TIMEOUT_S:g} s",
                           "service_unavailable", code="engine_busy", headers={"Retry-After": "1"}) from e
        stats = client.stats()  # a single engine's, as it serves the view
        spec = stats.spec_decode if isinstance(stats, EngineStats) else None
        return engine_state(snap, config.served_model_name, tenant(raw), client.tenant_of, state.live,
                            state.metrics.num_overloaded, spec)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses=_generation(ChatCompletionResponse))
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        return _respond(await serving.generate(ChatEndpoint, body, raw))

    @app.post("/v1/completions", response_model=CompletionResponse, responses=_generation(CompletionResponse))
    async def completions(body: CompletionRequest, raw: Request):
        return _respond(await serving.generate(CompletionEndpoint, body, raw))

    # ---- Anthropic's Messages API (server/anthropic.py): the same pipeline, its own shapes ----------------------
    @app.post("/v1/messages", response_model=MessagesResponse, responses={
        200: {"description": "A MessagesResponse; with `stream: true`, server-sent events (`event: <type>` and "
                             "`data: <event JSON>`, from message_start to message_stop)",
              "content": {"text/event-stream": {"schema": MESSAGES_EVENT}}},
        **_messages_errors(400, 401, 404, 408, 413, 429, 503, 529)})
    async def messages(body: MessagesRequest, raw: Request):
        """Anthropic's Messages API (what Claude Code and the `anthropic` SDK speak); `x-api-key` is accepted as the
        key, `anthropic-version` is not checked."""
        return _respond(await serving.generate(MessagesEndpoint, body, raw), ping=ANTHROPIC_PING)

    @app.post("/v1/messages/count_tokens", response_model=TokenCount,
              responses=_messages_errors(400, 401, 404, 408, 413, 503, 529))
    async def messages_count_tokens(body: CountTokensRequest, raw: Request):
        """The prompt's tokens (system, messages and tools through the chat template), as /v1/messages counts
        them; nothing runs on the engine."""
        return await serving.read_prompt(body, functools.partial(count_tokens, body=body), "messages")

    api_paths.update(r.path for r in app.routes if getattr(r, "path", "").startswith("/v1/"))

    # ---- the page: a chat playground and the live view, from files in the package (no CDN, no build step) ---
    # Open to all, like /health: it holds no data; what it shows comes from /v1/*, with the key the user gives it.
    @app.get("/", include_in_schema=False)
    @app.get("/dashboard", include_in_schema=False)
    async def page():
        return FileResponse(str(WEB / "index.html"), headers=PAGE_HEADERS)

    app.mount("/web", StaticFiles(directory=str(WEB)), name="web")

    return app


def uvicorn_config(app: FastAPI, config: ServerConfig) -> uvicorn.Config:
    """How `pagedserve serve` runs the app: uvicorn's h11 protocol with a header deadline and a connection cap
    that idle sockets cannot fill (server/connections.py)."""
    return uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                          timeout_graceful_shutdown=5, timeout_keep_alive=config.keep_alive_timeout_s,
                          http=protocol_class(config.header_timeout_s, config.max_connections),
                          h11_max_incomplete_event_size=64 * 1024)  # request line + headers


def _respond(result, ping: Callable[[], ServerSentEvent] | None = None):
    """A response model as JSON, or a stream of SSE events (sse-starlette, `sep="\\n"`); `ping`: the keep-alive
    event of the route's dialect (default: an SSE comment)."""
    if hasattr(result, "__aiter__"):
        return EventSourceResponse(result, sep="\n", ping=15, ping_message_factory=ping)
    return JSONResponse(result.model_dump())
