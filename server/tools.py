"""Tool calling: tools into the prompt, `tool_choice` into a grammar, the model's `<tool_call>` output into
OpenAI `tool_calls` (whole, or as the streamed delta sequence).

The format is Hermes / Qwen2.5 / Qwen3's: each call is `<tool_call>\\n{"name": ..., "arguments": {...}}\\n
</tool_call>`. A chat template that renders `tools` itself (it mentions them) gets them as is; one that
does not (the bundled SmolLM2's) gets them described in the system message in that same format, so one
parser and one grammar serve both. `required` and a named function are enforced by the grammar; `auto`
lets the model choose and the parser finds what it wrote.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from ..engine.errors import InvalidRequestError
from ..engine.structured import JSON_STYLE, StructuredSpec

OPEN, CLOSE = "<tool_call>", "</tool_call>"

_SYSTEM = (
    "You can call functions. Their signatures are listed inside <tools></tools> XML tags:\n<tools>\n{tools}\n"
    "</tools>\nTo call a function, write a JSON object with its name and arguments inside <tool_call>"
    "</tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n"
    "</tool_call>"
)


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # "none" | "auto" | "required" | "named"
    name: str | None = None


def resolve_tool_choice(tools: list[dict] | None, tool_choice: Any) -> ToolChoice:
    """Validate tools / tool_choice as OpenAI does; 400 (InvalidRequestError) on a mismatch. Two tools may share a
    name, as vLLM allows (no JSON schema could state the rule): a call may then follow either's parameters."""
    names = [t["function"]["name"] for t in tools or []]
    if tool_choice is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise InvalidRequestError(f"tool_choice must be 'none', 'auto', 'required' or a function, got "
                                      f"{tool_choice!r}", "tool_choice")
        if tool_choice != "none" and not tools:
            raise InvalidRequestError(f"tool_choice {tool_choice!r} needs `tools`", "tool_choice")
        return ToolChoice(tool_choice)
    function = tool_choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if tool_choice.get("type") != "function" or not isinstance(name, str):
        raise InvalidRequestError("a named tool_choice is {\"type\": \"function\", \"function\": {\"name\": ...}}",
                                  "tool_choice")
    if name not in names:
        raise InvalidRequestError(f"tool_choice names function {name!r}, which is not in `tools`", "tool_choice")
    return ToolChoice("named", name)


def render_messages(messages: list[dict[str, Any]], tools: list[dict] | None, choice: ToolChoice,
                    tokenizer) -> tuple[list[dict[str, Any]], list[dict] | None]:
    """Messages (and the tools argument) for the chat template.

    A template that mentions `tools` renders them, assistant tool_calls and tool turns itself. Otherwise
    tools go into the system message and past calls / results become `<tool_call>` / `<tool_response>`
    text."""
    offered = tools if choice.mode != "none" else None
    if "tools" in (getattr(tokenizer, "chat_template", None) or ""):
        # templates write arguments with `tojson`: hand them objects, not the JSON strings OpenAI sends
        return [{**m, "tool_calls": [{**c, "function": {**c.get("function", {}), **_call_json(c)}}
                                     for c in m["tool_calls"]]} if m.get("tool_calls") else m
                for m in messages], offered
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = "\n".join(f"{OPEN}\n{json.dumps(_call_json(c))}\n{CLOSE}" for c in m.pop("tool_calls"))
            m["content"] = f"{m.get('content') or ''}{calls}"
        if m["role"] == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        out.append(m)
    if offered:
        listing = "\n".join(json.dumps(t) for t in offered)
        text = _SYSTEM.format(tools=listing)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "role": "system", "content": f"{out[0].get('content') or ''}\n\n{text}"}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out, None


def _call_json(call: dict) -> dict:
    fn = call.get("function") or {}
    args = fn.get("arguments") or "{}"
    with contextlib.suppress(json.JSONDecodeError):  # not JSON: the string stays, the model sees what was sent
        args = json.loads(args) if isinstance(args, str) else args
    return {"name": fn.get("name"), "arguments": args}


