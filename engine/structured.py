"""Constrained decoding: grammars (JSON schema, regex, choice, Lark/EBNF) compiled by llguidance into
per-request matchers whose token bitmasks are applied to the logits before sampling.

`logit_bias` and `allowed_token_ids` ride the same path: an allowed-token list is a static bitmask row
ANDed with the grammar's row, a bias is added before the mask. Masks for a step are computed on a worker
thread (llguidance releases the GIL) while the forward pass runs; the sampler waits for them only when
it needs the logits masked.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import llguidance
import numpy as np
import torch

from .errors import InvalidRequestError

logger = logging.getLogger(__name__)

GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "grammar", "lark"]
# JSON as json.dumps writes it: one space after ':' and ',', no other whitespace. Flexible whitespace lets
# a small model at temperature 1 pad an object with newlines until max_tokens; a schema may opt back in
# through its "x-guidance" options.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
GRAMMAR_CACHE_SIZE = 256


@dataclass(frozen=True)
class StructuredSpec:
    """What the output must match. `value`: a JSON schema (dict or JSON text) for json_schema, None for
    json_object, a regex, a list of strings for choice, or Lark / GBNF text for grammar.
    `strict`: unknown JSON-schema keywords are an error (else ignored, as OpenAI's non-strict mode).
    `param`: the request field it came from, which an error names."""

    kind: GrammarKind
    value: Any = None
    strict: bool = True
    param: str = "response_format"

    def key(self) -> tuple[str, str, bool]:
        v = self.value if isinstance(self.value, str) else json.dumps(self.value, sort_keys=True)
        return self.kind, v, self.strict


def grammar_of(spec: StructuredSpec) -> str:
    """llguidance grammar text for a spec (not yet validated)."""
    try:
        if spec.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_STYLE)
        if spec.kind == "json_schema":
            schema = json.loads(spec.value) if isinstance(spec.value, str) else spec.value
            if not isinstance(schema, dict):
                raise InvalidRequestError("the JSON schema must be an object", spec.param)
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_STYLE,
                                                                 overrides={"lenient": not spec.strict})
        if spec.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(str(spec.value))
        if spec.kind == "choice":
            choices = spec.value
            if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
                raise InvalidRequestError("choice must be a non-empty list of strings", spec.param)
            return llguidance.grammar_from("choice", choices)
        if spec.kind == "lark":  # llguidance's Lark dialect (%json etc.), as built by the server's tool calls
            return llguidance.LLMatcher.grammar_from_lark(str(spec.value))
        if spec.kind == "grammar":
            return llguidance.grammar_from("grammar", str(spec.value))  # Lark, or GBNF converted to Lark
    except InvalidRequestError:
        raise
    except (ValueError, TypeError) as e:
        raise InvalidRequestError(f"invalid {spec.kind}: {e}", spec.param) from e
    raise InvalidRequestError(f"unknown structured output kind {spec.kind!r}", spec.param)


class GrammarMatcher:
    """One request's grammar state. Tracks how many output tokens it has consumed so the engine can
    re-sync it (after preemption, or rejected speculative drafts) from the sequence's token list."""

    __slots__ = ("matcher", "num_consumed", "eos_token_id")

    def __init__(self, matcher: llguidance.LLMatcher, eos_token_id: int) -> None:
        self.matcher = matcher
        self.num_consumed = 0
        self.eos_token_id = eos_token_id

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token. False if the grammar rejects it (it then stays in error)."""
        ok = self.matcher.consume_token(token_id)
        self.num_consumed += 1
        return ok

    def sync(self, output_token_ids: list[int]) -> None:
        """Make the state match `output_token_ids` (the sequence's outputs), rolling back or replaying."""
        if len(output_token_ids) <= self.num_consumed and not self.matcher.is_error():
            self.rollback(self.num_consumed - len(output_token_ids))
            return
        self.matcher.reset()
        self.num_consumed = 0
        for t in output_token_ids:
            self.accept(t)

    # ---- speculative decoding: roll back what the verifier rejected ---------------------------------------
    def rollback(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        if not self.matcher.rollback(num_tokens):
            raise RuntimeError(f"grammar rollback of {num_tokens} tokens failed: {self.matcher.get_error()}")
        self.num_consumed -= num_tokens

    @property
    def is_terminated(self) -> bool:
        """No token but EOS can follow: the output is complete."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error()


@dataclass(slots=True)
class TokenConstraint:
    """Everything that masks or biases one request's logits: a grammar, an allowed-token row, a bias.

    `mask_row` / `pending` are per-step: the row of the step's bitmask holding this request's grammar
    mask and the future that fills it."""

    matcher: GrammarMatcher | None = None
    blocked: torch.Tensor | None = None  # bool [vocab]: True where allowed_token_ids forbids the token
    bias_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    mask_row: int = -1
    pending: _StepMasks | None = None


@dataclass(slots=True)
class _StepMasks:
    bitmask: torch.Tensor  # int32 [rows, words], filled by llguidance
    future: Future | None = None
    _blocked: torch.Tensor | None = None

    def blocked(self, vocab: int) -> torch.Tensor:
        """bool [rows, vocab], True where the grammar forbids the token; unpacked once per step (numpy's
        unpackbits is much faster than shifting int32 words in torch; docs/performance.md)."""
        if self._blocked is None:
            if self.future is not None:
                self.future.result()
            bits = np.unpackbits(self.bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
            self._blocked = torch.from_numpy(bits[:, :vocab]) == 0
        return self._blocked


class StructuredOutputs:
    """The engine's grammar compiler (cached) and per-step mask builder."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._executor: llguidance.LLExecutor | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._grammars: OrderedDict[tuple[str, str, bool], str] = OrderedDict()  # LRU of validated grammars

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """Built on first use, which is not free: engines that never constrain output never pay for it."""
        with self._lock:
            if self._ll_tokenizer is None:
                if self.hf_tokenizer is None:
                    raise InvalidRequestError("structured output needs a tokenizer; this model has none",
                                              "response_format")
                import llguidance.hf

                n_vocab = max(self.vocab_size, len(self.hf_tokenizer))
                self._ll_tokenizer = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=n_vocab,
                                                                  eos_token=self.hf_tokenizer.eos_token_id)
            return self._ll_tokenizer

    def compile(self, spec: StructuredSpec) -> str:
        """Validated grammar text; raises InvalidRequestError naming the problem."""
        key = spec.key()
        with self._lock:
            if key in self._grammars:
                self._grammars.move_to_end(key)
                return self._grammars[key]
        grammar = grammar_of(spec)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.ll_tokenizer)
        if is_error:
            raise InvalidRequestError(f"invalid {spec.kind.replace('_', ' ')}: {messages[0]}", spec.param)
        with self._lock:
            self._grammars[key] = grammar
            while len(self._grammars) > GRAMMAR_CACHE_SIZE:
                self._grammars.popitem(last=False)
        return grammar

    def check(self, params) -> None:
        """Validate a request's constraints up front (the server turns errors into 400s)."""
        if params.structured is not None:
            self.compile(params.structured)
        for name in ("allowed_token_ids", "logit_bias"):
            ids = getattr(params, name)
            if ids and any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in ids):
                raise InvalidRequestError(f"{name} token ids must be integers in [0, {self.vocab_size})", name)

    def constraint_for(self, params) -> TokenConstraint | None:
        """A fresh per-request constraint (each n > 1 choice gets its own matcher), or None."""
        if params.structured is None and not params.allowed_token_ids and not params.logit_bias:
            return None
        self.check(params)
        c = TokenConstraint()
        if params.structured is not None:
            m = llguidance.LLMatcher(self.ll_tokenizer, self.compile(params.structured), log_level=0)
            if m.is_error():
                raise InvalidRequestError(f"invalid {params.structured.kind}: {m.get_error()}",
                                          params.structured.param)
            c.matcher = GrammarMatcher(m, self.ll_tokenizer.eos_token)
        if params.allowed_token_ids:
            c.blocked = torch.ones(self.vocab_size, dtype=torch.bool)
            c.blocked[torch.tensor(params.allowed_token_ids)] = False
        if params.logit_bias:
            c.bias_ids = torch.tensor(list(params.logit_bias), dtype=torch.long)
            c.bias_values = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32)
        return c

    # ---- per step -------------------------------------------------------------------------------
    def begin_step(self, constraints: list[tuple[TokenConstraint, Any]]) -> None:
        """Start computing this step's grammar masks on a worker thread, so they overlap the forward.

        `constraints`: (constraint, its Sequence) for every row that samples this step."""
        grammar = [(c, seq) for c, seq in constraints if c.matcher is not None]
        for c, _ in constraints:
            c.pending, c.mask_row = None, -1
        if not grammar:
            return
        words = (self.ll_tokenizer.vocab_size + 31) // 32
        step = _StepMasks(torch.zeros(len(grammar), words, dtype=torch.int32))
        for row, (c, seq) in enumerate(grammar):
            if c.matcher.num_consumed != seq.num_output_tokens:  # preempted, or drafts rolled back
                c.matcher.sync(seq.output_token_ids)
            c.mask_row, c.pending = row, step
        if self._pool is None:
            self._executor = llguidance.LLExecutor()
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="pagedserve-grammar")
        items = [(c.matcher.matcher, row) for row, (c, _) in enumerate(grammar)]
        step.future = self._pool.submit(self._executor.unsafe_compute_mask_ptr, items, step.bitmask.data_ptr(),
                                        words * 4, len(grammar))


