"""The output processor without a model: text deltas, stop strings across tokens and accepted drafts, logprobs
held with their text, prompt logprobs once, finish reasons, and what an abort releases."""

from __future__ import annotations

from pagedserve.engine.output_processor import OutputProcessor, RequestState
from pagedserve.engine.sampler import SampleRequest, TokenLogprob
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.sequence import Sequence, SequenceStatus
from pagedserve.engine.tokenizer import IncrementalDetokenizer, StopStringMatcher

PIECES = {1: "He", 2: "llo", 3: " wo", 4: "rld", 5: "!", 6: " S", 7: "TO", 8: "P", 9: " more"}


class Tokenizer:
    """Token id -> a fixed piece of text; enough for the incremental detokenizer."""

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(PIECES.get(i, "") for i in ids)


class Run:
    """One request through an OutputProcessor; `finished` records what the processor asked the scheduler."""

    def __init__(self, max_tokens=10, stop=(), logprobs=None, prompt_logprobs=None):
        params = SamplingParams(max_tokens=max_tokens, stop=list(stop), logprobs=logprobs,
                                prompt_logprobs=prompt_logprobs)
        self.seq = Sequence(0, "r", [1], params, max_tokens)
        self.seq.status = SequenceStatus.RUNNING
        self.finished: list[SequenceStatus] = []
        self.proc = OutputProcessor(self.finish)
        self.req = RequestState(self.seq, IncrementalDetokenizer(Tokenizer(), [1]), StopStringMatcher(list(stop)),
                                SampleRequest(params, [], None))
        if prompt_logprobs is not None:
            self.req.prompt_logprobs = [None]

    def finish(self, seq, status):
        seq.status = status
        self.finished.append(status)

    def tokens(self, *ids, logprob=None):
        before = self.seq.num_tokens
        for t in ids:
            self.seq.append_token(t)
        if self.seq.num_output_tokens >= self.seq.max_tokens and not self.seq.is_finished:
            self.seq.status = SequenceStatus.FINISHED_LENGTH  # what the scheduler's update does at max_tokens
        return self.proc.process(self.req, logprob, before)


def lp(token: int) -> TokenLogprob:
    return TokenLogprob(token, -0.5, [(token, -0.5)])


def test_text_deltas_and_length_finish():
    run = Run(max_tokens=3)
    outs = [run.tokens(2), run.tokens(3), run.tokens(4)]
    assert [o.text for o in outs] == ["llo", " wo", "rld"]
    assert [o.finished for o in outs] == [False, False, True] and outs[-1].finish_reason == "length"
    assert outs[-1].num_output_tokens == 3 and run.finished == []


def test_stop_string_across_tokens_is_never_sent_and_finishes():
    run = Run(stop=["STOP"])
    texts = [run.tokens(2).text, run.tokens(6).text, run.tokens(7).text]
    assert texts == ["llo", " ", ""]  # "S", then "STO", may be the start of the stop string: held back
    out = run.tokens(8)
    assert out.finished and out.finish_reason == "stop" and out.text == ""
    assert run.finished == [SequenceStatus.FINISHED_STOPPED]


def test_accepted_drafts_after_a_stop_string_never_happened():
    run = Run(stop=["STOP"])
    out = run.tokens(6, 7, 8, 9, 5)  # a verification step accepted five tokens; the stop ends at the third
    assert out.new_token_ids == [6, 7, 8] and run.seq.token_ids == [1, 6, 7, 8]
    assert out.text == " " and out.finish_reason == "stop"


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
