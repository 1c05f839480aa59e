"""A request's input side: prompt -> token ids, every check a request must pass, and the `EngineRequest` built
from it, once (vLLM v1's `InputProcessor` building its `EngineCoreRequest`).

`InputProcessor.process` is where a request is validated: the engine (`LLMEngine.add`) and the async engine trust
what it returns. It needs the tokenizer and the context length, never the weights: the engine owns one, and so
does a front end that only tokenizes and routes (the Ray ingress, server/ray_app.py), so both refuse exactly the
same requests. It runs in any thread; servers call it off their event loop, since tokenizing costs O(prompt) and
a grammar's first compile is slow.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from .errors import ContextLengthExceededError, InvalidRequestError
from .sampling_params import SamplingParams
from .structured import StructuredOutputs, TokenConstraint
from .tokenizer import apply_chat_template


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """A request built and checked by `InputProcessor.process`, carrying every decision later stages need."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved against the context length
    # the compiled grammar, allowed ids and logit bias (None: unconstrained), built with the request so that
    # compiling happens in the thread that builds it, never on an event loop; its matcher is this request's own
    constraint: TokenConstraint | None = None
    arrival_time: float | None = None  # time.monotonic(); None: when the engine queues it

    @property
    def priority(self) -> int:
        return self.params.priority


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int,
                 structured: StructuredOutputs | None = None, scheduling_policy: str = "fcfs",
                 build_constraints: bool = True) -> None:
        """`build_constraints=False` where requests are only checked and passed on (the Ray ingress): a grammar
        is still compiled to check it, and the replica that runs the request builds its own matcher."""
        self.tokenizer = tokenizer
        self.scheduling_policy = scheduling_policy
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.structured = structured or StructuredOutputs(tokenizer, vocab_size)
        self.build_constraints = build_constraints
        self._lock = threading.Lock()  # HF fast tokenizers mutate state on encode ("Already borrowed")
        # No token is longer than this many characters, so a longer text cannot fit the context: it is
        # refused without tokenizing it (a normalizer may merge characters, hence the slack).
        self._max_token_chars = 0
        if tokenizer is not None:
            self._max_token_chars = max((len(t) for t in tokenizer.get_vocab()), default=1)
            backend = getattr(tokenizer, "backend_tokenizer", None)
            if backend is None or backend.normalizer is not None:
                self._max_token_chars *= 4

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt. Any thread; O(prompt size), so servers call it off their event loop."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer: pass token ids", "prompt")
            self.check_prompt_chars(len(prompt), "prompt")
            with self._lock:
                return list(self.tokenizer.encode(prompt, add_special_tokens=True)) if prompt else []
        if not isinstance(prompt, (list, tuple)):
            raise InvalidRequestError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}",
                                      "prompt")
        return list(prompt)

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    continue_final: bool = False) -> list[int]:
        """Chat messages (and tools, for templates that take them) -> prompt token ids. Any thread.
        `continue_final`: the last message is an assistant reply to continue."""
        with self._lock:
            return apply_chat_template(self.tokenizer, messages, tools=tools, continue_final=continue_final)

    def check_prompt_chars(self, num_chars: int, param: str = "prompt") -> None:
        """Refuse a text that cannot fit the context whatever its tokens, before paying to tokenize it."""
        limit = self.max_model_len * self._max_token_chars
        if self._max_token_chars and num_chars > limit:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens, and the prompt has "
                f"{num_chars} characters: more than {limit} cannot fit. Please reduce the prompt.", param,
                "context_length_exceeded")

    def process(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None, *,
                arrival_time: float | None = None, max_prompt_tokens: int | None = None) -> EngineRequest:
        """Tokenize (a string), check and build a request the engine trusts. `max_prompt_tokens`: the most prompt
        tokens a server lets wait at once (a longer prompt could never be admitted: 400, not 429). Raises
        InvalidRequestError (ContextLengthExceededError for a prompt and max_tokens over the context)."""
        params = params or SamplingParams()
        ids = self.tokenize(prompt)
        if params.priority != 0 and self.scheduling_policy != "priority":  # as vLLM: not silently ignored
            raise InvalidRequestError(f"priority {params.priority} needs priority scheduling, which is not enabled "
                                      "(--scheduling-policy priority)", "priority")
        n = len(ids)
        if n == 0:
            raise InvalidRequestError("the prompt is empty", "prompt")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n
        if n + max_tokens > self.max_model_len or (max_tokens < 1 and params.max_tokens is None):  # before O(n)
            raise ContextLengthExceededError(n, max(max_tokens, 1), self.max_model_len)
        vocab = self.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})", "prompt")
        if max_prompt_tokens is not None and n > max_prompt_tokens:
            raise InvalidRequestError(f"the prompt has {n} tokens, more than the {max_prompt_tokens} allowed to "
                                      "wait (--max-queued-tokens)", "prompt")
        constraint = None
        if self.build_constraints:
            constraint = self.structured.constraint_for(params)  # checks what it compiles
        else:
            self.structured.check(params)
        return EngineRequest(request_id, ids, params, max_tokens, constraint, arrival_time)
