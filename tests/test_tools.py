"""server/tools.py without a model: the <tool_call> parser (whole and streamed), prompts, tool_choice."""

from __future__ import annotations

import copy
import json
import random

import pytest

from pagedserve.engine.errors import InvalidRequestError
from pagedserve.engine.structured import StructuredOutputs
from pagedserve.server.tools import (
    ToolCallParser,
    closed,
    parse_tool_calls,
    render_messages,
    resolve_tool_choice,
    tool_grammar,
)

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}},
    {"type": "function", "function": {"name": "echo", "parameters": {"type": "object"}}}]

OUTPUTS = [
    'Let me add. <tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
    '<tool_call>\n{"name": "echo", "arguments": {"s": "a \\" } ] <tool_call>", "n": [1, {"x": []}]}}\n</tool_call>\n'
    '<tool_call>\n{"name": "add", "arguments": {"a": -1, "b": 0}}\n</tool_call>',
    '<tool_call>\n{"arguments": {"a": 1, "b": 2}, "name": "add"}\n</tool_call>',  # name after the arguments
    '<tool_call>\n{"name": "add", "arguments": {"a": 1',  # cut by max_tokens
    'no call here, just a < and <tool',
    '<tool_call>\nnot json\n</tool_call> trailing',
]


def _stream(text: str, rng: random.Random) -> tuple[str, list[tuple[str, str]]]:
    p, deltas, i = ToolCallParser(), [], 0
    while i < len(text):
        k = rng.randint(1, 7)
        deltas += p.feed(text[i:i + k])
        i += k
    deltas += p.finish()
    content, calls = "", {}
    for d in deltas:
        content += d.get("content", "")
        for tc in d.get("tool_calls", []):
            if "id" in tc:  # the header: id, type and name, before any argument fragment
                assert tc["index"] not in calls and tc["type"] == "function" and tc["function"]["arguments"] == ""
                calls[tc["index"]] = [tc["function"]["name"], ""]
            calls[tc["index"]][1] += tc["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return content, [tuple(calls[k]) for k in sorted(calls)]


@pytest.mark.parametrize("text", OUTPUTS)
def test_streamed_deltas_reassemble_to_the_whole_parse(text):
    content, calls = parse_tool_calls(text)
    whole = [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    for seed in range(40):
        s_content, s_calls = _stream(text, random.Random(seed))
        assert s_calls == whole
        assert s_content.strip() == (content or "").strip()


def test_parse_results():
    content, calls = parse_tool_calls(OUTPUTS[0])
    assert content == "Let me add." and len(calls) == 1 and calls[0]["id"].startswith("call_")
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 2, "b": 3}
    content, calls = parse_tool_calls(OUTPUTS[1])
    assert content is None and [c["function"]["name"] for c in calls] == ["echo", "add"]
    assert json.loads(calls[0]["function"]["arguments"])["s"] == 'a " } ] <tool_call>'
    assert json.loads(parse_tool_calls(OUTPUTS[2])[1][0]["function"]["arguments"]) == {"a": 1, "b": 2}
    assert parse_tool_calls(OUTPUTS[4]) == (OUTPUTS[4], [])
    assert parse_tool_calls(OUTPUTS[5]) == (OUTPUTS[5], [])


def test_tool_choice_validation():
    assert resolve_tool_choice(TOOLS, None).mode == "auto"
    assert resolve_tool_choice(None, None).mode == "none"
    assert resolve_tool_choice(TOOLS, {"type": "function", "function": {"name": "add"}}).name == "add"
    for tools, choice in [(None, "required"), (TOOLS, {"type": "function", "function": {"name": "nope"}}),
                          (TOOLS, "sometimes")]:
        with pytest.raises(InvalidRequestError):
            resolve_tool_choice(tools, choice)
    # two tools of one name are accepted, as vLLM accepts them (no JSON schema can state the rule): a call to that
    # name may follow either's parameters
    twice = TOOLS + [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    spec = tool_grammar(twice, resolve_tool_choice(twice, {"type": "function", "function": {"name": "add"}}), True)
    assert spec.value.count('"const": "add"') == 2 and '"echo"' not in spec.value


def test_tool_grammar_only_for_required_and_named():
    assert tool_grammar(TOOLS, resolve_tool_choice(TOOLS, "auto"), True) is None
    spec = tool_grammar(TOOLS, resolve_tool_choice(TOOLS, {"type": "function", "function": {"name": "echo"}}), True)
    assert spec.kind == "lark" and '"echo"' in spec.value and '"add"' not in spec.value
    assert '("\\n" call)*' in tool_grammar(TOOLS, resolve_tool_choice(TOOLS, "required"), True).value
    assert "call)*" not in tool_grammar(TOOLS, resolve_tool_choice(TOOLS, "required"), False).value


# A chat template in the style of Qwen2.5's (written for this test): tools in the system turn, calls and
# results as <tool_call> / <tool_response> blocks, arguments rendered with tojson.
NATIVE = (
    "{%- if tools %}<|im_start|>system\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>"
    "<|im_end|>\n{%- endif %}{%- for m in messages %}{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ m.content }}\n</tool_response><|im_end|>\n{%- else %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")

HISTORY = [{"role": "user", "content": "2 + 3?"},
           {"role": "assistant", "content": "", "tool_calls": [
               {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "5"}]


def test_native_and_fallback_templates_render_tools_calls_and_results(smollm):
    from pagedserve.engine.tokenizer import apply_chat_template

    native = copy.deepcopy(smollm.tokenizer)
    native.chat_template = NATIVE
    choice = resolve_tool_choice(TOOLS, "auto")
    for tok in (native, smollm.tokenizer):  # the bundled template knows nothing of tools: the fallback
        msgs, tools = render_messages(HISTORY, TOOLS, choice, tok)
        text = tok.decode(apply_chat_template(tok, msgs, tools=tools))
        assert '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>' in text
        assert "<tool_response>\n5\n</tool_response>" in text and '"name": "echo"' in text
    msgs, _ = render_messages(HISTORY, TOOLS, resolve_tool_choice(TOOLS, "none"), smollm.tokenizer)
    assert "echo" not in json.dumps(msgs)


WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
           "required": ["city", "unit"]}  # no additionalProperties: JSON Schema's default would allow any


def _grammar_accepts(tokenizer, parameters: dict, arguments: str) -> bool:
    """Whether tool_choice "required" over get_weather(parameters) lets the model write these arguments."""
    import llguidance

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": parameters}}]
    spec = tool_grammar(tools, resolve_tool_choice(tools, "required"), False)
    outputs = StructuredOutputs(tokenizer, len(tokenizer))
    matcher = llguidance.LLMatcher(outputs.ll_tokenizer, outputs.compile(spec), log_level=0)
    text = f'<tool_call>\n{{"name": "get_weather", "arguments": {arguments}}}\n</tool_call>'
    return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()


def test_tool_arguments_have_only_declared_properties_unless_the_schema_allows_more(smollm):
    """As xgrammar (vLLM's default) generates them: an object that does not say whether it takes more properties
    takes none, so a model cannot invent arguments (issue 49: {"city": "Oslo", "unit": "f", "criteria": ...})."""
    tok = smollm.tokenizer
    assert _grammar_accepts(tok, WEATHER, '{"city": "Oslo", "unit": "f"}')
    assert not _grammar_accepts(tok, WEATHER, '{"city": "Oslo", "unit": "f", "criteria": "is_winter"}')
    assert not _grammar_accepts(tok, {}, '{"x": 1}') and _grammar_accepts(tok, {}, "{}")  # no parameters: none
    nested = {"type": "object", "properties": {"where": WEATHER}, "required": ["where"]}
    assert not _grammar_accepts(tok, nested, '{"where": {"city": "Oslo", "unit": "f", "x": 1}}')
    assert _grammar_accepts(tok, nested, '{"where": {"city": "Oslo", "unit": "f"}}')
    for more in (True, {"type": "integer"}):  # the schema allows more: extra keys stay possible
        assert _grammar_accepts(tok, {**WEATHER, "additionalProperties": more}, '{"city": "Oslo", "unit": "f", "n": 1}')
    assert not _grammar_accepts(tok, {**WEATHER, "additionalProperties": {"type": "integer"}},
                                '{"city": "Oslo", "unit": "f", "n": "x"}')


def test_closed_leaves_parts_of_an_object_open():
    """allOf branches, then / else and dependent schemas describe part of an object (so does an anyOf beside the
    object's own properties); closing them, or an object made of them, would refuse the other parts' properties."""
    parts = {"type": "object", "properties": {"k": {}}, "anyOf": [{"properties": {"x": {}}}],
             "allOf": [{"properties": {"y": {}}}], "dependentSchemas": {"k": {"properties": {"z": {}}}}}
    assert closed(parts) == parts
    alternatives = {"anyOf": [{"type": "object", "properties": {"a": {}}}, {"type": "string"}],
                    "$defs": {"D": {"properties": {"q": {"type": "object"}}}}, "not": {"type": "object"}}
    assert closed(alternatives) == {
        "anyOf": [{"type": "object", "properties": {"a": {}}, "additionalProperties": False}, {"type": "string"}],
        "$defs": {"D": {"properties": {"q": {"type": "object", "additionalProperties": False}},
                        "additionalProperties": False}}, "not": {"type": "object"}}
    unevaluated = {"type": "object", "unevaluatedProperties": True}
    assert closed(unevaluated) == unevaluated
    assert closed({"type": "array", "items": {"type": "object"}})["items"]["additionalProperties"] is False
