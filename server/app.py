"""The OpenAI-compatible HTTP server: routes, admission (429), SSE streaming, errors, metrics."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.async_engine import AdmissionLimits, AsyncEngine, EngineDeadError, OverloadedError, RequestStream
from engine.config import opt
from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine, RequestOutput
from engine.sampler import TokenLogprob
from engine.sampling_params import SamplingParams
from server.guards import TENANT_KEY, ApiKeyAuth, BodyLimit
from server.metrics import Metrics
from server.protocol import ChatCompletionRequest, CompletionRequest, error_body, new_id, now, usage
from server.structured import logit_bias, structured_spec
from server.tools import ToolCallParser, parse_tool_calls, render_messages, resolve_tool_choice, tool_grammar

logger = logging.getLogger(__name__)
_ENGINE_DEAD = "the engine loop died (see the server log)"  # no exception text reaches a client


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.param, self.code), self.status,
                            headers=self.headers)


@dataclass
class ServerConfig:
    served_model_name: str | None = opt(None, "model name clients send and /v1/models lists "
                                              "(default: the model file's name)")
    limits: AdmissionLimits = field(default_factory=AdmissionLimits)
    host: str = opt("127.0.0.1", "address to listen on")
    port: int = opt(8000, "port to listen on")
    log_level: str = opt("info", "uvicorn log level")
    api_key: str | None = opt(None, "comma-separated API keys that /v1/* and /metrics require as Bearer tokens "
                                    "(default: $PAGEDSERVE_API_KEY; none: no auth, loopback only)")
    allow_insecure_no_auth: bool = opt(False, "serve on a non-loopback address with no API key")
    prefix_cache_per_key: bool = opt(True, "with API keys: each key gets its own prefix cache, so tenants never "
                                           "share KV blocks (or learn what others sent from hit timing)")
    max_body_bytes: int = opt(8 * 2**20, "largest request body accepted; more gets 413")
    body_timeout_s: float = opt(30.0, "time allowed to receive a request body; slower gets 408")
    keep_alive_timeout_s: int = opt(5, "idle keep-alive connections are closed after this many seconds")
    max_connections: int | None = opt(1024, "concurrent connections beyond which new requests get 503")
    disconnect_poll_s: float = 0.1

    def api_keys(self) -> tuple[str, ...]:
        return tuple(k.strip() for k in (self.api_key or "").split(",") if k.strip())


class _State:
    """What the routes need; filled in when the engine finishes loading."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.engine: AsyncEngine | None = None
        self.load_error: BaseException | None = None
        self.metrics = Metrics(config.served_model_name, self.snapshot)

    def snapshot(self) -> dict[str, float] | None:
        if self.engine is None or not self.engine.alive:  # a dead engine's gauges would be stale
            return None
        e = self.engine.engine
        stats = e.scheduler.stats
        return {"running": self.engine.num_running, "waiting": self.engine.num_waiting,
                "kv_usage": e.block_manager.usage(), "preemptions": stats.num_preemptions,
                "prefix_queries": stats.prefix_cache_queries, "prefix_hits": stats.prefix_cache_hits,
                "spec": e.speculator.stats if e.speculator is not None else None}

    def ready_engine(self) -> AsyncEngine:
        if self.engine is None:
            if self.load_error is not None:
                raise APIError(503, "the model failed to load (see the server log)", "service_unavailable",
                               code="engine_unavailable")
            raise APIError(503, "the model is still loading", "service_unavailable", code="engine_loading",
                           headers={"Retry-After": "5"})
        if not self.engine.alive:
            raise APIError(503, _ENGINE_DEAD, "service_unavailable",
                           code="engine_dead")
        return self.engine


