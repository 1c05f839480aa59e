"""The output processor without a model: text deltas, stop strings across tokens and accepted drafts, logprobs
held with their text, prompt logprobs once, finish reasons, and what an abort releases. Tokens arrive as the
scheduler appends them (`append_until_stop`: each read by `observe`, then judged by `check_stop`); the processor
itself only reads the sequence."""

from __future__ import annotations

from pagedserve.engine.output_processor import OutputProcessor, RequestState
from pagedserve.engine.sampler import SampleRequest, TokenLogprob
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.scheduler import append_until_stop
from pagedserve.engine.sequence import Sequence, SequenceStatus, StopMatch
from pagedserve.engine.tokenizer import IncrementalDetokenizer, StopStringMatcher

PIECES = {1: "He", 2: "llo", 3: " wo", 4: "rld", 5: "!", 6: " S", 7: "TO", 8: "P", 9: " more"}


class Tokenizer:
    """Token id -> a fixed piece of text; enough for the incremental detokenizer."""

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(PIECES.get(i, "") for i in ids)


class Run:
    """One request through an OutputProcessor, its tokens appended as the scheduler's `update` does; `finished`
    records the finishes the stop check decided (the scheduler's `finish` sets the status)."""

    def __init__(self, max_tokens=10, stop=(), logprobs=None, prompt_logprobs=None, eos=frozenset()):
        params = SamplingParams(max_tokens=max_tokens, stop=list(stop), logprobs=logprobs,
                                prompt_logprobs=prompt_logprobs)
        self.seq = Sequence(0, "r", [1], params, max_tokens, eos)
        self.seq.status = SequenceStatus.RUNNING
        self.finished: list[SequenceStatus] = []
        self.matches: list[StopMatch | None] = []
        self.proc = OutputProcessor()
        self.req = RequestState(self.seq, IncrementalDetokenizer(Tokenizer(), [1]), StopStringMatcher(list(stop)),
                                SampleRequest(params, [], None))
        if prompt_logprobs is not None:
            self.req.prompt_logprobs = [None]

    def tokens(self, *ids, logprob=None):
        before = self.seq.num_tokens

        def observe(seq, token):
            self.matches.append(self.proc.observe(self.req, token, logprob))
            return self.matches[-1]

        status = append_until_stop(self.seq, list(ids), observe)
        if status is not None:
            self.seq.status = status
            self.finished.append(status)
        state = (list(self.seq.token_ids), self.seq.status)
        out = self.proc.process(self.req, before)
        assert (list(self.seq.token_ids), self.seq.status) == state  # the processor only reads the sequence
        return out


def lp(token: int) -> TokenLogprob:
    return TokenLogprob(token, -0.5, [(token, -0.5)])


def test_text_deltas_and_length_finish():
    run = Run(max_tokens=3)
    outs = [run.tokens(2), run.tokens(3), run.tokens(4)]
    assert [o.text for o in outs] == ["llo", " wo", "rld"]
    assert [o.finished for o in outs] == [False, False, True] and outs[-1].finish_reason == "length"
    assert outs[-1].num_output_tokens == 3 and run.finished == [SequenceStatus.FINISHED_LENGTH]


def test_stop_string_across_tokens_is_never_sent_and_finishes():
    run = Run(stop=["STOP"])
    texts = [run.tokens(2).text, run.tokens(6).text, run.tokens(7).text]
    assert texts == ["llo", " ", ""]  # "S", then "STO", may be the start of the stop string: held back
    out = run.tokens(8)
    assert out.finished and out.finish_reason == "stop" and out.text == ""
    assert run.finished == [SequenceStatus.FINISHED_STOPPED] and run.matches == [None] * 3 + [StopMatch.STOP_STRING]


def test_accepted_drafts_after_a_stop_string_never_happened():
    run = Run(stop=["STOP"])
    out = run.tokens(6, 7, 8, 9, 5)  # a verification step accepted five tokens; the stop ends at the third
    assert out.new_token_ids == [6, 7, 8] and run.seq.token_ids == [1, 6, 7, 8]
    assert out.text == " " and out.finish_reason == "stop"
    assert len(run.matches) == 3  # the drafts after it were never appended, nor read


def test_logprobs_go_out_with_their_text_and_die_with_a_stop_string():
    run = Run(stop=["STOP"], logprobs=1)
    outs = [run.tokens(t, logprob=lp(t)) for t in (2, 6, 7)]
    # " S" begins to be sent (its " "), "TO" is held back: so is its logprob
    assert [[x.token_id for x in o.logprobs] for o in outs] == [[2], [6], []]
    last = run.tokens(8, logprob=lp(8))
    assert last.finished and last.logprobs == []  # "TO" and "P" were the stop string: their logprobs go too


def test_abort_releases_held_text_and_logprobs():
    run = Run(stop=["STOP"], logprobs=1)
    assert run.tokens(6, logprob=lp(6)).text == " " and run.tokens(7, logprob=lp(7)).logprobs == []
    run.seq.status = SequenceStatus.FINISHED_ABORTED
    out = run.proc.final(run.req)
    assert out.finished and out.finish_reason == "abort" and out.text == "STO"
    assert [x.token_id for x in out.logprobs] == [7]


def test_prompt_logprobs_go_out_once_with_the_first_output():
    run = Run(prompt_logprobs=1)
    run.req.add_prompt_logprobs(0, [])
    first, second = run.tokens(2), run.tokens(3)
    assert first.prompt_logprobs == [None] and second.prompt_logprobs is None


def test_a_stop_string_on_the_last_allowed_token_is_a_stop_not_a_length():
    run = Run(max_tokens=3, stop=["STOP"])
    outs = [run.tokens(6), run.tokens(7), run.tokens(8)]
    assert outs[-1].finished and outs[-1].finish_reason == "stop" and outs[-1].text == ""
    assert "".join(o.text for o in outs) == " "


def test_eos_ends_the_request_and_releases_held_text():
    run = Run(stop=["STOP"], eos=frozenset({0}))
    assert run.tokens(6).text == " "  # "S" may begin the stop string: held back
    out = run.tokens(0, 9)  # EOS, then a draft after it that never happened
    assert out.finished and out.finish_reason == "stop" and out.new_token_ids == [0] and out.text == "S"
    assert run.seq.token_ids == [1, 6, 0]


def test_held_logprobs_go_out_when_the_request_ends_without_a_stop_string():
    run = Run(max_tokens=2, stop=["STOP"], logprobs=1)
    assert run.tokens(6, logprob=lp(6)).logprobs == [lp(6)]  # its " " was sent
    last = run.tokens(7, logprob=lp(7))  # "STO" is held back, then released at the length limit
    assert last.finish_reason == "length" and last.text == "STO" and last.logprobs == [lp(7)]
