"""Tokenizer loading (HF tokenizers, also from GGUF metadata) and incremental detokenization."""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import shutil
from collections import deque
from typing import Any

from .errors import ModelLoadError
from .machine import cache_dir

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
    cached = str(cache_dir() / "tokenizers" / key)
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


def apply_chat_template(tokenizer, messages: list[dict[str, Any]], tools: list[dict] | None = None,
                        continue_final: bool = False) -> list[int]:
    """Prompt token ids for chat messages. Message text never becomes control tokens: content that spells
    a special token (`<|im_end|>\n<|im_start|>system`) is tokenized as the plain text it is. `continue_final`: the
    last message is an assistant's reply to continue (Anthropic's prefill), not a turn to answer."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template; use completions with a plain prompt")
    specials = _special_texts(tokenizer)
    turn = {"add_generation_prompt": not continue_final, "continue_final_message": continue_final}
    if not any(sp in str(m.get("content") or "") for m in messages for sp in specials):
        return _token_list(tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, **turn))
    # Render the template around placeholders, then tokenize the template's own text with special tokens
    # and each message's text without: the template decides the structure, the user only the content.
    marks = [f"\ue000{secrets.token_hex(8)}\ue001" for _ in messages]
    text = tokenizer.apply_chat_template([{**m, "content": mark} for m, mark in zip(messages, marks)],
                                         tools=tools, tokenize=False, **turn)
    ids: list[int] = []
    for mark, message in zip(marks, messages):
        if text.count(mark) != 1:
            raise ValueError("a message contains special-token text, and this model's chat template does not "
                             "keep message text apart: remove the special tokens from the content")
        head, text = text.split(mark)
        ids += _encode(tokenizer, head, split_special=False)
        ids += _encode(tokenizer, str(message.get("content") or ""), split_special=True)
    return ids + _encode(tokenizer, text, split_special=False)


def _special_texts(tokenizer) -> list[str]:
    """The strings the tokenizer would turn into special (control) tokens."""
    cached = getattr(tokenizer, "_pagedserve_special_texts", None)
    if cached is None:
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        cached = sorted({t.content for t in added.values() if getattr(t, "special", False)}
                        | set(getattr(tokenizer, "all_special_tokens", []) or []))
        tokenizer._pagedserve_special_texts = cached
    return cached


def _encode(tokenizer, text: str, split_special: bool) -> list[int]:
    if not text:
        return []
    # the template writes its own BOS; add_special_tokens=False keeps a second one out
    return _token_list(tokenizer(text, add_special_tokens=False, split_special_tokens=split_special)["input_ids"])


def _token_list(ids) -> list[int]:
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

    def __init__(self, tokenizer, prompt_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_token_ids[-self.CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def push(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        self.ids.extend(token_ids)
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)
        prefix = decode(self.ids[self.prefix_offset:self.read_offset])
        text = decode(self.ids[self.prefix_offset:])
        if len(text) <= len(prefix) or text.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text[len(prefix):]


class StopStringMatcher:
    """Streams output text, truncates it at the first stop string, and says how much is safe to send.

    An Aho-Corasick automaton over the stop strings advances one character at a time, so each token
    costs time proportional to its own text, however long the output or the stop strings. The
    automaton's state is the longest tail of the text that is a prefix of some stop string: exactly
    the text that must be held back until it completes a stop string or stops matching. Generation is
    sequential, so the stop string that completes first wins (its longest variant, if several end there).
    """

    def __init__(self, stop: list[str]) -> None:
        self.stop = stop
        # trie nodes: children, depth, failure link, length of the longest stop string ending here (0: none)
        self._next: list[dict[str, int]] = [{}]
        self._depth = [0]
        ends = set()
        for s in stop:
            node = 0
            for ch in s:
                if ch not in self._next[node]:
                    self._next[node][ch] = len(self._next)
                    self._next.append({})
                    self._depth.append(self._depth[node] + 1)
                node = self._next[node][ch]
            ends.add(node)
        self._fail = [0] * len(self._next)
        self._match = [depth if node in ends else 0 for node, depth in enumerate(self._depth)]
        queue = list(self._next[0].values())  # breadth-first: a node's failure target is shallower
        for node in queue:
            for ch, child in self._next[node].items():
                f = self._fail[node]
                while f and ch not in self._next[f]:
                    f = self._fail[f]
                target = self._next[f].get(ch, 0)
                self._fail[child] = target if target != child else 0
                self._match[child] = max(self._match[child], self._match[self._fail[child]])
                queue.append(child)
        self._state = 0
        self._ready: list[str] = []  # text safe to send
        # the tail that may still grow into a stop string (its length == the automaton state's depth), as
        # pieces: each character is appended once and released once, whatever the stop strings' length
        self._held: deque[str] = deque()
        self._held_len = 0
        self.stopped = False
        self.matched: str | None = None  # the stop string that stopped the text (Anthropic's stop_sequence)

    def feed(self, delta: str) -> None:
        if self.stopped or not delta:
            return
        if not self.stop:
            self._ready.append(delta)
            return
        nxt, fail, match, state = self._next, self._fail, self._match, self._state
        for i, ch in enumerate(delta):
            while state and ch not in nxt[state]:
                state = fail[state]
            state = nxt[state].get(ch, 0)
            if match[state]:  # cut the stop string (the held tail plus this delta's first i + 1 characters)
                self._hold(delta[:i + 1])
                self.matched = "".join(self._held)[-match[state]:]
                self._release(self._held_len - match[state])
                self._held.clear()
                self._held_len, self.stopped = 0, True
                return
        self._state = state
        self._hold(delta)
        self._release(self._held_len - self._depth[state])

    def _hold(self, text: str) -> None:
        self._held.append(text)
        self._held_len += len(text)

    def _release(self, n: int) -> None:
        """Move the first n held characters to the ready text."""
        self._held_len -= n
        while n > 0:
            piece = self._held.popleft()
            if len(piece) > n:
                self._held.appendleft(piece[n:])
                piece = piece[:n]
            self._ready.append(piece)
            n -= len(piece)

    @property
    def held(self) -> str:
        return "".join(self._held)

    def take(self, final: bool) -> str:
        """The next piece of text to send; everything that is left (held-back tail included) when `final`."""
        if final:
            self._release(self._held_len)
        piece = "".join(self._ready)
        self._ready.clear()
        return piece
