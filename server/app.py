"""The OpenAI-compatible HTTP app: routes, errors in OpenAI's shape, SSE. The pipeline is server/serving.py."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.async_engine import AsyncEngine
from engine.llm_engine import EngineStats, LLMEngine
from server.config import ServerConfig
from server.connections import protocol_class
from server.guards import ApiKeyAuth, BodyLimit
from server.metrics import Metrics
from server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    error_body,
    now,
)
from server.serving import ENGINE_DEAD, APIError, ChatEndpoint, CompletionEndpoint, Serving

logger = logging.getLogger(__name__)

__all__ = ["ServerConfig", "create_app", "uvicorn_config"]


class ServerState:
    """What the routes need; `engine` is set once the model has loaded (`app.state.pagedserve`)."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.engine: AsyncEngine | None = None
        self.load_error: BaseException | None = None
        self.on_load_error: Callable[[], None] | None = None  # `pagedserve serve` stops the server
        self.metrics = Metrics(config.served_model_name, self.stats)

    def stats(self) -> EngineStats | None:
        if self.engine is None or not self.engine.alive:  # a dead engine's gauges would be stale
            return None
        return self.engine.stats()

    def ready_engine(self) -> AsyncEngine:
        if self.engine is None:
            if self.load_error is not None:
                raise APIError(503, "the model failed to load (see the server log)", "service_unavailable",
                               code="engine_unavailable")
            raise APIError(503, "the model is still loading", "service_unavailable", code="engine_loading",
                           headers={"Retry-After": "5"})
        if not self.engine.alive:
            raise APIError(503, ENGINE_DEAD, "service_unavailable", code="engine_dead")
        return self.engine


def create_app(engine_factory: Callable[[], LLMEngine], config: ServerConfig) -> FastAPI:
    """`engine_factory` runs in a background thread at start-up; /health answers 503 until it returns."""
    state = ServerState(config)
    serving = Serving(state.ready_engine, config.served_model_name, config.prefix_cache_per_key,
                      config.disconnect_poll_s, state.metrics.reject)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loop = asyncio.get_running_loop()

        def load() -> None:
            try:
                engine = engine_factory()
            except BaseException as e:  # noqa: BLE001 - reported through /health
                logger.exception("model failed to load")
                state.load_error = e
                if state.on_load_error is not None:
                    state.on_load_error()
                return
            aeng = AsyncEngine(engine, config.limits, on_outputs=state.metrics.observe)
            aeng.start(loop)
            state.engine = aeng
            logger.info("ready: serving %s (max_model_len %d)", config.served_model_name, engine.max_model_len)

        threading.Thread(target=load, name="pagedserve-load", daemon=True).start()
        yield
        if state.engine is not None:
            state.engine.shutdown()

    app = FastAPI(title="pagedserve", lifespan=lifespan)
    app.state.pagedserve = state
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes, timeout_s=config.body_timeout_s)
    app.add_middleware(ApiKeyAuth, keys=config.api_keys())  # outermost: no body is read for a bad key

    # ---- errors: always the OpenAI shape -----------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        if exc.reason:
            state.metrics.reject(exc.reason)
        return JSONResponse(exc.body(), exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
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
        return JSONResponse(error_body(message, "invalid_request_error", param), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), type_), exc.status_code, headers=exc.headers)  # 405: Allow

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        logger.exception("unhandled error")  # the details go to the log, never to the client
        return JSONResponse(error_body("internal server error", "internal_server_error", code="internal_error"), 500)

    # ---- routes ------------------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        state.ready_engine()
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> ModelList:
        engine = state.ready_engine().engine
        name = config.served_model_name
        return ModelList(data=[ModelCard(id=name, created=now(), root=name, max_model_len=engine.max_model_len)])

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        return _respond(await serving.generate(ChatEndpoint, body, raw))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        return _respond(await serving.generate(CompletionEndpoint, body, raw))

    return app


def uvicorn_config(app: FastAPI, config: ServerConfig) -> uvicorn.Config:
    """How `pagedserve serve` runs the app: uvicorn's h11 protocol with a header deadline and a connection cap
    that idle sockets cannot fill (server/connections.py)."""
    return uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                          timeout_graceful_shutdown=5, timeout_keep_alive=config.keep_alive_timeout_s,
                          http=protocol_class(config.header_timeout_s, config.max_connections),
                          h11_max_incomplete_event_size=64 * 1024)  # request line + headers


def _respond(result):
    """A response model as JSON, or a stream of SSE `data:` lines (sse-starlette, `sep="\\n"`)."""
    if hasattr(result, "__aiter__"):
        return EventSourceResponse(result, sep="\n", ping=15)
    return JSONResponse(result.model_dump())