def apply_constraints(logits: torch.Tensor, constraints: list[TokenConstraint | None]) -> torch.Tensor:
    """Bias, then mask, the rows that have constraints, in place, row by row (no copy of the batch). A row
    whose mask allows nothing keeps its grammar's EOS so that sampling never sees an all -inf row."""
    vocab = logits.shape[-1]
    for i, c in enumerate(constraints):
        if c is None:
            continue
        if c.bias_ids is not None:
            logits[i].index_add_(0, c.bias_ids.to(logits.device), c.bias_values.to(logits.device, logits.dtype))
        blocked, empty = None, False
        if c.pending is not None:
            blocked = c.pending.blocked(vocab)[c.mask_row]
            empty = not bool(c.pending.bitmask[c.mask_row].any())
        if c.blocked is not None:
            blocked = c.blocked if blocked is None else blocked | c.blocked
            empty = empty or bool(blocked.all())
        if blocked is None:
            continue
        if blocked.shape[0] < vocab:  # the model's vocab is wider than the tokenizer's
            blocked = torch.nn.functional.pad(blocked, (0, vocab - blocked.shape[0]), value=True)
        if empty:
            eos = c.matcher.eos_token_id if c.matcher is not None else None
            if eos is None or eos >= vocab:
                continue  # nothing to fall back to: leave the row unmasked rather than sample garbage
            blocked = torch.ones(vocab, dtype=torch.bool)
            blocked[eos] = False
        logits[i].masked_fill_(blocked.to(logits.device, non_blocking=True), float("-inf"))
    return logits
