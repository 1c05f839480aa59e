"""The request pipeline every generation route shares: admit -> build -> submit -> collect or stream -> usage.

`Serving.generate` runs it for an `Endpoint`: `ChatEndpoint` (/v1/chat/completions), `CompletionEndpoint`
(/v1/completions), or another dialect's front (server/anthropic.py's `MessagesEndpoint`, /v1/messages), over an
`EngineClient` (engine/client.py: the single engine or the Ray fleet). An endpoint says only what differs: how a
body becomes `EngineRequest`s (`build`, which translates its dialect into prompt ids and sampling params and has the
input processor check each and compile its grammar; run off the event loop, since templating, tokenizing and
compiling cost O(prompt) and more), how outputs become its response or its stream events, and how those events and
errors are framed on the wire. Admission (the 429) is decided before anything is tokenized or streamed; its
`Reservation` is either handed to the engine, a place per request, or given back, and a client that leaves aborts
its requests.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

from fastapi import Request

from ..engine.async_engine import EngineDeadError, OverloadedError
from ..engine.client import EngineClient, OutputStream, Reservation
from ..engine.errors import InvalidRequestError
from ..engine.input_processor import EngineRequest, InputProcessor
from ..engine.output_processor import RequestMetrics, RequestOutput
from ..engine.sampler import TokenLogprob
from ..engine.sampling_params import SamplingParams
from .guards import TENANT_KEY
from .protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionTokensDetails,
    PromptTokensDetails,
    TokenLogprobEntry,
    TopLogprob,
    Usage,
    error_body,
    new_id,
    now,
)
from .structured import logit_bias, structured_spec
from .tools import (
    ToolCallParser,
    ToolChoice,
    parse_tool_calls,
    render_messages,
    resolve_tool_choice,
    tool_grammar,
)
from .tracing import RequestRecord, request_record

logger = logging.getLogger(__name__)
ENGINE_DEAD = "the engine loop died (see the server log)"  # no exception text reaches a client


class APIError(Exception):
    """An error response, stated in OpenAI's terms (`body` is its shape); server/errors.py renders it in the shape
    of the route's dialect."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None, reason: str | None = None) -> None:
        super().__init__(message)
        self.status, self.headers = status, headers
        self.message, self.type, self.param, self.code = message, type_, param, code
        self.body = error_body(message, type_, param, code)
        # what the rejection counter calls it (None: not counted)
        self.reason = reason or {400: "invalid_request", 404: "model_not_found", 429: "queue_full"}.get(status)


def tenant(raw: Request) -> str | None:
    """The id of the API key that authenticated the request (server/guards.py); None without keys."""
    return raw.scope.get("state", {}).get(TENANT_KEY)


def overloaded(e: OverloadedError) -> APIError:
    seconds = max(1, min(60, math.ceil(e.retry_after)))
    return APIError(429, f"{e} Retry after {seconds} s.", "rate_limit_error", code="server_overloaded",
                    headers={"Retry-After": str(seconds), "retry-after-ms": str(int(seconds * 1000))},
                    reason=e.reason)


def invalid(e: InvalidRequestError, prompt_param: str) -> APIError:
    """A refused request's 400; a prompt too long for the context is blamed on the route's prompt field."""
    return APIError(400, e.message, param=prompt_param if e.code == "context_length_exceeded" else e.param,
                    code=e.code)


def engine_dead(e: EngineDeadError) -> APIError:
    return APIError(503, e.public_message or ENGINE_DEAD, "service_unavailable", code=e.code)


@dataclass
class Built:
    """A body turned into engine requests: one per choice, prompts x n, each built and checked once."""

    requests: list[EngineRequest]
    prompt_tokens: int
    prompt_groups: int = 1  # distinct prompts (n choices each)
    echo: list[str] = field(default_factory=list)  # completions: the echoed prompt text per choice
    tools_on: bool = False  # chat: parse <tool_call> output