def create_app(engine_factory: Callable[[], LLMEngine], config: ServerConfig) -> FastAPI:
    """`engine_factory` runs in a background thread at start-up; /health answers 503 until it returns."""
    state = _State(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loop = asyncio.get_running_loop()

        def load() -> None:
            try:
                engine = engine_factory()
            except BaseException as e:  # noqa: BLE001 - reported through /health
                logger.exception("model failed to load")
                state.load_error = e
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

    # ---- errors: always the OpenAI shape -----------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        reason = {400: "invalid_request", 404: "model_not_found", 429: "queue_full"}.get(exc.status)
        if reason:
            state.metrics.reject(reason)
        return exc.response()

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

    # ---- plain routes -------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        state.ready_engine()
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        engine = state.ready_engine().engine
        return {"object": "list", "data": [{
            "id": config.served_model_name, "object": "model", "created": now(), "owned_by": "pagedserve",
            "root": config.served_model_name, "max_model_len": engine.max_model_len}]}  # no server paths

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    # ---- generation ---------------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        aeng = _admit(body, count=body.n)
        engine = aeng.engine
        salt = _cache_salt(body, raw, config)

        def build():  # in a worker thread: templating and tokenizing are O(prompt size)
            tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
            try:
                choice = resolve_tool_choice(tools, body.tool_choice)
                messages = [m.model_dump(exclude_none=True, include={"role", "name", "tool_calls", "tool_call_id"})
                            | {"content": m.text()} for m in body.messages]
                engine.check_prompt_chars(sum(len(m["content"]) for m in messages), "messages")
                messages, template_tools = render_messages(messages, tools, choice, engine.tokenizer)
                ids = engine.encode_chat(messages, tools=template_tools)
                spec = tool_grammar(tools, choice, body.parallel_tool_calls) or structured_spec(body)
            except InvalidRequestError as e:
                raise APIError(400, e.message, param=e.param, code=e.code) from e
            except ValueError as e:
                raise APIError(400, str(e), param="messages") from e
            max_tokens = body.max_completion_tokens or body.max_tokens
            lp = (body.top_logprobs or 0) if body.logprobs else None
            return ids, choice.mode != "none", [(ids, _params(body, max_tokens, lp, i, salt, spec))
                                                for i in range(body.n)]

        prompt_ids, tools_on, jobs = await _build_or_release(aeng, body.n, build)
        streams = _submit(aeng, jobs, param="messages")
        rid, created = new_id("chatcmpl"), now()
        prompt_tokens = len(prompt_ids)
        tokenizer = engine.tokenizer
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return _sse(_chat_chunks(streams, rid, created, config.served_model_name, prompt_tokens, include_usage,
                                     tokenizer, body.logprobs, tools_on))
        outs = await _collect(streams, raw, state)
        choices = [{
            "index": i,
            **_chat_message(o["text"], o["finish_reason"], tools_on),
            "logprobs": {"content": _chat_logprobs(tokenizer, o["logprobs"])} if body.logprobs else None,
        } for i, o in enumerate(outs)]
        return {"id": rid, "object": "chat.completion", "created": created, "model": config.served_model_name,
                "choices": choices, "usage": usage(prompt_tokens, sum(len(o["tokens"]) for o in outs), *_drafts(outs))}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        prompts = body.prompts()
        aeng = _admit(body, count=len(prompts) * body.n)
        engine = aeng.engine
        salt = _cache_salt(body, raw, config)
        # echo + logprobs scores the prompt too (lm-evaluation-harness's loglikelihood), as vLLM does
        score_prompt = body.logprobs if body.echo and body.logprobs is not None else None

        def build():  # in a worker thread: tokenizing is O(prompt size)
            for p in prompts:  # refuse what cannot fit before tokenizing anything
                if isinstance(p, str):
                    engine.check_prompt_chars(len(p), "prompt")
            jobs, total_tokens = [], 0
            for p in prompts:
                ids = engine.tokenize(p) if isinstance(p, str) else p
                total_tokens += len(ids)
                max_tokens = 16 if body.max_tokens is None else body.max_tokens
                jobs += [(ids, _params(body, max_tokens, body.logprobs, i, salt, spec, prompt_logprobs=score_prompt))
                         for i in range(body.n)]
            return total_tokens, jobs

        try:
            spec = structured_spec(body)
        except InvalidRequestError as e:
            for _ in range(len(prompts) * body.n):
                aeng.release()
            raise APIError(400, e.message, param=e.param) from e

        prompt_tokens, jobs = await _build_or_release(aeng, len(prompts) * body.n, build)
        streams = _submit(aeng, jobs, param="prompt")
        rid, created = new_id("cmpl"), now()
        tokenizer = engine.tokenizer
        echo = [(p if isinstance(p, str) else _text(tokenizer, p)) if body.echo else "" for p in prompts
                for _ in range(body.n)]
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return _sse(_completion_chunks(streams, rid, created, config.served_model_name, prompt_tokens,
                                           include_usage, tokenizer, body.logprobs is not None, echo,
                                           [ids for ids, _ in jobs]))
        outs = await _collect(streams, raw, state)
        choices = [{
            "index": i, "text": echo[i] + o["text"],
            "logprobs": (_completion_logprobs(
                tokenizer, _with_prompt(jobs[i][0], o["prompt_logprobs"], o["logprobs"]),
                0 if o["prompt_logprobs"] is not None else len(echo[i])) if body.logprobs is not None else None),
            "finish_reason": o["finish_reason"],
        } for i, o in enumerate(outs)]
        return {"id": rid, "object": "text_completion", "created": created, "model": config.served_model_name,
                "choices": choices, "usage": usage(prompt_tokens, sum(len(o["tokens"]) for o in outs), *_drafts(outs))}

    def _admit(body, count: int = 1) -> AsyncEngine:
        """Model check, then the queue limit: both before any tokenizing or streaming."""
        aeng = state.ready_engine()
        if body.model is not None and body.model != config.served_model_name:
            raise APIError(404, f"The model `{body.model}` does not exist.", "invalid_request_error", "model",
                           "model_not_found")
        limit = aeng.limits.max_waiting_requests
        if limit is not None and count > limit:  # could never be admitted: not a 429 to retry for ever
            raise APIError(400, f"this request needs {count} sequences (prompts x n) but at most {limit} may "
                           "wait at once (--max-waiting-requests)", param="n")
        reserved = 0
        try:
            for _ in range(count):
                aeng.reserve()
                reserved += 1
        except OverloadedError as e:
            for _ in range(reserved):
                aeng.release()
            raise _overloaded(e) from e
        except EngineDeadError as e:
            raise APIError(503, _ENGINE_DEAD, "service_unavailable", code="engine_dead") from e
        return aeng

    return app


async def _build_or_release(aeng: AsyncEngine, reserved: int, build: Callable[[], Any]) -> Any:
    """Run `build` (template, tokenize, validate params) off the event loop; if it fails, give the admission
    reservations back."""
    try:
        return await asyncio.to_thread(build)
    except BaseException as e:
        for _ in range(reserved):
            aeng.release()
        if isinstance(e, InvalidRequestError):
            raise APIError(400, e.message, param=e.param, code=e.code) from e
        raise


def _cache_salt(body, raw: Request, config: ServerConfig) -> str | None:
    """The request's prefix-cache namespace: its API key's (when namespacing per key) and its own cache_salt."""
    tenant = raw.scope.get("state", {}).get(TENANT_KEY) if config.prefix_cache_per_key else None
    if tenant is None:
        return body.cache_salt
    return f"key:{tenant}\x00{body.cache_salt or ''}"


def _overloaded(e: OverloadedError) -> APIError:
    seconds = max(1, min(60, math.ceil(e.retry_after)))
    return APIError(429, f"{e} Retry after {seconds} s.", "rate_limit_error", code="server_overloaded",
                    headers={"Retry-After": str(seconds), "retry-after-ms": str(int(seconds * 1000))})


def _params(body, max_tokens: int | None, logprobs: int | None, index: int, salt: str | None,
            structured=None, prompt_logprobs: int | None = None) -> SamplingParams:
    seed = None
    if body.seed is not None:  # n choices differ but stay reproducible; wrap to stay a valid 64-bit seed
        seed = body.seed + index
        seed = seed - 2**64 if seed >= 2**64 else seed
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0,
            seed=seed,
            stop=body.stop or [],
            stop_token_ids=body.stop_token_ids or [],
            ignore_eos=body.ignore_eos,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            logprobs=logprobs,
            cache_salt=salt,
            prompt_logprobs=prompt_logprobs,
            structured=structured,
            logit_bias=logit_bias(body),
            allowed_token_ids=body.allowed_token_ids,
        )
    except InvalidRequestError as e:
        raise APIError(400, e.message, param=e.param) from e


