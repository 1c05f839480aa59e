"""Incremental detokenization, stop strings, and the sampler, without running the model."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.engine.errors import InvalidRequestError
from pagedserve.engine.sampler import Sampler, SampleRequest, top_k_top_p
from pagedserve.engine.sampling_params import MAX_STOP_STRING_CHARS, SamplingParams
from pagedserve.engine.tokenizer import IncrementalDetokenizer, StopStringMatcher


def test_incremental_detokenizer_equals_full_decode(smollm):
    tok = smollm.tokenizer
    text = "Héllo wörld! 日本語のテキスト 🙂🙂 and `code` — done.\n  Indented line."
    ids = tok.encode(text)
    prompt = tok.encode("Prompt:")
    detok = IncrementalDetokenizer(tok, prompt)
    pieces = [detok.push([t]) for t in ids]
    assert "".join(pieces) == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)  # no broken UTF-8 character is ever emitted
    assert any(p == "" for p in pieces)  # multi-token characters were held back


def test_stop_string_across_chunks_is_never_sent():
    m = StopStringMatcher(["STOP"])
    sent = []
    for delta in ["Hello S", "TO", "P and more"]:
        m.feed(delta)
        sent.append(m.take(final=False))
    assert m.stopped and "".join(sent) == "Hello " and m.matched == "STOP"
    assert m.take(final=True) == ""


def test_partial_stop_prefix_is_released_when_it_does_not_complete():
    m = StopStringMatcher(["STOP"])
    m.feed("a ST")
    assert m.take(final=False) == "a "  # "ST" might become STOP: held back
    m.feed("ART")
    assert m.take(final=False) == "START"  # it did not: released at once
    m.feed(" no stop here")
    assert m.take(final=False) == " no stop here"
    assert m.take(final=True) == ""


def test_earliest_stop_wins():
    m = StopStringMatcher(["world", "lo w"])
    m.feed("hello world")
    assert m.stopped and m.take(final=True) == "hel" and m.matched == "lo w"  # what Messages' stop_sequence says
    unstopped = StopStringMatcher(["STOP"])
    unstopped.feed("no stop")
    assert not unstopped.stopped and unstopped.matched is None


def _req(**kw):
    return SampleRequest(SamplingParams(**kw), [], None)


def test_greedy_and_temperature_zero():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 1.0, 0.0]])
    tokens, _ = Sampler()(logits, [_req(temperature=0), _req(temperature=0)])
    assert tokens == [1, 0]


def test_top_k_top_p_masks():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(top_k_top_p(logits, [2], [1.0])[0, 2:]).all()
    kept = ~torch.isinf(top_k_top_p(logits, [0], [0.75])[0])
    assert kept.tolist() == [True, True, False, False]  # 0.5 + 0.3 covers 0.75
    kept = ~torch.isinf(top_k_top_p(logits, [0], [0.1])[0])
    assert kept.tolist() == [True, False, False, False]  # always at least one
    for tiny in (1e-46, 5e-324):  # below float32's smallest value: 0 on the device, and still the top token
        kept = ~torch.isinf(top_k_top_p(logits[:, [2, 0, 3, 1]], [0], [tiny])[0])
        assert kept.tolist() == [False, True, False, False]


def test_sampling_follows_the_distribution_and_seeds_repeat():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().repeat(4000, 1)
    sampler = Sampler(seed=0)
    tokens, _ = sampler(logits, [_req(temperature=1.0) for _ in range(4000)])
    freq = torch.bincount(torch.tensor(tokens), minlength=3).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)

    def seeded(seed):
        req = SampleRequest(SamplingParams(temperature=1.0, seed=seed), [], torch.Generator().manual_seed(seed))
        return [Sampler()(probs.log()[None], [req])[0][0] for _ in range(20)]

    assert seeded(5) == seeded(5) and seeded(5) != seeded(6)


def test_penalties_and_logprobs():
    logits = torch.tensor([[2.0, 1.9, 0.0]])
    req = SampleRequest(SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.1, logprobs=2),
                        [0, 0], None)
    tokens, lps = Sampler()(logits, [req])
    assert tokens == [1]  # 2.0 - 0.5 - 0.2 < 1.9
    assert lps[0].token_id == 1 and len(lps[0].top) == 2
    assert abs(sum(torch.tensor([v for _, v in lps[0].top]).exp().tolist()) - 1) < 0.2


def _reference_stop(stops: list[str], deltas: list[str]) -> tuple[str, bool]:
    """Brute force: the text up to the stop string that completes first (longest if several end together)."""
    text = ""
    for d in deltas:
        for ch in d:
            text += ch
            ends = [s for s in stops if text.endswith(s)]
            if ends:
                return text[:len(text) - max(map(len, ends))], True
    return text, False


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text("abc", min_size=1, max_size=5), min_size=1, max_size=4),
       st.lists(st.text("abcd", max_size=6), max_size=12))
def test_stop_automaton_matches_brute_force(stops, deltas):
    m = StopStringMatcher(stops)
    sent = ""
    longest = max(map(len, stops))
    for d in deltas:
        m.feed(d)
        sent += m.take(final=False)
        if not m.stopped:  # held back: only a tail that may still become a stop string
            assert len(m.held) < longest and any(s.startswith(m.held) for s in stops) or not m.held
    sent += m.take(final=True)
    assert (sent, m.stopped) == _reference_stop(stops, deltas)


def test_stop_matcher_state_stays_bounded():
    """Long output against long stop strings: the matcher keeps no more than the longest stop string's tail
    and one automaton node per stop-string character (per-token time: benchmarks/stop_strings.py)."""
    stops = ["x" * 255 + "y", "z" * 256, "ab" * 128, "q" * 200 + "!"]
    m = StopStringMatcher(stops)
    sent = 0
    for _ in range(30_000 // 5):
        m.feed("x" * 4 + " ")
        sent += len(m.take(final=False))
        assert len(m.held) <= 255
    assert not m.stopped and sent == 30_000
    assert len(m._next) <= sum(map(len, stops)) + 1
    m.feed("x" * 255 + "y")
    assert m.stopped and m.take(final=True) == ""


def test_stop_string_limits():
    with pytest.raises(InvalidRequestError):
        SamplingParams(stop=["x" * (MAX_STOP_STRING_CHARS + 1)])
    assert SamplingParams(stop=["x" * MAX_STOP_STRING_CHARS]).stop
