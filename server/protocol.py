"""OpenAI request and response shapes (the subset pagedserve serves), as pydantic models.

The request models are the OpenAPI document's truth: what they accept is what the document states, JSON types
included (`"n": "2"` and `"stream": 1` are refused, as OpenAI refuses them; `2.0` is an integer, as JSON Schema
says). Rules between fields are stated with JSON Schema's `if`/`then` and `not` (`RULES` below); the few that no
schema can state (a grammar that must compile, a named tool that must be among `tools`, a prompt that must fit the
context) are listed in the 400's description of the document (server/app.py)."""

from __future__ import annotations

import re
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from ..engine.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS


def _integral(value: Any) -> Any:
    """JSON Schema's integer: 2.0 is one (a number with no fraction), `true` and `"2"` are not."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def Int(**constraints: Any) -> Any:  # noqa: N802 - a type
    """An integer field (pydantic Field arguments: ge, le, ...), as JSON Schema's `integer` reads JSON."""
    return Annotated[int, Field(**constraints), BeforeValidator(_integral)]


# The document adds `maximum: vocabulary size - 1` where this marker is, once the model is loaded (the engine refuses
# ids outside the vocabulary with a 400); a logit_bias key the same as a pattern.
TOKEN_ID, TOKEN_KEY = "x-pagedserve-token-id", "x-pagedserve-token-key"
OUTPUT_TOKENS = "x-pagedserve-output-tokens"  # `maximum`: the server's --max-output-tokens, when it has one
MODEL = "x-pagedserve-model"  # `enum`: the served model's name (any other is a 404 model_not_found)
PRIORITY = "x-pagedserve-priority"  # `enum: [0]` unless the server schedules by priority
TokenId = Int(ge=0, json_schema_extra={TOKEN_ID: True})
Text = Annotated[str, Field(min_length=1)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
TOKEN_KEY_PATTERN = r"^(?:0|[1-9][0-9]*)$"  # a token id as a JSON object key: decimal, no sign, no leading zero
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]  # as OpenAI
LogitBias = Annotated[dict[Annotated[str, Field(pattern=TOKEN_KEY_PATTERN)], Bias], WithJsonSchema({
    "type": "object", "propertyNames": {"pattern": TOKEN_KEY_PATTERN, TOKEN_KEY: True},
    "additionalProperties": {"type": "number", "minimum": -100.0, "maximum": 100.0}})]
# The output constraints a request may give one of (server/structured.py); response_format counts unless "text"
CONSTRAINTS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")

# OpenAI request fields that change what a response means but that pagedserve does not implement. Each is
# refused with a 400 naming it, unless its value is inert (the predicate on the value and the whole body; the
# document states the inert values). Implementing one = declaring it as a field below and deleting its entry here.
FALSY = [None, False, 0, "", [], {}]  # Python's `not value` for a JSON value
UNSUPPORTED_FIELDS: dict[str, Any] = {
    "functions": lambda v, body: not v,
    "function_call": lambda v, body: v in (None, "none"),
    "suffix": lambda v, body: not v,
    "best_of": lambda v, body: v is None or (type(v) in (int, float) and v == 1),  # 1: no search, as served
    "audio": lambda v, body: v is None,
    "modalities": lambda v, body: v is None or v == ["text"],
    "prediction": lambda v, body: v is None,
    "web_search_options": lambda v, body: v is None,
}
INERT: dict[str, list[Any]] = {"functions": FALSY, "function_call": [None, "none"], "suffix": FALSY,
                               "best_of": [None, 1], "audio": [None], "modalities": [None, ["text"]],
                               "prediction": [None], "web_search_options": [None]}  # the values each predicate passes


def _unused(name: str) -> dict[str, Any]:
    """An output constraint's value that asks for nothing: null (or absent); a response_format of type "text"."""
    if name == "response_format":
        return {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"type": {"const": "text"}}}]}
    return {"type": "null"}


def _given(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"required": [name], "properties": {name: schema}}


# Rules between fields, as JSON Schema states them; each is enforced where the comment says.
RULES: dict[str, list[dict[str, Any]]] = {
    "_Request": [
        # server/structured.py: at most one output constraint, i.e. all but one unused (no `not`: a fuzzer's
        # generator would expand its complement into every combination)
        {"anyOf": [{"properties": {other: _unused(other) for other in CONSTRAINTS if other != one}}
                   for one in CONSTRAINTS]},
    ],
    "ChatCompletionRequest": [
        # _top_logprobs: as vLLM, top_logprobs above 0 needs logprobs
        {"if": _given("top_logprobs", {"type": "integer", "minimum": 1}), "then": _given("logprobs", {"const": True})},
        # server/tools.py: a tool_choice other than "none" needs tools
        {"if": _given("tool_choice", {"not": {"enum": ["none", None]}}),
         "then": _given("tools", {"type": "array", "minItems": 1})},
    ],
    "CompletionRequest": [
        # SamplingParams: 0 tokens only to score the prompt (echo + logprobs)
        {"if": _given("max_tokens", {"const": 0}),
         "then": {"required": ["echo", "logprobs"], "properties": {"echo": {"const": True},
                                                                   "logprobs": {"type": "integer"}}}},
    ],
    "ResponseFormat": [
        # server/structured.py: type json_schema needs its json_schema
        {"if": _given("type", {"const": "json_schema"}),
         "then": _given("json_schema", {"type": "object"})},
    ],
}


