"""The input processor without a model: the one place a request is checked and built into an EngineRequest."""

from __future__ import annotations

import dataclasses

import pytest

from pagedserve.engine.config import bundled_model_path
from pagedserve.engine.errors import ContextLengthExceededError, InvalidRequestError
from pagedserve.engine.input_processor import EngineRequest, InputProcessor
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.structured import StructuredSpec
from pagedserve.engine.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(bundled_model_path())


def proc(max_model_len: int = 16, **kwargs) -> InputProcessor:
    return InputProcessor(None, 100, max_model_len, **kwargs)


def test_a_request_is_built_once_and_frozen():
    r = proc().process("a", [1, 2, 3], SamplingParams(max_tokens=4), arrival_time=7.0)
    assert r == EngineRequest("a", [1, 2, 3], r.params, 4, None, 7.0) and r.priority == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.max_tokens = 5
    assert proc().process("b", [1, 2, 3], SamplingParams(max_tokens=None)).max_tokens == 13  # unasked: the room


@pytest.mark.parametrize("prompt, params, error, param", [
    ([], SamplingParams(), InvalidRequestError, "prompt"),
    ([1, 2, 3], SamplingParams(max_tokens=14), ContextLengthExceededError, "messages"),
    (list(range(16)), SamplingParams(max_tokens=None), ContextLengthExceededError, "messages"),  # no room
    ([1, 100], SamplingParams(max_tokens=2), InvalidRequestError, "prompt"),
    ([1, 2], SamplingParams(max_tokens=2, priority=1), InvalidRequestError, "priority"),
    ([1, 2], SamplingParams(max_tokens=2, allowed_token_ids=[100]), InvalidRequestError, "allowed_token_ids"),
    ([1, 2], SamplingParams(max_tokens=2, logit_bias={-1: 1.0}), InvalidRequestError, "logit_bias"),
    ("text", SamplingParams(max_tokens=2), InvalidRequestError, "prompt"),  # no tokenizer to encode it
])
def test_what_is_refused_and_the_field_it_names(prompt, params, error, param):
    with pytest.raises(error) as e:
        proc().process("r", prompt, params)
    assert e.value.param == param


def test_the_admission_bound_on_prompt_tokens_is_checked_with_the_rest():
    p = proc()
    assert p.process("r", [1, 2, 3], SamplingParams(max_tokens=2), max_prompt_tokens=3).max_tokens == 2
    with pytest.raises(InvalidRequestError, match="--max-queued-tokens"):
        p.process("r", [1, 2, 3], SamplingParams(max_tokens=2), max_prompt_tokens=2)


def test_priority_is_allowed_under_priority_scheduling():
    r = proc(scheduling_policy="priority").process("r", [1, 2], SamplingParams(max_tokens=2, priority=-1))
    assert r.priority == -1


def test_a_constraint_is_built_per_request_and_only_where_asked():
    p = proc()
    r = p.process("r", [1, 2], SamplingParams(max_tokens=2, allowed_token_ids=[3, 4], logit_bias={5: 2.0}))
    assert r.constraint is not None and r.constraint.blocked.tolist().count(False) == 2
    assert r.constraint.bias_ids.tolist() == [5] and r.constraint.matcher is None
    assert proc(build_constraints=False).process("r", [1, 2], r.params).constraint is None  # checked, not built


def test_a_grammar_is_compiled_into_the_request_and_a_bad_one_refused(tokenizer):
    p = InputProcessor(tokenizer, len(tokenizer), 64)
    params = SamplingParams(max_tokens=4, structured=StructuredSpec("regex", "[ab]+"))
    first, second = p.process("a", "Hi", params), p.process("b", "Hi", params)
    assert first.constraint.matcher is not None and first.constraint.matcher is not second.constraint.matcher
    assert first.prompt_token_ids == list(tokenizer.encode("Hi", add_special_tokens=True))
    bad = SamplingParams(max_tokens=4, structured=StructuredSpec("regex", "(", param="guided_regex"))
    with pytest.raises(InvalidRequestError) as e:
        p.process("c", "Hi", bad)
    assert e.value.param == "guided_regex"
    checked = InputProcessor(tokenizer, len(tokenizer), 64, build_constraints=False)
    with pytest.raises(InvalidRequestError):  # the ingress refuses it alike, without building a matcher
        checked.process("c", "Hi", SamplingParams(max_tokens=4, structured=StructuredSpec("regex", "(")))
    assert checked.process("d", "Hi", params).constraint is None
