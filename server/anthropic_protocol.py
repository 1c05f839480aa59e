"""Anthropic Messages shapes (`POST /v1/messages`, `POST /v1/messages/count_tokens`), as pydantic models.

As in server/protocol.py, the request models are the OpenAPI document's truth (strict JSON types, unknown fields
ignored: clients such as Claude Code send `cache_control`, `thinking` and other fields pagedserve has no use for).
Responses and stream events follow Anthropic's documented shapes, so the official SDK parses them."""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from ..engine.sampling_params import MAX_STOP_STRINGS
from .protocol import MODEL, OUTPUT_TOKENS, Int, StopString, _has_surrogate, _Strict

TOOL_NAME = r"^[a-zA-Z0-9_-]{1,128}$"

# Anthropic's error type for each status pagedserve answers with
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
               500: "api_error", 503: "api_error", 529: "overloaded_error"}


# ---- requests ---------------------------------------------------------------------------------------------------
class TextBlock(_Strict):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Strict):
    """A past tool call in an assistant turn."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Strict):
    """The answer to a tool call, in a user turn."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool = False

    def text(self) -> str:
        body = self.content if isinstance(self.content, str | None) else "".join(b.text for b in self.content)
        return f"Error: {body or ''}" if self.is_error else body or ""


class ThinkingBlock(_Strict):
    """An earlier turn's thinking, sent back by clients that keep it: accepted, and left out of the prompt (as
    Anthropic leaves earlier turns' thinking out of the context)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Strict):
    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
                  Field(discriminator="type")]


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[Block]

    def blocks(self) -> list[Any]:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else self.content


class Tool(_Strict):
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None


class _Choice(_Strict):
    disable_parallel_tool_use: bool = False


class AutoChoice(_Choice):
    type: Literal["auto"]


class AnyChoice(_Choice):
    type: Literal["any"]


class NamedChoice(_Choice):
    type: Literal["tool"]
    name: str


class NoChoice(_Strict):
    type: Literal["none"]


ToolChoice = Annotated[AutoChoice | AnyChoice | NamedChoice | NoChoice, Field(discriminator="type")]


class Metadata(_Strict):
    user_id: str | None = None


def _tools_needed(schema: dict[str, Any], model: type) -> None:
    """The rule between fields no type states: a tool_choice of type any or tool needs tools (a 400 otherwise)."""
    schema["allOf"] = [{"if": {"required": ["tool_choice"], "properties": {"tool_choice": {
        "type": "object", "required": ["type"], "properties": {"type": {"enum": ["any", "tool"]}}}}},
        "then": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}}]


class CountTokensRequest(_Strict):
    """What a prompt is made of: the body of /v1/messages/count_tokens, and of /v1/messages with the rest."""

    model_config = ConfigDict(strict=True, extra="ignore", json_schema_extra=_tools_needed)

    model: str | None = Field(default=None, json_schema_extra={MODEL: True})  # Anthropic's SDK always sends it
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None

    @model_validator(mode="before")
    @classmethod
    def _unicode(cls, data: Any) -> Any:
        """Invalid Unicode is a 400 naming its field, as in OpenAI's routes."""
        if isinstance(data, dict):
            for name, value in data.items():
                if _has_surrogate(value):
                    raise PydanticCustomError("invalid_unicode", "{param}: the text contains a lone UTF-16 "
                                              "surrogate, which is not valid Unicode", {"param": name})
        return data

    def system_text(self) -> str | None:
        if self.system is None or isinstance(self.system, str):
            return self.system or None
        return "\n\n".join(b.text for b in self.system) or None


class MessagesRequest(CountTokensRequest):
    max_tokens: Int(ge=1, json_schema_extra={OUTPUT_TOKENS: True})
    stop_sequences: Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: Int(ge=0) | None = None
    metadata: Metadata | None = None
    stream: bool = False


# ---- responses --------------------------------------------------------------------------------------------------
class OutputText(BaseModel):
    type: Literal["text"] = "text"
    text: str


class OutputToolUse(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: Any


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessagesUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0  # prompt tokens found in the prefix cache (a part of input_tokens)
    cache_creation_input_tokens: int = 0


class MessagesResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText | OutputToolUse]
    model: str
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: MessagesUsage


class TokenCount(BaseModel):
    input_tokens: int


# The stream's events, each sent as `event: <type>` with the event as its data
class MessageStart(BaseModel):
    type: Literal["message_start"] = "message_start"
    message: MessagesResponse


class BlockStart(BaseModel):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: OutputText | OutputToolUse


class Ping(BaseModel):
    type: Literal["ping"] = "ping"


class TextDelta(BaseModel):
    type: Literal["text_delta"] = "text_delta"
    text: str


class InputJsonDelta(BaseModel):
    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class BlockDelta(BaseModel):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: TextDelta | InputJsonDelta


class BlockStop(BaseModel):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class StopDelta(BaseModel):
    stop_reason: StopReason | None
    stop_sequence: str | None


class OutputUsage(BaseModel):
    output_tokens: int


class MessageDelta(BaseModel):
    type: Literal["message_delta"] = "message_delta"
    delta: StopDelta
    usage: OutputUsage


class MessageStop(BaseModel):
    type: Literal["message_stop"] = "message_stop"


class ErrorObject(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    """Every error of the Messages routes, whatever its status: Anthropic's shape."""

    type: Literal["error"] = "error"
    error: ErrorObject


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def new_id(prefix: str) -> str:
    """Anthropic's ids: `msg_...`, `toolu_...`."""
    return f"{prefix}_{uuid.uuid4().hex[:24]}"