def _document(schema: dict[str, Any], model: type) -> None:
    """The model's JSON schema, with its rules between fields (and a request's unsupported fields)."""
    rules = [rule for cls in model.__mro__ for rule in RULES.get(cls.__name__, [])]
    if rules:
        schema["allOf"] = rules
    if issubclass(model, _Request):
        schema["properties"].update({name: {"enum": values, "description": "not supported by pagedserve: only "
                                            "this value is accepted"} for name, values in INERT.items()})


class _Strict(BaseModel):
    """A request object: JSON types as the document states them; unknown fields are ignored, as vLLM does."""

    model_config = ConfigDict(strict=True, extra="ignore", json_schema_extra=_document)


def below(n: int) -> str:
    """A regex of the decimal numbers 0 ... n - 1 (no sign, no leading zero), anchored: JSON Schema has no numeric
    range for an object's keys, so logit_bias's token ids get one as a pattern."""
    top = str(n - 1)
    if len(top) == 1:
        return f"^[0-{top}]$"
    alts = ["0", "[1-9]" + (f"[0-9]{{0,{len(top) - 2}}}" if len(top) > 2 else "")]  # fewer digits than top
    for i, digit in enumerate(top):  # as many digits: top's first i digits, then a smaller digit, then any
        low, high = (1 if i == 0 else 0), int(digit) - 1
        if high >= low:
            rest = len(top) - i - 1
            tail = "" if not rest else "[0-9]" if rest == 1 else f"[0-9]{{{rest}}}"
            alts.append(top[:i] + (f"[{low}-{high}]" if high > low else str(low)) + tail)
    alts.append(top)
    return f"^(?:{'|'.join(alts)})$"


def document_limits(doc: Any, vocab_size: int | None, max_output_tokens: int | None,
                    priorities: bool | None = None, model_name: str | None = None) -> None:
    """Write the served model's and server's own limits into the OpenAPI document where the models marked them.
    An integer's bounds are written as integers: FastAPI's document has them as floats, and a fuzzer comparing in
    floats reads 2**64 + 382 as within `exclusiveMaximum: 2**64` (seed's)."""
    stack = [doc]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack += node
            continue
        if not isinstance(node, dict):
            continue
        if node.get("type") == "integer":
            for bound in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
                if isinstance(node.get(bound), float) and node[bound].is_integer():
                    node[bound] = int(node[bound])
        if node.pop(TOKEN_ID, None) and vocab_size is not None:
            node["maximum"] = vocab_size - 1
        if node.pop(TOKEN_KEY, None) and vocab_size is not None:
            node["pattern"] = below(vocab_size)
        if node.pop(OUTPUT_TOKENS, None) and max_output_tokens is not None:
            node["maximum"] = max_output_tokens
        if node.pop(PRIORITY, None) and priorities is False:
            node["enum"] = [0]
        if node.pop(MODEL, None) and model_name is not None:
            node["anyOf"] = [{"type": "string", "enum": [model_name]}, {"type": "null"}]
        stack += node.values()

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


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    model_config = ConfigDict(populate_by_name=True)

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Request(_Strict):
    model: str | None = Field(default=None, json_schema_extra={MODEL: True})
    max_tokens: Int(ge=0, json_schema_extra={OUTPUT_TOKENS: True}) | None = None  # 0: see RULES
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: Int(ge=-1) | None = None  # extension
    n: Int(ge=1, le=16) = 1
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: list[Int(ge=0)] | None = None  # extension; one outside the vocabulary never stops
    seed: Int(ge=-(2**63), lt=2**64) | None = None  # lt: 2**64 is exact in the document's floats
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
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: Annotated[str, Field(json_schema_extra={"format": "grammar"})] | None = Field(
        default=None, description="Lark or GBNF, as llguidance reads them")
    logit_bias: LogitBias | None = None
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None  # extension (vLLM)
    # extension (vLLM): lower runs first under --scheduling-policy priority; else only 0 (the document says which)
    priority: Int(json_schema_extra={PRIORITY: True}) = 0

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
        return [v] if isinstance(v, str) else v


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Strict):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    """tool_choice naming the function to call (one of `tools`)."""

    type: Literal["function"]
    function: NamedFunction


class CalledFunction(_Strict):
    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends JSON text


class CalledTool(_Strict):
    """A past tool call in an assistant message."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class TextPart(_Strict):
    """A content part: only text ones are supported."""

    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[CalledTool] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # role "tool": which call this answers

    def text(self) -> str:
        """Plain text content; multi-part messages keep their text parts."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int(ge=1, json_schema_extra={OUTPUT_TOKENS: True}) | None = None
    max_completion_tokens: Int(ge=1, json_schema_extra={OUTPUT_TOKENS: True}) | None = None
    logprobs: bool = False
    top_logprobs: Int(ge=0, le=20) | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v and not info.data.get("logprobs"):  # as vLLM (0 asks for nothing more)
            raise ValueError("top_logprobs needs logprobs: true")
        return v


class CompletionRequest(_Request):
    prompt: Text | Annotated[list[TokenId], Field(min_length=1)] | Annotated[list[Text], Field(min_length=1)] | \
        Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    logprobs: Int(ge=0, le=5) | None = None
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