@dataclass
class Collected:
    """One choice's whole output, for a non-streamed response."""

    text: str = ""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    drafts: tuple[int, int] = (0, 0)  # speculative decoding: (drafted, accepted)
    stop_string: str | None = None  # the stop string that ended it, if one did
    metrics: RequestMetrics | None = None  # the engine's stamps, as of the last output
    first_ns: int | None = None  # when the first and last outputs arrived here (time.time_ns(): a trace's anchor)
    last_ns: int | None = None

    def add(self, out: RequestOutput) -> None:
        self.last_ns = time.time_ns()
        self.first_ns = self.first_ns or self.last_ns
        self.metrics = out.metrics
        self.text += out.text
        self.tokens += out.new_token_ids
        self.logprobs += out.logprobs
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.num_cached_tokens = out.num_cached_tokens
        self.drafts = (out.num_draft_tokens, out.num_accepted_tokens)
        if out.finished:
            self.finish_reason, self.stop_string = out.finish_reason, out.stop_string


def usage(built: Built, outs: list[Collected]) -> Usage:
    completion = sum(len(o.tokens) for o in outs)
    drafted, accepted = sum(o.drafts[0] for o in outs), sum(o.drafts[1] for o in outs)
    per_prompt = len(outs) // max(built.prompt_groups, 1)  # the first choice of each prompt: what its prompt hit
    return Usage(
        prompt_tokens=built.prompt_tokens, completion_tokens=completion, total_tokens=built.prompt_tokens + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(o.num_cached_tokens for o in outs[::per_prompt])),
        completion_tokens_details=CompletionTokensDetails(
            accepted_prediction_tokens=accepted, rejected_prediction_tokens=drafted - accepted) if drafted else None)