# Keywords whose value is a subschema or a list of them, for another instance (a property, an item) or for the
# same one (a branch); and those whose value maps names to subschemas
_OTHER = ("additionalProperties", "items", "prefixItems", "additionalItems", "unevaluatedItems")
_BRANCHES = ("anyOf", "oneOf", "allOf", "then", "else")
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed(schema: Any, partial: bool = False) -> Any:
    """`schema` with every object that does not say whether it takes more properties closed to them
    (`additionalProperties: false`), as xgrammar (vLLM's default) generates tool calls: JSON Schema's default lets an
    object have any property, which lets a small model invent arguments the function never declared. An object
    that says so keeps what it allows (`additionalProperties: true` or a schema; `unevaluatedProperties`).

    A `partial` schema describes only part of its object (a branch of allOf, then / else, a dependent schema, or of
    an anyOf / oneOf beside the object's own properties): it stays open, or it would refuse the other parts'
    properties; so does an object made of such parts. `not`, `if`, `contains` and `propertyNames` are left as
    they are."""
    if isinstance(schema, list):
        return [closed(s, partial) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    own = "properties" in out or "patternProperties" in out
    for key in _OTHER:
        if key in out:
            out[key] = closed(out[key])
    for key in _BRANCHES:
        if key in out:
            out[key] = closed(out[key], partial=own or key not in ("anyOf", "oneOf"))
    for key in _MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(sub, partial=key == "dependentSchemas") for name, sub in out[key].items()}
    types = out.get("type")
    is_object = own or types == "object" or (isinstance(types, list) and "object" in types)
    composed = any(key in out for key in (*_BRANCHES, "dependentSchemas"))
    if is_object and not (partial or composed) and "additionalProperties" not in out and \
            "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    return out


def tool_grammar(tools: list[dict], choice: ToolChoice, parallel: bool) -> StructuredSpec | None:
    """A Lark grammar forcing one (or, with parallel_tool_calls, one or more) calls to the allowed
    functions with schema-valid arguments; None for auto / none. Arguments have only the properties their function
    declares, unless its schema allows more (`closed`)."""
    if choice.mode not in ("required", "named"):
        return None
    variants = []
    for t in tools:
        fn = t["function"]
        if choice.mode == "named" and fn["name"] != choice.name:
            continue
        params = closed(fn.get("parameters") or {"type": "object", "properties": {}})
        variants.append({"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": params},
                         "required": ["name", "arguments"], "additionalProperties": False})
    schema = {"anyOf": variants, "x-guidance": {**JSON_STYLE, "lenient": True}}
    repeat = ' ("\\n" call)*' if parallel and choice.mode == "required" else ""
    lark = (f"start: call{repeat}\ncall: {json.dumps(OPEN + chr(10))} body {json.dumps(chr(10) + CLOSE)}\n"
            f"body: %json {json.dumps(schema)}\n")
    return StructuredSpec("lark", lark, param="tools")


_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


@dataclass
class _Call:
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    index: int = -1  # assigned when announced
    text: str = ""  # the call body so far (between the tags)
    name: str | None = None
    args_start: int = -1  # where the arguments value starts in `text`
    args_sent: int = 0  # how much of the arguments text has been sent
    args_done: bool = False
    depth: int = 0
    in_string: bool = False
    escape: bool = False
    scanned: int = 0


