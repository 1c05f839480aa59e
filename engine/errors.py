"""Typed engine errors. They subclass ValueError so plain callers can catch them as such."""

from __future__ import annotations

import argparse
import typing


class InvalidRequestError(ValueError):
    """A request the engine refuses; `param` names the offending field, `code` is OpenAI-style."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class ContextLengthExceededError(InvalidRequestError):
    def __init__(self, num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
        super().__init__(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} "
            f"for the completion). Please reduce the prompt or max_tokens.",
            param="messages",
            code="context_length_exceeded",
        )
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len


class ModelLoadError(ValueError):
    """The model path is missing, unreadable, or of an unsupported architecture."""


class ArgumentParser(argparse.ArgumentParser):
    """The parser of every `pagedserve` command: a bad flag exits 1 with one line, like every other error of
    the CLI, where argparse prints the whole usage and exits 2. Subcommands' parsers inherit it."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(1, f"{self.prog}: error: {message}\n")
