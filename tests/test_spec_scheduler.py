"""Speculative decoding in the scheduler and block manager, no model: drafts are extra scheduled tokens,
rejected ones are rolled back and their blocks given back, and the prefix cache only sees verified tokens."""

import random

from conftest import EOS, drive
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.engine.block_manager import BlockManager
from pagedserve.engine.config import SchedulerConfig
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.scheduler import Scheduler
from pagedserve.engine.sequence import Sequence, SequenceStatus

VOCAB = 5


def truth(tokens: list[int]) -> int:
    """The fake target model: the next token is a function of the last two (so prefixes repeat)."""
    return (tokens[-1] * 3 + tokens[-2] + 1) % VOCAB if len(tokens) > 1 else 1


def make(num_blocks=64, block_size=4, budget=64, max_num_seqs=8, prefix=True):
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget),
                     BlockManager(num_blocks, block_size, prefix))


def fake_verify(seq: Sequence) -> list[int]:
    """Greedy verification against `truth`: accept drafts while they match, then the target's own token."""
    out, ctx = [], list(seq.token_ids)
    for d in seq.spec_token_ids:
        t = truth(ctx)
        if d != t:
            break
        out.append(d)
        ctx.append(d)
    return out + [truth(ctx)]


def spec_step(s: Scheduler, propose, check_published=True):
    for q in s.running:
        q.spec_token_ids = propose(q) if q.num_tokens - q.num_computed_tokens == 1 else []
    out = s.schedule()
    for q, n in zip(out.seqs, out.num_new_tokens):  # drafts only ride along with a sampled token
        assert q.num_computed_tokens + n <= q.num_tokens + len(q.spec_token_ids)
        assert not q.spec_token_ids or q.num_computed_tokens + n == q.num_tokens + len(q.spec_token_ids)
    sampled = [fake_verify(q) if want else None for q, want in zip(out.seqs, out.sample)]
    for q, t in zip(out.seqs, sampled):
        if t is not None and hasattr(s, "accepted"):
            s.accepted += len(t) - 1
            s.rejected += len(q.spec_token_ids) - (len(t) - 1)
    s.update(out, sampled)
    bm = s.block_manager
    live = s.running + list(s.waiting)
    bm.check_integrity(live)
    for q in live:
        assert q.num_computed_tokens <= q.num_tokens
        assert len(q.block_table) <= -(-q.num_tokens // bm.block_size)  # rejected slots given back
        for i, h in enumerate(q.block_digests[:q.num_published_blocks]):  # published: exactly the verified tokens
            b = bm.blocks[q.block_table[i]]
            if b.hash == h:
                assert b.token_ids == tuple(q.token_ids[i * bm.block_size:(i + 1) * bm.block_size])
    return out


def test_accepted_drafts_advance_and_rejected_ones_roll_back():
    s = make(block_size=4)
    q = Sequence(0, "a", [1, 2, 3], SamplingParams(max_tokens=20), 20, frozenset())
    s.add(q)
    spec_step(s, lambda q: [])  # prefill
    assert q.num_tokens == 4 and q.num_computed_tokens == 3
    # three right drafts: 4 tokens in one step, all computed but the last
    ctx, right = list(q.token_ids), []
    for _ in range(3):
        right.append(truth(ctx))
        ctx.append(right[-1])
    out = spec_step(s, lambda q: list(right))
    assert out.num_new_tokens == [4] and q.num_tokens == 8 and q.num_computed_tokens == 7
    # five drafts, the first wrong: one token, computed count moves by exactly one, spare blocks given back
    wrong = (truth(q.token_ids) + 1) % VOCAB or 1
    out = spec_step(s, lambda q: [wrong] * 5)
    assert out.num_new_tokens == [6] and q.num_tokens == 9 and q.num_computed_tokens == 8
    assert len(q.block_table) == 3
    ref = [1, 2, 3]
    while len(ref) < q.num_tokens:
        ref.append(truth(ref))
    assert q.token_ids == ref


def test_drafts_never_exceed_the_budget_nor_cause_preemption():
    s = make(num_blocks=3, block_size=4, budget=5)
    q = Sequence(0, "a", [1, 2, 3, 4, 1, 2, 3], SamplingParams(max_tokens=5), 5, frozenset({EOS}))
    s.add(q)
    spec_step(s, lambda q: [])
    out = spec_step(s, lambda q: [1] * 8)  # budget 5 -> 1 + 4 drafts at most
    assert out.num_new_tokens[0] <= 5
    other = Sequence(1, "b", [2, 2, 2, 2], SamplingParams(max_tokens=3), 3, frozenset({EOS}))
    s.add(other)
    while s.has_unfinished():
        out = spec_step(s, lambda q: [1] * 8)  # 12 slots: drafts get dropped, nobody is preempted for them
    assert s.stats.num_preemptions == 0
    assert s.block_manager.num_used_blocks == 0


def test_eos_among_accepted_drafts_ends_there():
    s = make()
    prompt = [2, 2]
    ctx = list(prompt)
    for _ in range(3):
        ctx.append(truth(ctx))
    stop = ctx[3]  # the second generated token ends the request: drafts after it are dropped
    q = Sequence(0, "a", prompt, SamplingParams(max_tokens=20), 20, frozenset({stop}))
    s.add(q)
    spec_step(s, lambda q: [])
    spec_step(s, lambda q: ctx[3:] + [truth(ctx)] * 3)
    assert q.status is SequenceStatus.FINISHED_STOPPED and q.output_token_ids == ctx[2:4]
    assert s.block_manager.num_used_blocks == 0


@settings(max_examples=80, deadline=None)
@given(
    ops=st.lists(st.tuples(st.sampled_from(["add", "step", "step", "step", "abort"]),
                           st.integers(2, 40), st.integers(1, 30), st.integers(0, 10**6)),
                 min_size=1, max_size=60),
    num_blocks=st.integers(12, 40),
    block_size=st.sampled_from([1, 2, 4, 8]),
    budget=st.integers(4, 48),
    max_num_seqs=st.integers(1, 6),
    prefix=st.booleans(),
    p_right=st.floats(0.0, 1.0),
    max_gamma=st.integers(1, 8),
)
def test_random_interleavings_with_drafts(ops, num_blocks, block_size, budget, max_num_seqs, prefix, p_right,
                                          max_gamma):
    run_interleaving(ops, num_blocks, block_size, budget, max_num_seqs, prefix, p_right, max_gamma)


def test_long_random_runs_accept_and_reject_drafts():
    rng = random.Random(1)
    totals = {"accepted": 0, "rejected": 0, "preemptions": 0}
    for _ in range(12):
        ops = [(rng.choice(["add", "add", "step", "step", "step", "abort"]), rng.randint(2, 40), rng.randint(5, 40),
                rng.randrange(10**6)) for _ in range(80)]
        s = run_interleaving(ops, rng.randint(12, 40), rng.choice([2, 4, 8]), rng.randint(8, 48), rng.randint(2, 6),
                             rng.random() < 0.7, rng.uniform(0.3, 0.95), rng.randint(1, 8))
        totals["accepted"] += s.accepted
        totals["rejected"] += s.rejected
        totals["preemptions"] += s.stats.num_preemptions
    assert min(totals.values()) > 10, totals


def run_interleaving(ops, num_blocks, block_size, budget, max_num_seqs, prefix, p_right, max_gamma) -> Scheduler:
    s = make(num_blocks, block_size, budget, max_num_seqs, prefix)
    s.accepted = s.rejected = 0
    rng = random.Random(0)

    def propose(q):  # a mix of right and wrong guesses, of random length (0 = not speculating)
        ctx, out = list(q.token_ids), []
        for _ in range(rng.randint(0, max_gamma)):
            t = truth(ctx) if rng.random() < p_right else rng.randrange(VOCAB)
            out.append(t)
            ctx.append(t)
        return out

    seqs, aborted = drive(s, ops, lambda: spec_step(s, propose), min_prompt=2)
    for q in seqs:
        if q.seq_id not in aborted:
            ref = list(q.prompt_token_ids)  # the output is exactly the target's, whatever was drafted
            while len(ref) < q.num_tokens:
                ref.append(truth(ref))
            assert q.token_ids == ref
    return s
