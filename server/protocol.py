"""OpenAI request and response shapes (the subset pagedserve serves), as pydantic models."""

from __future__ import annotations

import re
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from pagedserve.engine.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS

TokenId = Annotated[int, Field(ge=0)]  # and below the vocabulary's size, which the engine checks (400)
Text = Annotated[str, Field(min_length=1)]

# OpenAI request fields that change what a response means but that pagedserve does not implement. Each is
# refused with a 400 naming it, unless its value is inert (the predicate on the value and the whole body).
# Implementing one of them = declaring it as a field below and deleting its entry here.
UNSUPPORTED_FIELDS: dict[str, Any] = {
    "functions": lambda v, body: not v,
    "function_call": lambda v, body: v in (None, "none"),
    "suffix": lambda v, body: not v,
    "best_of": lambda v, body: v is None or v == body.get("n", 1),
    "audio": lambda v, body: v is None,
    "modalities": lambda v, body: v is None or v == ["text"],
    "prediction": lambda v, body: v is None,
    "web_search_options": lambda v, body: v is None,
}


SURROGATE = re.compile("[\ud800-\udfff]")  # a lone UTF-16 surrogate: a string that is not valid Unicode


def _has_surrogate(value: Any) -> bool:
    """Whether a JSON value holds a string that is not valid Unicode. Iterative: a deeply nested body must not
    exhaust the interpreter's stack."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str) and SURROGATE.search(v):
            return True
        if isinstance(v, dict):
            stack += [*v.keys(), *v.values()]
        elif isinstance(v, list):
            stack += v
    return False


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")  # like vLLM: unknown fields are ignored, not an error

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)  # 0: completions with echo + logprobs only
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # extension
    n: int = Field(default=1, ge=1, le=16)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None  # extension
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    ignore_eos: bool = False  # extension, for benchmarks
    user: str | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)  # as vLLM: a private prefix cache
    # structured output (server/structured.py): OpenAI's response_format, vLLM's guided_* extensions
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[TokenId] | None = Field(default=None, min_length=1)  # extension (vLLM)
    priority: int = 0  # extension (vLLM): lower runs first under --scheduling-policy priority; else only 0

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, data: Any) -> Any:
        """Unsupported fields and invalid Unicode, each a 400 naming its field (`param` in the error)."""
        if not isinstance(data, dict):
            return data
        for name, inert in UNSUPPORTED_FIELDS.items():
            if name in data and not inert(data[name], data):
                raise PydanticCustomError("unsupported_field", "{param}: this field is not supported by pagedserve",
                                          {"param": name})
        for name, value in data.items():
            if _has_surrogate(value):
                raise PydanticCustomError("invalid_unicode", "{param}: the text contains a lone UTF-16 surrogate, "
                                          "which is not valid Unicode", {"param": name})
        return data

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        v = [v] if isinstance(v, str) else v
        if len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences are allowed, got {len(v)}")
        if any(not s for s in v):
            raise ValueError("stop sequences must be non-empty")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in v):
            raise ValueError(f"stop sequences may be at most {MAX_STOP_STRING_CHARS} characters long")
        return v


class FunctionDefinition(BaseModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class CalledFunction(BaseModel):
    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends JSON text


class CalledTool(BaseModel):
    """A past tool call in an assistant message."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[CalledTool] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # role "tool": which call this answers

    def text(self) -> str:
        """Plain text content; multi-part messages keep their text parts."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        if any(part.get("type") != "text" or not isinstance(part.get("text"), str) for part in self.content):
            raise ValueError("only text content parts are supported")
        return "".join(part["text"] for part in self.content)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[ChatTool] | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and not info.data.get("logprobs"):  # as OpenAI and vLLM
            raise ValueError("top_logprobs needs logprobs: true")
        return v
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True


class CompletionRequest(_Request):
    prompt: Text | Annotated[list[TokenId], Field(min_length=1)] | Annotated[list[Text], Field(min_length=1)] | \
        Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or isinstance(p[0], int):
            return [p]
        return list(p)


# ---- responses ------------------------------------------------------------------------------------------------
# A field defaulting to OMIT is left out of the JSON when None, as OpenAI leaves it out; every other field is always
# present (`finish_reason: null` in a chunk, `logprobs: null`).
OMIT = Field(None, exclude_if=lambda v: v is None)


class CompletionTokensDetails(BaseModel):
    accepted_prediction_tokens: int
    rejected_prediction_tokens: int


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = OMIT
    completion_tokens_details: CompletionTokensDetails | None = OMIT  # speculative decoding's drafts, if any


class ToolCallFunction(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = OMIT


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobEntry]


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class _Envelope(BaseModel):
    """What every response and chunk carries; a subclass narrows `object` and `choices` (they keep their place)."""

    id: str
    object: str
    created: int
    model: str
    choices: list[Any]
    usage: Usage | None = OMIT


class ChatCompletionResponse(_Envelope):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    """A streamed piece: the first has the role, content pieces follow, tool calls stream as they are written."""

    role: Literal["assistant"] | None = OMIT
    content: str | None = OMIT
    tool_calls: list[dict[str, Any]] | None = OMIT


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Envelope):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy shape; an echoed first prompt token has null logprob and null top_logprobs."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class CompletionResponse(_Envelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pagedserve"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error, whatever its status: OpenAI's shape."""

    error: ErrorDetail


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