class Endpoint(ABC):
    """What one route does differently; the pipeline in `Serving.generate` does the rest."""

    param: str  # the body field a prompt that is too long is blamed on
    response_cls: type  # the model of its response
    chunk_cls: type  # the model of its streamed chunks
    id_prefix: str  # of the response's id
    max_output_tokens: int | None = None  # the server's cap on a request's max_tokens (--max-output-tokens)
    max_prompt_tokens: int | None = None  # the most prompt tokens allowed to wait (--max-queued-tokens)

    def __init__(self, body, model_name: str) -> None:
        self.body, self.model_name = body, model_name
        self.tokenizer = None  # the engine's, once admitted
        self.id, self.created = new_id(self.id_prefix), now()
        self.request_id = new_id("req")  # the base of its engine requests' ids: the X-Request-Id where one came

    def count(self) -> int:
        """Engine requests this body becomes (prompts x n)."""
        return self.body.n

    def count_param(self) -> str:
        """The field blamed when the body alone is more requests than may wait."""
        return "n" if self.body.n > 1 else self.param

    def cache_salt(self) -> str | None:
        """The body's own prefix-cache namespace, if its dialect has one."""
        return self.body.cache_salt

    @abstractmethod
    def build(self, inputs: InputProcessor, salt: str | None) -> Built:
        """The engine requests, one per choice (in a worker thread). Raises InvalidRequestError."""

    def requests(self, inputs: InputProcessor, jobs: list[tuple[list[int], SamplingParams]]) -> list[EngineRequest]:
        """Job i (prompt ids, params) as engine request `<request_id>-<i>`: checked, its grammar compiled."""
        return [inputs.process(f"{self.request_id}-{i}", ids, params, max_prompt_tokens=self.max_prompt_tokens)
                for i, (ids, params) in enumerate(jobs)]

    @abstractmethod
    def choice(self, built: Built, i: int, out: Collected):
        """Choice `i` of the non-streamed response."""

    def response(self, built: Built, outs: list[Collected]):
        """The non-streamed response."""
        return self.envelope(self.response_cls, [self.choice(built, i, o) for i, o in enumerate(outs)],
                             usage(built, outs))

    @abstractmethod
    def stream(self, built: Built, outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[Any]:
        """The streamed chunks (pydantic models), usage excepted."""

    def usage_chunk(self, built: Built, outs: list[Collected]) -> Any | None:
        """The chunk after the others: OpenAI's usage chunk (`choices: []`), when stream_options asks for it."""
        if self.body.stream_options and self.body.stream_options.include_usage:
            return self.envelope(self.chunk_cls, [], usage(built, outs))
        return None

    # How the stream is framed on the wire: OpenAI's `data: <json>` events, then `data: [DONE]`
    done: str | None = "[DONE]"  # the last event's data (None: none)

    def event(self, chunk) -> Any:
        """One chunk as an SSE event (what sse-starlette sends: a string is the `data:` line)."""
        return chunk.model_dump_json()

    def error_event(self, error: APIError) -> Any:
        """An error after the stream began (its status line has gone): an event in the stream."""
        return json.dumps(error.body)

    def envelope(self, cls: type, choices: list, usage: Usage | None = None):
        """A response or chunk of model `cls`: the choices, with the id, created time and model every one carries."""
        return cls(id=self.id, created=self.created, model=self.model_name, choices=choices, usage=usage)

    def params(self, max_tokens: int | None, logprobs: int | None, index: int, salt: str | None, spec=None,
               prompt_logprobs: int | None = None) -> SamplingParams:
        b = self.body
        seed = None if b.seed is None else b.seed + index  # n choices differ but stay reproducible
        if seed is not None and seed >= 2**64:  # wrapped to stay a valid 64-bit seed (negative seeds are valid)
            seed -= 2**64
        return SamplingParams(
            max_tokens=max_tokens, temperature=1.0 if b.temperature is None else b.temperature,
            top_p=1.0 if b.top_p is None else b.top_p, top_k=b.top_k or 0, seed=seed, stop=b.stop or [],
            stop_token_ids=b.stop_token_ids or [], ignore_eos=b.ignore_eos, presence_penalty=b.presence_penalty,
            frequency_penalty=b.frequency_penalty, logprobs=logprobs, cache_salt=salt,
            prompt_logprobs=prompt_logprobs, structured=spec, logit_bias=logit_bias(b),
            allowed_token_ids=b.allowed_token_ids, priority=b.priority)

    def text(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids) if self.tokenizer is not None else " ".join(map(str, token_ids))

    def output_tokens(self, asked: int | None, param: str, default: int | None) -> int | None:
        """max_tokens as asked, within --max-output-tokens (more is a 400); unasked, `default` (None: the context's
        room) within it."""
        cap = self.max_output_tokens
        if cap is not None and asked is not None and asked > cap:
            raise InvalidRequestError(f"{param} is {asked}, more than the {cap} tokens this server generates per "
                                      "request (--max-output-tokens)", param)
        if asked is not None or cap is None:
            return default if asked is None else asked
        return cap if default is None else min(cap, default)


@dataclass
class Serving:
    """The pipeline, over the EngineClient that `client()` returns when ready (raising APIError otherwise)."""

    client: Callable[[], EngineClient]
    model_name: str
    prefix_cache_per_key: bool
    disconnect_poll_s: float
    max_output_tokens: int | None = None

    async def generate(self, endpoint_cls: type[Endpoint], body, raw: Request):
        """The response model, or an async iterator of chunks (JSON strings, then "[DONE]") to stream. The engine's
        refusals become API errors here; once a stream has begun, `stream` reports them as events."""
        endpoint = endpoint_cls(body, self.model_name)
        endpoint.max_output_tokens = self.max_output_tokens
        record = request_record(raw)  # the X-Request-Id names it; its log line and span report what it did
        record.response_id = endpoint.id
        endpoint.request_id = record.request_id or endpoint.request_id
        try:
            client = self.admit(body, endpoint.count(), endpoint.count_param())
            with client.reserve(endpoint.count()) as places:  # before any tokenizing; what is not submitted goes back
                endpoint.tokenizer = client.input_processor.tokenizer
                endpoint.max_prompt_tokens = client.limits.max_queued_tokens
                built = await self.build(client, endpoint, self.cache_salt(endpoint, raw))
                streams = self.submit(client, built, places, tenant(raw))
            await self.wait_started(client, streams, raw)
            if body.stream:
                return self.stream(endpoint, built, streams, record)
            outs = await self.collect(streams, raw)
            record.finish(usage(built, outs), outs, streams)
            return endpoint.response(built, outs)
        except OverloadedError as e:
            raise overloaded(e) from e
        except EngineDeadError as e:
            raise engine_dead(e) from e
        except InvalidRequestError as e:
            raise invalid(e, endpoint.param) from e

    async def read_prompt(self, body, read: Callable[[InputProcessor], Any], param: str) -> Any:
        """A route that only reads a prompt (Messages' count_tokens): the model check, then `read(input processor)`
        off the event loop, as a build runs; no admission, as nothing runs on the engine."""
        client = self.admit(body, 1, param)
        try:
            return await asyncio.to_thread(read, client.input_processor)
        except InvalidRequestError as e:
            raise invalid(e, param) from e
        except ValueError as e:
            raise APIError(400, str(e), param=param) from e

    # ---- admit ------------------------------------------------------------------------------------------
    def admit(self, body, count: int, param: str) -> EngineClient:
        """The model check, and whether the request could ever wait (`param`: the field blamed when it alone is
        more than may wait, n or the route's prompt field); the queue's own answer is `reserve`'s."""
        client = self.client()
        if body.model is not None and body.model != self.model_name:
            raise APIError(404, f"The model `{body.model}` does not exist.", "invalid_request_error", "model",
                           "model_not_found")
        limit = client.limits.max_waiting_requests
        if limit is not None and count > limit:  # could never be admitted: not a 429 to retry for ever
            raise APIError(400, f"this request needs {count} sequences (prompts x n) but at most {limit} may "
                           "wait at once (--max-waiting-requests)", param=param)
        return client

    def cache_salt(self, endpoint: Endpoint, raw: Request) -> str | None:
        """The request's prefix-cache namespace: its API key's (when namespacing per key) and its own cache_salt."""
        key, own = tenant(raw) if self.prefix_cache_per_key else None, endpoint.cache_salt()
        return own if key is None else f"key:{key}\x00{own or ''}"

    # ---- build ------------------------------------------------------------------------------------------
    async def build(self, client: EngineClient, endpoint: Endpoint, salt: str | None) -> Built:
        """`endpoint.build` off the event loop: templating, tokenizing, every check and the grammar's compile."""
        try:
            return await asyncio.to_thread(endpoint.build, client.input_processor, salt)
        except ValueError as e:
            if isinstance(e, InvalidRequestError):
                raise
            raise APIError(400, str(e), param=endpoint.param) from e

    # ---- submit -----------------------------------------------------------------------------------------
    def submit(self, client: EngineClient, built: Built, places: Reservation,
               tenant: str | None = None) -> list[OutputStream]:
        """Every built request, each with a place of `places`, or none: a refusal halfway closes (aborts) those
        submitted. `tenant`: the API key's id, if any."""
        streams: list[OutputStream] = []
        try:
            for request in built.requests:
                streams.append(client.submit(request, places, tenant))
        except BaseException:
            for s in streams:
                s.close()
            raise
        return streams

    async def wait_started(self, client: EngineClient, streams: list[OutputStream], raw: Request) -> None:
        """Until every request has its first output, watching for a client that leaves. A stream's status line is
        sent only after this, so a refusal is still possible: when none of the requests has been scheduled within
        max_queue_wait_s they are aborted and the client gets 429 + Retry-After, never silence. Once the scheduler
        has given one of them tokens, started work is never thrown away: a long prefill (or a preemption) is waited
        for, however long."""
        bound = client.limits.max_queue_wait_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + bound if bound else math.inf
        waiters = [asyncio.ensure_future(s.wait_started()) for s in streams]
        try:
            while pending := [w for w in waiters if not w.done()]:
                queued = not any(s.scheduled for s in streams)
                if queued and loop.time() >= deadline:
                    raise OverloadedError(f"server overloaded: not scheduled within {bound:g} s (--max-queue-wait-s)",
                                          client.retry_after(), "queue_wait")
                poll = self.disconnect_poll_s
                await asyncio.wait(pending, timeout=max(0, min(poll, deadline - loop.time())) if queued else poll,
                                   return_when=asyncio.FIRST_COMPLETED)
                if await raw.is_disconnected():
                    raise APIError(499, "client disconnected", "client_closed_request")
            # a request that ended before it started (refused by every replica, or its replica died twice) raises
            await asyncio.gather(*waiters)
        except BaseException:
            for s in streams:
                s.close()
            raise
        finally:
            for w in waiters:
                w.cancel()

    # ---- collect or stream ------------------------------------------------------------------------------
    async def collect(self, streams: list[OutputStream], raw: Request) -> list[Collected]:
        """Run to completion, watching for a client that hangs up (then abort and free everything)."""
        outs = [Collected() for _ in streams]

        async def consume() -> None:
            async for i, out in merge(streams):
                outs[i].add(out)

        task = asyncio.create_task(consume())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=self.disconnect_poll_s)
                if not task.done() and await raw.is_disconnected():
                    raise APIError(499, "client disconnected", "client_closed_request")
            task.result()
        finally:
            task.cancel()  # a no-op once done; closing the streams aborts the requests (metrics count "abort")
            for s in streams:
                s.close()
        return outs

    async def stream(self, endpoint: Endpoint, built: Built, streams: list[OutputStream],
                     record: RequestRecord | None = None) -> AsyncIterator[Any]:
        """SSE events, as the endpoint frames them: its chunks, the usage chunk if asked, "[DONE]" (OpenAI's). An
        error after the stream started is an error event, then [DONE] (the status line has gone already)."""
        outs = [Collected() for _ in streams]

        async def tracked() -> AsyncIterator[tuple[int, RequestOutput]]:
            async for i, out in merge(streams):
                outs[i].add(out)
                yield i, out

        try:
            async for chunk in endpoint.stream(built, tracked()):
                yield endpoint.event(chunk)
            if (last := endpoint.usage_chunk(built, outs)) is not None:
                yield endpoint.event(last)
        except EngineDeadError as e:
            yield endpoint.error_event(engine_dead(e))
        except InvalidRequestError as e:
            yield endpoint.error_event(APIError(400, e.message, "invalid_request_error", e.param,
                                                e.code or "invalid_request"))
        except Exception:  # noqa: BLE001 - details go to the log only
            logger.exception("error while streaming")
            yield endpoint.error_event(APIError(500, "internal server error", "internal_server_error",
                                                code="internal_error"))
        finally:
            for s in streams:
                s.close()
            if record is not None:  # also what a client that left had received
                record.finish(usage(built, outs), outs, streams)
        if endpoint.done is not None:
            yield endpoint.done


