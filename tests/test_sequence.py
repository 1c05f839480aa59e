"""Sequence's counters (engine/sequence.py): prompt, output and total token counts as tokens are appended, the first
token's stamp, and which statuses are finished. The stop check is the output path's, tested there."""

from __future__ import annotations

from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.sequence import Sequence, SequenceStatus


def make(prompt=(5, 6, 7)) -> Sequence:
    return Sequence(0, "r0", list(prompt), SamplingParams(max_tokens=8), 8)


def test_counts_follow_appended_tokens():
    s = make()
    assert (s.num_prompt_tokens, s.num_tokens, s.num_output_tokens, s.output_token_ids) == (3, 3, 0, [])
    s.append_token(9)
    s.append_token(10)
    assert (s.num_prompt_tokens, s.num_tokens, s.num_output_tokens, s.output_token_ids) == (3, 5, 2, [9, 10])
    assert s.token_ids == [5, 6, 7, 9, 10]


def test_the_prompt_is_copied_not_shared():
    prompt = [1, 2]
    s = make(prompt)
    s.append_token(3)
    assert prompt == [1, 2] and s.prompt_token_ids == [1, 2]


def test_the_first_token_is_stamped_once():
    s = make()
    assert s.first_token_time is None
    s.append_token(1)
    first = s.first_token_time
    assert first is not None and first >= s.arrival_time
    s.append_token(2)
    assert s.first_token_time == first


def test_finished_statuses():
    s = make()
    unfinished = {SequenceStatus.WAITING, SequenceStatus.RUNNING}
    for status in SequenceStatus:
        s.status = status
        assert s.is_finished == (status not in unfinished)


def test_prefix_cache_fields_start_empty_and_apart():
    a, b = make(), make()
    assert a.block_table == a.block_digests == [] and a.num_published_blocks == 0
    a.block_digests.append(b"d")
    a.block_table.append(3)
    assert b.block_digests == [] and b.block_table == []  # each sequence its own lists