def _submit(aeng: AsyncEngine, jobs: list[tuple[list[int], SamplingParams]], param: str) -> list[RequestStream]:
    """Hand one reserved sub-request per job to the engine, or none: every reservation is consumed or released.

    All jobs are validated first so that a bad one leaves nothing behind in the engine.
    """
    streams: list[RequestStream] = []
    attempts = 0  # each submit call consumes its reservation, whether or not it succeeds
    try:
        for ids, params in jobs:
            aeng.validate(ids, params)
        base = new_id("req")
        for i, (ids, params) in enumerate(jobs):
            attempts += 1
            streams.append(aeng.submit(f"{base}-{i}", ids, params))
    except BaseException as e:
        for s in streams:
            s.close()
        for _ in range(len(jobs) - attempts):
            aeng.release()
        if isinstance(e, OverloadedError):
            raise _overloaded(e) from e
        if isinstance(e, InvalidRequestError):
            raise APIError(400, e.message, param=e.param if e.code != "context_length_exceeded" else param,
                           code=e.code) from e
        raise
    return streams


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several sub-requests (n > 1, prompt lists) in arrival order, tagged with the choice index."""
    try:
        if len(streams) == 1:
            async for out in streams[0]:
                yield 0, out
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                async for out in stream:
                    queue.put_nowait((i, out))
            except BaseException as e:  # noqa: BLE001 - re-raised by the consumer
                queue.put_nowait((i, e))
            finally:
                queue.put_nowait((i, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            remaining = len(streams)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
    finally:
        for s in streams:
            s.close()


async def _collect(streams: list[RequestStream], raw: Request, state: _State) -> list[dict[str, Any]]:
    """Run to completion, watching for a client that hangs up (then abort and free everything)."""
    outs = [{"text": "", "tokens": [], "logprobs": [], "prompt_logprobs": None, "finish_reason": None,
             "drafts": (0, 0)} for _ in streams]

    async def consume() -> None:
        async for i, out in _merge(streams):
            o = outs[i]
            o["text"] += out.text
            o["tokens"] += out.new_token_ids
            o["logprobs"] += out.logprobs
            if out.prompt_logprobs is not None:
                o["prompt_logprobs"] = out.prompt_logprobs
            o["drafts"] = (out.num_draft_tokens, out.num_accepted_tokens)
            if out.finished:
                o["finish_reason"] = out.finish_reason

    task = asyncio.create_task(consume())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=state.config.disconnect_poll_s)
            if done:
                break
            if await raw.is_disconnected():
                task.cancel()  # closing the streams aborts the requests; metrics count them as "abort"
                raise APIError(499, "client disconnected", "client_closed_request")
        task.result()
    except EngineDeadError as e:
        raise APIError(503, _ENGINE_DEAD, "service_unavailable", code="engine_dead") from e
    finally:
        if not task.done():
            task.cancel()
        for s in streams:
            s.close()
    return outs


def _drafts(outs: list[dict[str, Any]]) -> tuple[int, int]:
    """Speculative decoding's (drafted, accepted) token counts over a response's choices."""
    return sum(o["drafts"][0] for o in outs), sum(o["drafts"][1] for o in outs)


def _sse(chunks: AsyncIterator[str]) -> EventSourceResponse:
    return EventSourceResponse(chunks, sep="\n", ping=15)


async def _guard(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """Errors after the stream started become an error event, then [DONE]."""
    try:
        async for c in chunks:
            yield c
    except EngineDeadError:
        yield json.dumps(error_body(_ENGINE_DEAD, "service_unavailable", code="engine_dead"))
    except InvalidRequestError as e:
        yield json.dumps(error_body(e.message, "invalid_request_error", e.param, e.code or "invalid_request"))
    except Exception:  # noqa: BLE001 - the stream already started: report in-band, details to the log only
        logger.exception("error while streaming")
        yield json.dumps(error_body("internal server error", "internal_server_error", code="internal_error"))
    yield "[DONE]"


def _chat_message(text: str, finish_reason: str | None, tools_on: bool) -> dict[str, Any]:
    """A non-streamed choice's message and finish_reason; tool calls parsed out when tools are offered."""
    if tools_on:
        content, calls = parse_tool_calls(text)
        if calls:
            return {"message": {"role": "assistant", "content": content, "tool_calls": calls},
                    "finish_reason": "tool_calls" if finish_reason == "stop" else finish_reason}
    return {"message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}


def _chat_chunks(streams, rid, created, model, prompt_tokens, include_usage, tokenizer, want_logprobs,
                 tools_on=False):
    def chunk(i: int, delta: dict, finish: str | None = None, logprobs=None) -> str:
        body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
        return json.dumps(body)

    async def gen() -> AsyncIterator[str]:
        for i in range(len(streams)):
            yield chunk(i, {"role": "assistant", "content": ""})
        completion_tokens = 0
        drafts = [{"drafts": (0, 0)} for _ in streams]
        parsers = [ToolCallParser() for _ in streams] if tools_on else None
        async for i, out in _merge(streams):
            completion_tokens += len(out.new_token_ids)
            drafts[i]["drafts"] = (out.num_draft_tokens, out.num_accepted_tokens)
            lp = {"content": _chat_logprobs(tokenizer, out.logprobs)} if want_logprobs and out.logprobs else None
            if parsers is not None:  # text goes through the tool-call parser: content and tool_calls deltas
                deltas = parsers[i].feed(out.text) + (parsers[i].finish() if out.finished else [])
                for d in deltas[:-1]:
                    yield chunk(i, d)
                if deltas or lp:
                    yield chunk(i, deltas[-1] if deltas else {}, None, lp)
                if out.finished:
                    finish = "tool_calls" if parsers[i].calls and out.finish_reason == "stop" else out.finish_reason
                    yield chunk(i, {}, finish)
            elif out.text or lp or out.finished:
                yield chunk(i, {"content": out.text} if out.text else {},
                            out.finish_reason if out.finished else None, lp)
        if include_usage:
            yield json.dumps({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                              "choices": [], "usage": usage(prompt_tokens, completion_tokens, *_drafts(drafts))})

    return _guard(gen())


def _completion_chunks(streams, rid, created, model, prompt_tokens, include_usage, tokenizer, want_logprobs,
                       echo, prompt_ids):
    def chunk(i: int, text: str, finish: str | None = None, logprobs=None) -> str:
        return json.dumps({"id": rid, "object": "text_completion", "created": created, "model": model,
                           "choices": [{"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}]})

    async def gen() -> AsyncIterator[str]:
        for i, text in enumerate(echo):
            if text:
                yield chunk(i, text)
        completion_tokens = 0
        offsets = [len(text) for text in echo]  # text_offset counts the echoed prompt and earlier chunks
        drafts = [{"drafts": (0, 0)} for _ in streams]
        async for i, out in _merge(streams):
            completion_tokens += len(out.new_token_ids)
            drafts[i]["drafts"] = (out.num_draft_tokens, out.num_accepted_tokens)
            lp = None
            if want_logprobs:
                if out.prompt_logprobs is not None:  # the echoed prompt's own entries come first, from offset 0
                    offsets[i] = 0
                lps = _with_prompt(prompt_ids[i], out.prompt_logprobs, out.logprobs)
                if lps:
                    lp = _completion_logprobs(tokenizer, lps, offsets[i])
                    offsets[i] = lp["text_offset"][-1] + len(lp["tokens"][-1])
            if out.text or lp or out.finished:
                yield chunk(i, out.text, out.finish_reason if out.finished else None, lp)
        if include_usage:
            yield json.dumps({"id": rid, "object": "text_completion", "created": created, "model": model,
                              "choices": [], "usage": usage(prompt_tokens, completion_tokens, *_drafts(drafts))})

    return _guard(gen())


def _text(tokenizer, token_ids: list[int]) -> str:
    return tokenizer.decode(token_ids) if tokenizer is not None else " ".join(map(str, token_ids))


def _piece(tokenizer, token_id: int) -> str:
    return _text(tokenizer, [token_id])


def _chat_logprobs(tokenizer, lps: list[TokenLogprob]) -> list[dict[str, Any]]:
    def entry(tok: int, lp: float) -> dict[str, Any]:
        s = _piece(tokenizer, tok)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    return [{**entry(x.token_id, x.logprob), "top_logprobs": [entry(t, v) for t, v in x.top]} for x in lps]


def _with_prompt(prompt_ids: list[int], prompt_lps, lps: list[TokenLogprob]) -> list:
    """Echoed prompt entries (token id, or None for the first token, which has no logprob) + generated ones."""
    if prompt_lps is None:
        return lps
    return [x if x is not None else TokenLogprob(t, None, None) for t, x in zip(prompt_ids, prompt_lps)] + lps


def _completion_logprobs(tokenizer, lps: list[TokenLogprob], start: int = 0) -> dict[str, Any]:
    """OpenAI's legacy shape; an echoed first prompt token has null logprob and null top_logprobs."""
    tokens = [_piece(tokenizer, x.token_id) for x in lps]
    offsets, pos = [], start
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": [x.logprob for x in lps],
            "top_logprobs": [None if x.top is None else {_piece(tokenizer, t): v for t, v in x.top} for x in lps],
            "text_offset": offsets}