async def merge(streams: list[OutputStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several engine requests (n > 1, prompt lists) in arrival order, tagged with the choice index.
    The caller closes the streams."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: OutputStream) -> None:
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


# ---- /v1/chat/completions -----------------------------------------------------------------------------------
def chat_prompt(inputs: InputProcessor, messages: list[dict[str, Any]], tools: list[dict], choice: ToolChoice,
                continue_final: bool = False) -> list[int]:
    """Prompt ids of OpenAI-style chat messages (role, content, tool_calls, tool_call_id) and tools, through the
    model's chat template: what every chat dialect's endpoint translates its messages into. `continue_final`: the
    last message is an assistant reply to continue."""
    inputs.check_prompt_chars(sum(len(m["content"]) for m in messages), "messages")
    messages, template_tools = render_messages(messages, tools, choice, inputs.tokenizer)
    return inputs.encode_chat(messages, tools=template_tools, continue_final=continue_final)


class ChatEndpoint(Endpoint):
    param = "messages"
    response_cls, chunk_cls = ChatCompletionResponse, ChatCompletionChunk
    id_prefix = "chatcmpl"

    def build(self, inputs: InputProcessor, salt: str | None) -> Built:
        b = self.body
        tools = [t.model_dump(exclude_none=True) for t in b.tools or []]
        choice = resolve_tool_choice(tools, b.tool_choice if isinstance(b.tool_choice, str | None) else
                                     b.tool_choice.model_dump())
        messages = [m.model_dump(exclude_none=True, include={"role", "name", "tool_calls", "tool_call_id"})
                    | {"content": m.text()} for m in b.messages]
        ids = chat_prompt(inputs, messages, tools, choice)
        spec = tool_grammar(tools, choice, b.parallel_tool_calls) or structured_spec(b)
        lp = (b.top_logprobs or 0) if b.logprobs else None
        room = inputs.max_model_len - len(ids)  # unasked, a cap stops at the context's end
        self.output_tokens(b.max_tokens, "max_tokens", None)  # both within the cap, though one is used
        max_tokens = self.output_tokens(b.max_completion_tokens or b.max_tokens, "max_completion_tokens" if
                                        b.max_completion_tokens else "max_tokens", room if room > 0 else None)
        jobs = [(ids, self.params(max_tokens, lp, i, salt, spec)) for i in range(b.n)]
        return Built(self.requests(inputs, jobs), len(ids), tools_on=choice.mode != "none")

    def logprobs(self, lps: list[TokenLogprob]) -> list[TokenLogprobEntry]:
        def top(tok: int, lp: float) -> TopLogprob:
            s = self.text([tok])
            return TopLogprob(token=s, logprob=lp, bytes=list(s.encode("utf-8")))

        return [TokenLogprobEntry(**top(x.token_id, x.logprob).model_dump(),
                                  top_logprobs=[top(t, v) for t, v in x.top]) for x in lps]

    def choice(self, built: Built, i: int, o: Collected) -> ChatChoice:
        content, calls = parse_tool_calls(o.text) if built.tools_on else (o.text, [])
        message = AssistantMessage(content=content if calls else o.text, tool_calls=calls or None)
        return ChatChoice(index=i, message=message,
                          logprobs=ChatLogprobs(content=self.logprobs(o.logprobs)) if self.body.logprobs else None,
                          finish_reason="tool_calls" if calls and o.finish_reason == "stop" else o.finish_reason)

    def chunk(self, i: int, delta: ChatDelta, finish: str | None = None, logprobs=None) -> ChatCompletionChunk:
        return self.envelope(ChatCompletionChunk, [ChatChunkChoice(index=i, delta=delta, logprobs=logprobs,
                                                                   finish_reason=finish)])

    async def stream(self, built: Built, outputs):
        for i in range(len(built.requests)):
            yield self.chunk(i, ChatDelta(role="assistant", content=""))
        parsers = [ToolCallParser() for _ in built.requests] if built.tools_on else None
        async for i, out in outputs:
            lp = ChatLogprobs(content=self.logprobs(out.logprobs)) if self.body.logprobs and out.logprobs else None
            if parsers is not None:  # text goes through the tool-call parser: content and tool_calls deltas
                deltas = parsers[i].feed(out.text) + (parsers[i].finish() if out.finished else [])
                for d in deltas[:-1]:
                    yield self.chunk(i, ChatDelta(**d))
                if deltas or lp:
                    yield self.chunk(i, ChatDelta(**deltas[-1]) if deltas else ChatDelta(), None, lp)
                if out.finished:
                    reason = out.finish_reason
                    yield self.chunk(i, ChatDelta(), "tool_calls" if parsers[i].calls and reason == "stop" else reason)
            elif out.text or lp or out.finished:
                yield self.chunk(i, ChatDelta(content=out.text) if out.text else ChatDelta(),
                                 out.finish_reason if out.finished else None, lp)


# ---- /v1/completions ----------------------------------------------------------------------------------------
class CompletionEndpoint(Endpoint):
    param = "prompt"
    response_cls = chunk_cls = CompletionResponse
    id_prefix = "cmpl"

    body: CompletionRequest

    def count(self) -> int:
        return len(self.body.prompts()) * self.body.n

    def build(self, inputs: InputProcessor, salt: str | None) -> Built:
        b, prompts = self.body, self.body.prompts()
        spec = structured_spec(b)
        # echo + logprobs scores the prompt too (lm-evaluation-harness's loglikelihood), as vLLM does
        score_prompt = b.logprobs if b.echo and b.logprobs is not None else None
        for p in prompts:  # refuse what cannot fit before tokenizing anything
            if isinstance(p, str):
                inputs.check_prompt_chars(len(p), "prompt")
        jobs, total = [], 0
        max_tokens = self.output_tokens(b.max_tokens, "max_tokens", 16)
        for p in prompts:
            ids = inputs.tokenize(p) if isinstance(p, str) else p
            total += len(ids)
            jobs += [(ids, self.params(max_tokens, b.logprobs, i, salt, spec, prompt_logprobs=score_prompt))
                     for i in range(b.n)]
        requests = self.requests(inputs, jobs)  # token ids in range before they are decoded for the echo
        echo = [(p if isinstance(p, str) else self.text(p)) if b.echo else "" for p in prompts for _ in range(b.n)]
        return Built(requests, total, prompt_groups=len(prompts), echo=echo)

    def logprobs(self, lps: list[TokenLogprob], start: int = 0) -> CompletionLogprobs:
        tokens = [self.text([x.token_id]) for x in lps]
        offsets = list(accumulate(map(len, tokens), initial=start))[:-1]  # where each token starts
        return CompletionLogprobs(
            tokens=tokens, token_logprobs=[x.logprob for x in lps], text_offset=offsets,
            top_logprobs=[None if x.top is None else {self.text([t]): v for t, v in x.top} for x in lps])

    @staticmethod
    def with_prompt(prompt_ids: list[int], prompt_lps, lps: list[TokenLogprob]) -> list:
        """Echoed prompt entries (None for the first token, which has no logprob), then the generated ones."""
        if prompt_lps is None:
            return lps
        return [x if x is not None else TokenLogprob(t, None, None) for t, x in zip(prompt_ids, prompt_lps)] + lps

    def choice(self, built: Built, i: int, o: Collected) -> CompletionChoice:
        lps = None
        if self.body.logprobs is not None:
            start = 0 if o.prompt_logprobs is not None else len(built.echo[i])
            prompt_ids = built.requests[i].prompt_token_ids
            lps = self.logprobs(self.with_prompt(prompt_ids, o.prompt_logprobs, o.logprobs), start)
        return CompletionChoice(index=i, text=built.echo[i] + o.text, logprobs=lps, finish_reason=o.finish_reason)

    def chunk(self, i: int, text: str, finish: str | None = None, logprobs=None) -> CompletionResponse:
        return self.envelope(CompletionResponse, [CompletionChoice(index=i, text=text, logprobs=logprobs,
                                                                   finish_reason=finish)])

    async def stream(self, built: Built, outputs):
        for i, text in enumerate(built.echo):
            if text:
                yield self.chunk(i, text)
        offsets = [len(text) for text in built.echo]  # text_offset counts the echoed prompt and earlier chunks
        async for i, out in outputs:
            lp = None
            if self.body.logprobs is not None:
                if out.prompt_logprobs is not None:  # the echoed prompt's own entries come first, from offset 0
                    offsets[i] = 0
                lps = self.with_prompt(built.requests[i].prompt_token_ids, out.prompt_logprobs, out.logprobs)
                if lps:
                    lp = self.logprobs(lps, offsets[i])
                    offsets[i] = lp.text_offset[-1] + len(lp.tokens[-1])
            if out.text or lp or out.finished:
                yield self.chunk(i, out.text, out.finish_reason if out.finished else None, lp)
