"""SamplingParams' validation on construction: each bound refused with the parameter it names, each edge accepted,
and the normalisations (a stop string becomes a list, logit_bias keys become ints, greedy below the floor)."""

from __future__ import annotations

import pytest

from pagedserve.engine.errors import InvalidRequestError
from pagedserve.engine.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, SamplingParams


@pytest.mark.parametrize("kwargs, param", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-1, prompt_logprobs=0), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=2.01), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.01), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(seed=1.5), "seed"),
    (dict(seed=2**64), "seed"),
    (dict(seed=-2**63 - 1), "seed"),
    (dict(priority=1.0), "priority"),
    (dict(priority=True), "priority"),
    (dict(cache_salt=5), "cache_salt"),
    (dict(stop=["a"] * (MAX_STOP_STRINGS + 1)), "stop"),
    (dict(stop=["a", ""]), "stop"),
    (dict(stop=["x" * (MAX_STOP_STRING_CHARS + 1)]), "stop"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-2.5), "frequency_penalty"),
    (dict(logprobs=21), "logprobs"),
    (dict(logprobs=-1), "logprobs"),
    (dict(prompt_logprobs=21), "prompt_logprobs"),
    (dict(logit_bias={5: 100.5}), "logit_bias"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
])
def test_out_of_bounds_is_refused_naming_the_parameter(kwargs, param):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param


@pytest.mark.parametrize("kwargs", [
    dict(max_tokens=1), dict(max_tokens=None), dict(max_tokens=0, prompt_logprobs=0),
    dict(temperature=0.0), dict(temperature=2.0), dict(top_p=1.0), dict(top_p=1e-9), dict(top_k=-1), dict(top_k=0),
    dict(seed=-2**63), dict(seed=2**64 - 1), dict(priority=-5),
    dict(stop=["a"] * MAX_STOP_STRINGS), dict(stop=["x" * MAX_STOP_STRING_CHARS]),
    dict(presence_penalty=-2.0, frequency_penalty=2.0), dict(logprobs=0), dict(logprobs=20), dict(prompt_logprobs=20),
    dict(logit_bias={1: -100.0, 2: 100.0}), dict(allowed_token_ids=[3]),
])
def test_the_edges_are_accepted(kwargs):
    SamplingParams(**kwargs)


def test_normalisations():
    p = SamplingParams(stop="\n\n", stop_token_ids=None, logit_bias={"7": 1})
    assert p.stop == ["\n\n"] and p.stop_token_ids == []
    assert p.logit_bias == {7: 1.0} and isinstance(next(iter(p.logit_bias)), int)
    assert SamplingParams(stop=None).stop == []


def test_greedy_below_the_temperature_floor_and_penalties_only_when_set():
    assert SamplingParams(temperature=0).greedy and SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=1e-4).greedy
    assert not SamplingParams().needs_penalties
    assert SamplingParams(presence_penalty=0.5).needs_penalties and SamplingParams(frequency_penalty=-1).needs_penalties
