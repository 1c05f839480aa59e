"""Error answers in the shape of the dialect a route speaks: OpenAI's everywhere, Anthropic's under /v1/messages.

Every refusal (the guards' 401 / 408 / 413, validation's 400, the pipeline's APIError, a 404 or a 500) is stated
once in OpenAI's terms (status, message, type, param, code, headers) and rendered here for the route it answers, so
a client of either dialect parses every error its SDK knows. Another dialect is one more entry in `DIALECTS`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import anthropic_protocol
from .protocol import error_body

# (status, message, type, param, code, headers) -> (status, body, headers)
Render = Callable[[int, str, str, str | None, str | None, dict[str, str] | None],
                  tuple[int, dict[str, Any], dict[str, str] | None]]


def openai_error(status: int, message: str, type_: str, param: str | None, code: str | None,
                 headers: dict[str, str] | None) -> tuple[int, dict[str, Any], dict[str, str] | None]:
    return status, error_body(message, type_, param, code), headers


def anthropic_error(status: int, message: str, type_: str, param: str | None, code: str | None,
                    headers: dict[str, str] | None) -> tuple[int, dict[str, Any], dict[str, str] | None]:
    """Anthropic's API says "try again soon" with 529 overloaded_error: a 503 that comes with Retry-After (loading,
    draining) is one; one without (the engine died) stays a 503 api_error."""
    if status == 503 and headers and "Retry-After" in headers:
        status = 529
    return status, anthropic_protocol.error_body(status, message), headers


DIALECTS: tuple[tuple[str, Render], ...] = (("/v1/messages", anthropic_error),)


def dialect(path: str) -> Render:
    """How errors of the route at `path` are rendered."""
    for prefix, render in DIALECTS:
        if path == prefix or path.startswith(prefix + "/"):
            return render
    return openai_error


def error_answer(path: str, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any], dict[str, str] | None]:
    """The status, JSON body and headers of an error answered on `path`."""
    return dialect(path)(status, message, type_, param, code, headers)
