"""The Anthropic Messages front (`POST /v1/messages`, `POST /v1/messages/count_tokens`): a dialect of the one
pipeline (server/serving.py), not a second one.

`MessagesEndpoint` translates a Messages body into what the chat endpoint builds: content blocks into chat
messages (`tool_use` blocks into an assistant's tool calls, `tool_result` blocks into tool turns), tools and
`tool_choice` into server/tools.py's choice and grammar (auto -> auto, any -> required, tool -> a named function,
none -> none), a final assistant message into a prefill the reply continues, sampling fields into SamplingParams.
On the way back the engine's outputs go through the same `<tool_call>` parser as chat completions, into content
blocks (text, tool_use with its parsed input) and `stop_reason`; streamed, into Anthropic's event sequence:
message_start, then per block content_block_start, content_block_delta (text_delta / input_json_delta) and
content_block_stop, then message_delta (stop_reason, usage) and message_stop, each as `event: <type>` with the
event as its data, with `ping` events between. Errors, before or during a stream, are Anthropic's shape
(server/errors.py; an `error` event once the stream has begun).

Usage counts as Anthropic's does: `input_tokens` are the prompt tokens not read from the prefix cache,
`cache_read_input_tokens` those that were (their sum is the prompt, as /v1/messages/count_tokens counts it).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from ..engine.errors import InvalidRequestError
from ..engine.input_processor import InputProcessor
from ..engine.output_processor import RequestOutput
from ..engine.sampling_params import SamplingParams
from . import anthropic_protocol as ap
from .errors import anthropic_error
from .serving import APIError, Built, Collected, Endpoint, chat_prompt
from .tools import ToolCallParser, ToolChoice, resolve_tool_choice, tool_grammar


def tool_use_id(call_id: str) -> str:
    """The parser's `call_<hex>` as Anthropic's `toolu_<hex>` (streamed and whole alike)."""
    return "toolu_" + call_id.removeprefix("call_")


def chat_messages(body: ap.CountTokensRequest) -> tuple[list[dict[str, Any]], bool]:
    """The chat template's messages (OpenAI's roles and fields) and whether the last is a prefill to continue."""
    out: list[dict[str, Any]] = []
    system = body.system_text()
    if system is not None:
        out.append({"role": "system", "content": system})
    for m in body.messages:
        text, calls = "", []
        for block in m.blocks():
            if block.type == "text":
                text += block.text
            elif block.type == "tool_use":
                calls.append({"id": block.id, "type": "function",
                              "function": {"name": block.name, "arguments": json.dumps(block.input)}})
            elif block.type == "tool_result":  # each answers a call in a turn of its own, as chat templates expect
                out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()})
            # thinking blocks: earlier turns' reasoning stays out of the prompt
        if m.role == "assistant":
            out.append({"role": "assistant", "content": text} | ({"tool_calls": calls} if calls else {}))
        elif text or not any(b.type == "tool_result" for b in m.blocks()):
            out.append({"role": "user", "content": text})
    last = body.messages[-1]
    prefill = last.role == "assistant" and not any(b.type == "tool_use" for b in last.blocks())
    return out, prefill


def tool_setup(body: ap.CountTokensRequest) -> tuple[list[dict[str, Any]], ToolChoice, bool]:
    """(OpenAI-style tools, server/tools.py's ToolChoice, parallel calls allowed) for a Messages body."""
    tools = [{"type": "function", "function": {"name": t.name, "parameters": t.input_schema}
              | ({"description": t.description} if t.description is not None else {})} for t in body.tools or []]
    tc = body.tool_choice
    if tc is not None and tc.type in ("any", "tool") and not tools:
        raise InvalidRequestError(f"tool_choice of type {tc.type!r} needs `tools`", "tool_choice")
    if tc is None or (tc.type == "auto" and not tools):
        asked = None  # tools (if any) offered, the model chooses
    else:
        asked = {"auto": "auto", "any": "required", "none": "none"}.get(tc.type) or \
            {"type": "function", "function": {"name": tc.name}}
    parallel = not (tc is not None and tc.type != "none" and tc.disable_parallel_tool_use)
    return tools, resolve_tool_choice(tools, asked), parallel


def prompt_ids(inputs: InputProcessor,
               body: ap.CountTokensRequest) -> tuple[list[int], list[dict[str, Any]], ToolChoice, bool]:
    """The prompt's token ids through the chat template, with the tools, their choice and `parallel`."""
    tools, choice, parallel = tool_setup(body)
    messages, prefill = chat_messages(body)
    return chat_prompt(inputs, messages, tools, choice, continue_final=prefill), tools, choice, parallel


def count_tokens(inputs: InputProcessor, body: ap.CountTokensRequest) -> ap.TokenCount:
    """/v1/messages/count_tokens: the prompt /v1/messages would run, counted (in a worker thread)."""
    return ap.TokenCount(input_tokens=len(prompt_ids(inputs, body)[0]))


def stop_reason(o: Collected, calls: bool) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of a finished output."""
    if o.finish_reason == "length":
        return "max_tokens", None
    if calls:
        return "tool_use", None
    if o.stop_string is not None:
        return "stop_sequence", o.stop_string
    return ("end_turn", None) if o.finish_reason == "stop" else (None, None)


def tool_input(arguments: str) -> Any:
    """A call's arguments as the JSON value they are; a call cut short by max_tokens has none yet."""
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return {}


class MessagesEndpoint(Endpoint):
    param = "messages"
    response_cls = ap.MessagesResponse
    id_prefix = "msg"

    body: ap.MessagesRequest

    def __init__(self, body: ap.MessagesRequest, model_name: str) -> None:
        super().__init__(body, model_name)
        self.id = ap.new_id("msg")

    def count(self) -> int:
        return 1

    def count_param(self) -> str:
        return self.param

    def cache_salt(self) -> str | None:
        return None

    def build(self, inputs: InputProcessor, salt: str | None) -> Built:
        b = self.body
        ids, tools, choice, parallel = prompt_ids(inputs, b)
        spec = tool_grammar(tools, choice, parallel)
        params = SamplingParams(
            max_tokens=self.output_tokens(b.max_tokens, "max_tokens", None),
            temperature=1.0 if b.temperature is None else b.temperature, top_p=1.0 if b.top_p is None else b.top_p,
            top_k=b.top_k or 0, stop=b.stop_sequences or [], cache_salt=salt, structured=spec)
        return Built(self.requests(inputs, [(ids, params)]), len(ids), tools_on=choice.mode != "none")

    def usage(self, built: Built, o: Collected) -> ap.MessagesUsage:
        return ap.MessagesUsage(input_tokens=built.prompt_tokens - o.num_cached_tokens,
                                output_tokens=len(o.tokens), cache_read_input_tokens=o.num_cached_tokens)

    def message(self, built: Built, o: Collected, content: list[Any], reply: Reply | None = None):
        reason, sequence = stop_reason(o, bool(reply and reply.calls)) if reply is not None else (None, None)
        return ap.MessagesResponse(id=self.id, content=content, model=self.model_name, stop_reason=reason,
                                   stop_sequence=sequence, usage=self.usage(built, o))

    def choice(self, built: Built, i: int, o: Collected) -> ap.MessagesResponse:
        # Messages has no choices: a request's one output is the whole message
        return self.response(built, [o])

    def response(self, built: Built, outs: list[Collected]) -> ap.MessagesResponse:
        """The reply as the stream would have built it: the same blocks, by the same code."""
        o, reply = outs[0], Reply(built.tools_on)
        events = reply.start() + reply.feed(o.text, True) + reply.end()
        return self.message(built, o, assemble(events), reply)

    async def stream(self, built: Built, outputs: AsyncIterator[tuple[int, RequestOutput]]):
        o, reply = Collected(), Reply(built.tools_on)

        def opening() -> list[Any]:  # message_start reports the cache hit, known with the first output
            start = self.message(built, o, [])
            start.usage.output_tokens = 0
            return [ap.MessageStart(message=start), *reply.start(), ap.Ping()]

        started = False
        async for _, out in outputs:
            o.add(out)
            events = [] if started else opening()  # first: it opens a plain reply's block
            started = True
            for event in events + reply.feed(out.text, out.finished):
                yield event
        for event in (opening() if not started else []) + reply.end():
            yield event
        reason, sequence = stop_reason(o, reply.calls)
        yield ap.MessageDelta(delta=ap.StopDelta(stop_reason=reason, stop_sequence=sequence),
                              usage=ap.OutputUsage(output_tokens=len(o.tokens)))
        yield ap.MessageStop()

    def usage_chunk(self, built: Built, outs: list[Collected]) -> None:
        return None  # the usage went out in message_delta

    # Anthropic's framing: named events, no [DONE]; an error is an `error` event
    done = None

    def event(self, chunk) -> dict[str, str]:
        return {"event": chunk.type, "data": chunk.model_dump_json()}

    def error_event(self, error: APIError) -> dict[str, str]:
        # a server shutting down asks for a retry (overloaded_error); the engine's death does not
        status = 529 if error.code == "server_shutting_down" else error.status
        _, body, _ = anthropic_error(status, error.message, error.type, error.param, error.code, error.headers)
        return {"event": "error", "data": json.dumps(body)}


class Reply:
    """A reply's content blocks as Anthropic's stream events, from the engine's text as it arrives: plain text is
    one text block; with tools, server/tools.py's parser splits it into text blocks and tool_use blocks (whose input
    streams as the JSON the model writes). Whitespace at the end of a text block is held back until more text
    follows it: before a tool call it is dropped, as the whole-reply parse strips it."""

    def __init__(self, tools_on: bool) -> None:
        self.parser = ToolCallParser() if tools_on else None
        self.index, self.current, self.held = -1, None, ""

    @property
    def calls(self) -> bool:
        return bool(self.parser is not None and self.parser.calls)

    def start(self) -> list[Any]:
        """Plain text: its block opens at once, as Anthropic streams a text reply."""
        return [self._open(ap.OutputText(text=""))] if self.parser is None else []

    def feed(self, text: str, finished: bool) -> list[Any]:
        if self.parser is None:
            return [self._delta(ap.TextDelta(text=text))] if text else []
        events: list[Any] = []
        for d in self.parser.feed(text) + (self.parser.finish() if finished else []):
            if "content" in d:
                events += self._text(d["content"])
            for call in d.get("tool_calls", []):
                if "id" in call:  # a new call: its block opens with its id and name; its input streams as JSON
                    self.held = ""
                    events += self._close()
                    events.append(self._open(ap.OutputToolUse(id=tool_use_id(call["id"]),
                                                              name=call["function"]["name"], input={})))
                if call["function"].get("arguments"):
                    events.append(self._delta(ap.InputJsonDelta(partial_json=call["function"]["arguments"])))
        return events

    def end(self) -> list[Any]:
        """The last block's end; held-back whitespace goes out unless the reply called a tool."""
        events = self._text(self.held, final=True) if self.held and not self.calls else []
        return events + self._close()

    def _text(self, piece: str, final: bool = False) -> list[Any]:
        text = self.held + piece
        send = text if final else text.rstrip()
        self.held = text[len(send):]
        if not send:
            return []
        events = [] if self.current == "text" else [*self._close(), self._open(ap.OutputText(text=""))]
        return events + [self._delta(ap.TextDelta(text=send))]

    def _open(self, block) -> ap.BlockStart:
        self.index, self.current = self.index + 1, block.type
        return ap.BlockStart(index=self.index, content_block=block)

    def _close(self) -> list[ap.BlockStop]:
        if self.current is None:
            return []
        self.current = None
        return [ap.BlockStop(index=self.index)]

    def _delta(self, delta) -> ap.BlockDelta:
        return ap.BlockDelta(index=self.index, delta=delta)


def assemble(events: list[Any]) -> list[Any]:
    """Content blocks from their stream events, as a client's SDK accumulates them."""
    blocks: list[Any] = []
    inputs: dict[int, str] = {}
    for e in events:
        if isinstance(e, ap.BlockStart):
            blocks.append(e.content_block.model_copy())
        elif isinstance(e, ap.BlockDelta) and isinstance(e.delta, ap.TextDelta):
            blocks[e.index].text += e.delta.text
        elif isinstance(e, ap.BlockDelta):
            inputs[e.index] = inputs.get(e.index, "") + e.delta.partial_json
    for i, block in enumerate(blocks):
        if block.type == "tool_use":
            block.input = tool_input(inputs.get(i, ""))
    return blocks
