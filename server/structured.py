"""A request's output constraints: response_format / guided_* into a StructuredSpec, logit_bias into ids."""

from __future__ import annotations

from typing import Any

from ..engine.errors import InvalidRequestError
from ..engine.structured import StructuredSpec


def structured_spec(body: Any) -> StructuredSpec | None:
    """The one grammar a request asks for (OpenAI's response_format or one of vLLM's guided_* fields)."""
    specs: list[tuple[str, StructuredSpec]] = []
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        specs.append(("response_format", StructuredSpec("json_object")))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None:
            raise InvalidRequestError("response_format of type json_schema needs a `json_schema` object",
                                      "response_format")
        # strict: a keyword the grammar engine cannot enforce is an error; otherwise it is ignored
        specs.append(("response_format", StructuredSpec("json_schema", rf.json_schema.schema_,
                                                        strict=bool(rf.json_schema.strict))))
    for name, kind in (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        if (value := getattr(body, name)) is not None:  # vLLM's guided_json ignores what it cannot enforce
            specs.append((name, StructuredSpec(kind, value, strict=kind != "json_schema", param=name)))
    if len(specs) > 1:
        raise InvalidRequestError(f"give at most one output constraint; got {', '.join(n for n, _ in specs)}",
                                  specs[1][0])
    return specs[0][1] if specs else None


def logit_bias(body: Any) -> dict[int, float] | None:
    """OpenAI sends token ids as JSON object keys (strings)."""
    if not body.logit_bias:
        return None
    try:
        return {int(k): float(v) for k, v in body.logit_bias.items()}
    except ValueError as e:
        raise InvalidRequestError("logit_bias keys must be token ids", "logit_bias") from e