@dataclass
class ToolCallParser:
    """Incremental: `feed(text)` / `finish()` return OpenAI deltas ({"content": ...} or {"tool_calls": [...]}).

    Non-streamed responses run the same parser over the whole text, so both agree exactly. A call's name
    is sent once known, then its arguments exactly as the model wrote them, as they arrive."""

    buf: str = ""
    in_call: _Call | None = None
    calls: list[dict] = field(default_factory=list)  # finished calls, OpenAI shape
    content: str = ""
    num_announced: int = 0

    def feed(self, text: str) -> list[dict]:
        self.buf += text
        out: list[dict] = []
        while True:
            if self.in_call is None:
                before, found = self._take_until(OPEN)
                self._content(before, out)
                if not found:
                    return out
                self.in_call = _Call()
            else:
                call = self.in_call
                before, found = self._take_until(CLOSE)
                call.text += before
                self._progress(call, out)
                if not found:
                    return out
                self._close(call, out)

    def finish(self) -> list[dict]:
        """End of output: flush held-back text; a call cut short still counts if its JSON is complete."""
        out: list[dict] = []
        text, self.buf = self.buf, ""
        if self.in_call is not None:
            self.in_call.text += text
            self._progress(self.in_call, out)
            self._close(self.in_call, out, closed=False)
        else:
            self._content(text, out)
        return out

    # ---- internals --------------------------------------------------------------------------------
    def _take_until(self, tag: str) -> tuple[str, bool]:
        """The buffered text before `tag`, and whether the tag was there (it is consumed too). Without it, a tail
        that may be the tag's start stays buffered: it may grow into the tag."""
        i = self.buf.find(tag)
        if i < 0:
            i = len(self.buf) - _partial_suffix(self.buf, tag)
            text, self.buf = self.buf[:i], self.buf[i:]
            return text, False
        text, self.buf = self.buf[:i], self.buf[i + len(tag):]
        return text, True

    def _content(self, text: str, out: list[dict]) -> None:
        if text:
            self.content += text
            if text.strip() or not self.num_announced:  # not the newlines between calls
                out.append({"content": text})

    def _progress(self, call: _Call, out: list[dict]) -> None:
        if call.name is None:
            m = _NAME.match(call.text)
            if m is None or m.end() == len(call.text):  # wait for the value's first character
                return
            try:
                call.name = json.loads(f'"{m.group(1)}"')
            except json.JSONDecodeError:
                return
            call.args_start = call.scanned = m.end()
            out.append(self._header(call))
        if call.args_done:
            return
        # scan the arguments value: it ends when its brackets balance (strings respected)
        text, end = call.text, None
        for k in range(call.scanned, len(text)):
            ch = text[k]
            if call.in_string:
                if call.escape:
                    call.escape = False
                elif ch == "\\":
                    call.escape = True
                elif ch == '"':
                    call.in_string = False
            elif ch == '"':
                call.in_string = True
            elif ch in "{[":
                call.depth += 1
            elif ch in "}]":
                call.depth -= 1
                if call.depth == 0:
                    end = k + 1
                    break
            elif call.depth == 0 and not ch.isspace():
                return  # a non-object value: sent whole when the call closes
        upto = call.scanned = len(text) if end is None else end
        if call.depth > 0 or end is not None:
            self._args(call, text[call.args_start + call.args_sent:upto], out)
        call.args_done = end is not None

    def _args(self, call: _Call, piece: str, out: list[dict]) -> None:
        if piece:
            call.args_sent += len(piece)
            out.append({"tool_calls": [{"index": call.index, "function": {"arguments": piece}}]})

    def _header(self, call: _Call) -> dict:
        call.index, self.num_announced = self.num_announced, self.num_announced + 1
        return {"tool_calls": [{"index": call.index, "id": call.id, "type": "function",
                                "function": {"name": call.name, "arguments": ""}}]}

    def _close(self, call: _Call, out: list[dict], closed: bool = True) -> None:
        """The call's text is complete: check it is a JSON call and record it; otherwise it is content."""
        self.in_call = None
        try:
            obj = json.loads(call.text)
        except json.JSONDecodeError:
            obj = None
        args_key = next((k for k in ("arguments", "parameters") if isinstance(obj, dict) and k in obj), None)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or args_key is None:
            if call.name is None:  # never announced: hand the text back as content
                self._content(f"{OPEN}{call.text}{CLOSE if closed else ''}", out)
            else:  # announced, then broken (cut short): keep what was sent, as the stream did
                self.calls.append(self._record(call, call.text[call.args_start:call.args_start + call.args_sent]))
            return
        if call.name is None:
            call.name = obj["name"]
            out.append(self._header(call))
        raw = _raw_value(call.text, args_key)
        args = raw if raw is not None else json.dumps(obj[args_key])
        self._args(call, args[call.args_sent:], out)  # what the stream has not sent yet
        self.calls.append(self._record(call, args))

    @staticmethod
    def _record(call: _Call, args: str) -> dict:
        return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": args}}


def _raw_value(text: str, key: str) -> str | None:
    """The value of top-level `key` in JSON object `text`, exactly as written."""
    m = re.search(rf'"{key}"\s*:\s*', text)
    if m is None:
        return None
    try:
        _, end = json.JSONDecoder().raw_decode(text, m.end())
    except json.JSONDecodeError:
        return None
    return text[m.end():end]


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `tag` (held back, it may grow)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """The whole output: (content or None, OpenAI tool_calls)."""
    p = ToolCallParser()
    p.feed(text)
    p.finish()
    if not p.calls:
        return p.content, []
    return p.content.strip() or None, p.calls
