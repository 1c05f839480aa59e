"""A request's output constraint: response_format or a guided_* field into a StructuredSpec."""

from __future__ import annotations

from typing import Any

from pagedserve.engine.errors import InvalidRequestError
from pagedserve.engine.structured import StructuredSpec


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
