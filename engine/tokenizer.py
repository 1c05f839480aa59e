"""Tokenizer loading (HF tokenizers, also from GGUF metadata) and incremental detokenization."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from typing import Any

from engine.errors import ModelLoadError

logger = logging.getLogger(__name__)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str):
    """The Hugging Face tokenizer of a GGUF file or model directory.

    None for random weights or a directory without tokenizer files: such an engine takes token ids only.
    """
    if path.startswith("random:"):
        return None
    if os.path.isdir(path) and not any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES):
        logger.warning("no tokenizer files in %s: the engine will accept token ids only", path)
        return None
    from transformers import AutoTokenizer

    try:
        if path.endswith(".gguf"):
            return _gguf_tokenizer(path)
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load a tokenizer from {path!r}: {e}") from e


def _gguf_tokenizer(path: str):
    """Converting GGUF vocab to a fast tokenizer takes seconds; keep the result in a local cache."""
    from transformers import AutoTokenizer

    st = os.stat(path)
    key = hashlib.sha256(f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    cache_root = os.environ.get("PAGEDSERVE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "pagedserve"))
    cached = os.path.join(cache_root, "tokenizers", key)
    if os.path.isfile(os.path.join(cached, "tokenizer.json")):
        try:
            return AutoTokenizer.from_pretrained(cached)
        except (OSError, ValueError):
            pass  # a damaged cache entry: rebuild it
    tok = AutoTokenizer.from_pretrained(os.path.dirname(path) or ".", gguf_file=os.path.basename(path))
    try:
        tmp = f"{cached}.tmp{os.getpid()}"
        tok.save_pretrained(tmp)
        os.replace(tmp, cached) if not os.path.exists(cached) else shutil.rmtree(tmp)
    except OSError as e:  # a read-only home is fine, just slower
        logger.info("tokenizer cache not written: %s", e)
    return tok


def apply_chat_template(tokenizer, messages: list[dict[str, Any]], tools: list[dict] | None = None) -> list[int]:
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template; use completions with a plain prompt")
    ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # transformers >= 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas.

    Decodes a small window twice (before and after the new tokens) so that multi-token characters
    and leading-space rules come out as a full decode would; a delta ending in U+FFFD (an incomplete
    UTF-8 character) is held back until the next token completes it.
    """

    CONTEXT = 5  # prompt tokens kept as left context

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-self.CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def push(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        self.ids.extend(token_ids)
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        prefix = decode(self.ids[self.prefix_offset:self.read_offset])
        text = decode(self.ids[self.prefix_offset:])
        if len(text) <= len(prefix) or text.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text[len(prefix):]


class StopStringMatcher:
    """Accumulates output text, truncates at the first stop string, and says how much is safe to send.

    A tail of the text that is a prefix of some stop string is held back until it either completes
    the stop string or stops matching, so nothing after a stop string ever reaches the client.
    """

    def __init__(self, stop: list[str]) -> None:
        self.stop = stop
        self.longest = max((len(s) for s in stop), default=0)
        self.text = ""
        self.sent = 0
        self.stopped = False

    def feed(self, delta: str) -> None:
        if self.stopped:
            return
        if not self.stop:
            self.text += delta
            return
        start = max(0, len(self.text) - self.longest + 1)
        self.text += delta
        cut = min((i for i in (self.text.find(s, start) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.text = self.text[:cut]
            self.stopped = True

    def _pending_prefix(self) -> int:
        """Length of the longest tail of the text that could still grow into a stop string."""
        for k in range(min(self.longest - 1, len(self.text)), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0

    def take(self, final: bool) -> str:
        """The next piece of text to send; everything that is left when `final`."""
        end = len(self.text) if (final or self.stopped) else max(self.sent, len(self.text) - self._pending_prefix())
        piece = self.text[self.sent:end]
        self.sent = end
        return piece
