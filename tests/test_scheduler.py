"""Scheduler + block manager driven with fake model outputs (no model)."""

import random

from conftest import EOS, drive
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.engine.block_manager import BlockManager
from pagedserve.engine.config import SchedulerConfig
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.scheduler import (
    DEFAULT_PREFILL_MS_PER_TOKEN,
    Scheduler,
    admission_key,
    check_stop,
    priority_admission_key,
)
from pagedserve.engine.sequence import Sequence, SequenceStatus, StopMatch


def make(num_blocks=64, block_size=4, max_num_seqs=8, budget=64, policy="continuous", prefix=True,
         scheduling_policy="fcfs"):
    bm = BlockManager(num_blocks, block_size, prefix)
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, policy=policy,
                                     scheduling_policy=scheduling_policy), bm)


def seq(sid, prompt_len, max_tokens, base=1, priority=0):
    ids = [base + (sid * 7 + i) % 50 for i in range(prompt_len)]
    return Sequence(sid, f"r{sid}", ids, SamplingParams(max_tokens=max_tokens, priority=priority), max_tokens,
                    frozenset({EOS}))


def step(s: Scheduler, token=lambda seq: 1):
    out = s.schedule()
    s.update(out, [token(q) if want else None for q, want in zip(out.seqs, out.sample)])
    s.block_manager.check_integrity(s.running + list(s.waiting))
    return out


def test_decode_and_prefill_share_a_step_and_budget_chunks_prompts():
    s = make(budget=10)
    a = seq(0, 6, 4)
    s.add(a)
    out = step(s)
    assert out.num_new_tokens == [6] and out.sample == [True]
    b = seq(1, 25, 4)
    s.add(b)
    out = step(s)  # a decodes 1 token, b gets the remaining 9 of the budget
    assert [q.seq_id for q in out.seqs] == [0, 1] and out.num_new_tokens == [1, 9]
    assert out.sample == [True, False]
    out = step(s)
    assert out.num_new_tokens == [1, 9]
    out = step(s)
    assert out.num_new_tokens == [1, 7] and out.sample == [True, True]  # b's prompt done: first token
    assert b.num_output_tokens == 1 and a.num_output_tokens == 4 and a.status is SequenceStatus.FINISHED_LENGTH


def test_max_num_seqs_and_fcfs():
    s = make(max_num_seqs=2)
    seqs = [seq(i, 4, 3) for i in range(4)]
    for q in seqs:
        s.add(q)
    out = step(s)
    assert [q.seq_id for q in out.seqs] == [0, 1]
    while s.has_unfinished():
        step(s)
    order = sorted(seqs, key=lambda q: q.first_scheduled_time)
    assert [q.seq_id for q in order] == [0, 1, 2, 3]


def test_eos_finishes_and_frees():
    s = make()
    a = seq(0, 5, 10)
    s.add(a)
    step(s, token=lambda q: EOS)
    assert a.status is SequenceStatus.FINISHED_STOPPED and a.output_token_ids == [EOS]
    assert s.block_manager.num_used_blocks == 0 and not s.has_unfinished()


def test_preempts_newest_and_recomputes():
    # 6 blocks of 4 tokens: two sequences of 8-token prompts fit (4 blocks), growing they collide
    s = make(num_blocks=6, block_size=4, budget=64)
    a, b = seq(0, 8, 12), seq(1, 8, 12, base=60)
    s.add(a)
    s.add(b)
    step(s)
    assert a.block_table and b.block_table
    preempted = 0
    while s.has_unfinished():
        out = step(s)
        preempted += out.num_preempted
        assert a.status is not SequenceStatus.WAITING  # the older one is never the victim
    assert preempted >= 1 and b.num_preemptions >= 1 and a.num_preemptions == 0
    assert a.num_output_tokens == 12 and b.num_output_tokens == 12
    assert s.block_manager.num_used_blocks == 0


def test_no_admission_in_a_step_that_preempted():
    s = make(num_blocks=4, block_size=4, budget=64)
    a, b = seq(0, 7, 8), seq(1, 7, 8, base=60)
    s.add(a)
    s.add(b)
    step(s)  # both prefilled: 2 blocks each, pool full
    c = seq(2, 2, 2, base=90)
    s.add(c)
    out = step(s)  # position 7 still fits in the 2nd block; c finds no free block and waits
    assert out.num_preempted == 0 and c.status is SequenceStatus.WAITING
    out = step(s)  # a needs a 3rd block: b is preempted, and c must not sneak in
    assert out.num_preempted == 1 and c.status is SequenceStatus.WAITING
    assert list(s.waiting)[:2] == [b, c]  # b goes back in front of c


def timed_seq(sid, prompt_len, max_tokens, arrival):
    q = seq(sid, prompt_len, max_tokens)
    q.arrival_time = arrival
    return q


def test_a_burst_is_admitted_shortest_prompt_first():
    s = make(max_num_seqs=1, budget=64)
    burst = [timed_seq(0, 30, 2, 5.0), timed_seq(1, 5, 2, 5.0), timed_seq(2, 12, 2, 5.0), timed_seq(3, 5, 2, 5.0)]
    for q in burst:
        s.add(q)
    while s.has_unfinished():
        step(s)
    order = sorted(burst, key=lambda q: q.first_scheduled_time)
    assert [q.seq_id for q in order] == [1, 3, 2, 0]  # equal prompts keep their arrival order


def test_a_long_prompt_is_overtaken_only_before_its_deadline():
    """Short prompts keep arriving; the long one is passed only by those that came before its deadline."""
    s = make(num_blocks=256, max_num_seqs=1, budget=256)
    per_token = DEFAULT_PREFILL_MS_PER_TOKEN / 1e3
    long = timed_seq(0, 100, 1, 0.0)
    s.add(long)
    assert long.deadline == 100 * per_token
    # one already running keeps the single slot busy while the others queue up
    s.add(timed_seq(1, 4, 30, -1.0))
    step(s)
    shorts = [timed_seq(2 + i, 4, 1, (10 + 10 * i) * per_token) for i in range(20)]  # arriving every 10 tokens' time
    for q in shorts:
        s.add(q)
    while s.has_unfinished():
        step(s)
    passed = [q for q in shorts if q.first_scheduled_time < long.first_scheduled_time]
    assert passed and all(q.deadline <= long.deadline for q in passed)
    assert all(q.first_scheduled_time > long.first_scheduled_time for q in shorts if q.deadline > long.deadline)


def test_preempted_sequences_resume_before_any_new_request():
    s = make(num_blocks=4, block_size=4, budget=64)
    a, b = timed_seq(0, 7, 8, 0.0), timed_seq(1, 7, 8, 0.0)
    s.add(a)
    s.add(b)
    step(s)
    c = timed_seq(2, 1, 2, -100.0)  # arrived "earlier" and is short: it still waits behind the preempted b
    s.add(c)
    while not b.num_preemptions:
        step(s)
    assert s.waiting[0] is b and admission_key(b) < admission_key(c)


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(st.tuples(st.sampled_from(["add", "add", "step", "step", "abort"]),
                           st.integers(1, 40), st.integers(1, 8), st.floats(0, 0.05)),
                 min_size=1, max_size=60),
    num_blocks=st.integers(12, 40),
    block_size=st.sampled_from([1, 4]),
    budget=st.integers(4, 48),
    max_num_seqs=st.integers(1, 6),
)
def test_admission_never_overtakes_an_earlier_deadline(ops, num_blocks, block_size, budget, max_num_seqs):
    """Every admission takes the smallest key waiting, so nobody waits behind a request queued after its
    deadline: together with the head-of-line rule, that is what bounds every request's wait."""
    s = make(num_blocks, block_size, max_num_seqs, budget)
    capacity = num_blocks * block_size
    clock, seqs = 0.0, []
    for op, length, max_tokens, gap in ops:
        clock += gap
        if op == "add":
            q = timed_seq(len(seqs), min(length, capacity - max_tokens), max_tokens, clock)
            seqs.append(q)
            s.add(q)
        elif op == "abort" and seqs:
            s.abort(seqs[int(gap * 1e4) % len(seqs)].request_id)
        else:
            waiting = list(s.waiting)
            out = step(s)
            admitted = [q for q in waiting if q.status is not SequenceStatus.WAITING]
            left = [q for q in waiting if q.status is SequenceStatus.WAITING]
            assert not (admitted and out.num_preempted)
            assert all(admission_key(a) <= admission_key(b) for a in admitted for b in left)
            assert s.waiting == sorted(s.waiting, key=admission_key)
    for _ in range(10_000):
        if not s.has_unfinished():
            break
        step(s)
    assert not s.has_unfinished(), "a request got stuck"
    assert s.block_manager.num_used_blocks == 0


def test_static_policy_waits_for_the_whole_batch():
    s = make(max_num_seqs=2, policy="static")
    a, b, c = seq(0, 4, 2), seq(1, 4, 6), seq(2, 4, 2)
    for q in (a, b, c):
        s.add(q)
    step(s)
    step(s)
    assert a.is_finished and not b.is_finished
    for _ in range(3):
        out = step(s)
        assert c not in out.seqs  # a's slot stays empty until b is done
    while not b.is_finished:
        step(s)
    out = step(s)
    assert out.seqs == [c]


def test_abort_frees_blocks_waiting_and_running():
    s = make()
    a, b = seq(0, 9, 5), seq(1, 9, 5)
    s.add(a)
    step(s)
    s.add(b)
    assert s.abort("r1") is b and b.status is SequenceStatus.FINISHED_ABORTED
    assert s.abort("r0") is a and s.block_manager.num_used_blocks == 0
    assert s.abort("nope") is None and not s.has_unfinished()


def test_prefix_cache_hit_skips_computation():
    s = make(block_size=4)
    a = seq(0, 13, 1)
    s.add(a)
    while s.has_unfinished():
        step(s)
    b = Sequence(1, "r1", list(a.prompt_token_ids[:12]) + [99, 98], SamplingParams(max_tokens=1), 1)
    before = s.stats.prompt_tokens_computed
    s.add(b)
    out = step(s)
    assert b.num_cached_tokens == 12 and out.num_new_tokens == [2]
    assert s.stats.prompt_tokens_computed - before == 2


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(st.tuples(st.sampled_from(["add", "step", "step", "step", "abort"]),
                           st.integers(1, 40), st.integers(1, 12), st.integers(0, 10**6)),
                 min_size=1, max_size=60),
    num_blocks=st.integers(12, 40),
    block_size=st.sampled_from([1, 2, 4, 8]),
    budget=st.integers(4, 48),
    max_num_seqs=st.integers(1, 6),
    prefix=st.booleans(),
)
def test_random_interleavings_never_leak(ops, num_blocks, block_size, budget, max_num_seqs, prefix):
    s = make(num_blocks, block_size, max_num_seqs, budget, prefix=prefix)
    rng = random.Random(0)

    def token(q):  # sometimes EOS; tokens drawn from a small alphabet so prefixes repeat
        return EOS if rng.random() < 0.05 else rng.randint(1, 3)

    drive(s, ops, lambda: step(s, token))


def test_started_reports_each_request_once_preempted_or_not():
    """What the async engine's admission hears: a request's first scheduled step, never its restart after a
    preemption (a request that has started is never refused for its wait)."""
    s = make(num_blocks=6, block_size=4, budget=64)
    a, b = seq(0, 8, 12), seq(1, 8, 12, base=60)
    s.add(a)
    s.add(b)
    out = step(s)
    assert out.started == [a, b]
    started = []
    while s.has_unfinished():
        out = step(s)
        started += out.started
    assert b.num_preemptions >= 1 and started == []


def test_seated_are_the_queue_head_that_free_seats_and_blocks_reach():
    """Two long prompts, a token budget for one chunk: the first is scheduled, the second only seated (a seat and its
    prompt's blocks are free for it; the budget alone holds its prefill back), and reported once. The third finds no
    seat, and with blocks for only two whole prompts a fourth seat would not count either."""
    s = make(num_blocks=10, block_size=4, max_num_seqs=2, budget=8)
    a, b, c = seq(0, 12, 2), seq(1, 12, 2, base=60), seq(2, 12, 2, base=120)
    for q in (a, b, c):
        s.add(q)
    out = step(s)
    assert out.started == [a] and out.seated == [b]  # c: both seats are taken (a running, b seated)
    out = step(s)
    assert out.started == [b] and out.seated == []  # b's first tokens: started now, seated no more
    s = make(num_blocks=7, block_size=4, max_num_seqs=4, budget=8)
    a, b, c = seq(0, 12, 2), seq(1, 12, 2, base=60), seq(2, 12, 2, base=120)
    for q in (a, b, c):
        s.add(q)
    out = step(s)  # a holds 2 blocks, 3 more are a's; b's whole prompt takes 3 of the 7: c's would not fit
    assert out.started == [a] and out.seated == [b]


def test_static_batching_seats_nobody_while_a_batch_runs():
    s = make(max_num_seqs=4, budget=64, policy="static")
    a, b = seq(0, 8, 4), seq(1, 8, 4, base=60)
    s.add(a)
    out = step(s)
    s.add(b)
    seated = []
    while a.status is not SequenceStatus.FINISHED_LENGTH:
        out = step(s)
        seated += out.seated
    assert out.started == [] and seated == []


# ---- the priority policy --------------------------------------------------------------------------------------
def test_priority_orders_admission_and_equal_priorities_keep_fcfs_order():
    s = make(max_num_seqs=1, scheduling_policy="priority")
    burst = [timed_seq(0, 12, 2, 5.0), timed_seq(1, 30, 2, 5.0), timed_seq(2, 5, 2, 5.0), timed_seq(3, 5, 2, 5.0)]
    for q, p in zip(burst, (1, 0, 2, 0)):
        q.params.priority = p
        s.add(q)
    assert s.waiting == sorted(burst, key=priority_admission_key)
    while s.has_unfinished():
        step(s)
    order = sorted(burst, key=lambda q: q.first_scheduled_time)
    assert [q.seq_id for q in order] == [3, 1, 0, 2]  # priority 0 first (the shorter prompt first, as fcfs)


def test_fcfs_ignores_priority():
    s = make(max_num_seqs=1)
    seqs = [seq(i, 4, 2, priority=3 - i) for i in range(4)]
    for q in seqs:
        s.add(q)
    while s.has_unfinished():
        step(s)
    assert [q.seq_id for q in sorted(seqs, key=lambda q: q.first_scheduled_time)] == [0, 1, 2, 3]


def test_an_urgent_request_preempts_the_least_urgent_for_kv_blocks():
    # 6 blocks of 4 tokens: two running 8-token prompts take a 3rd block each as they decode, and the urgent
    # 12-token prompt needs 3
    s = make(num_blocks=6, block_size=4, scheduling_policy="priority")
    low, mid = seq(0, 8, 12, priority=5), seq(1, 8, 12, base=60, priority=1)
    s.add(low)
    s.add(mid)
    step(s)
    urgent = seq(2, 12, 2, base=90, priority=0)
    s.add(urgent)
    out = step(s)
    assert urgent.status is SequenceStatus.RUNNING and urgent in out.seqs
    assert low.status is SequenceStatus.WAITING and low.num_preemptions == 1 and low not in out.seqs
    assert mid.status is SequenceStatus.RUNNING and mid.num_preemptions == 0  # older than `low` would not save it
    assert out.num_preempted == 1 and out.num_admitted == 1 and s.waiting == [low]
    while s.has_unfinished():
        step(s)
    assert all(q.num_output_tokens == q.max_tokens for q in (low, mid, urgent))
    assert s.block_manager.num_used_blocks == 0


def test_an_urgent_request_takes_the_seat_of_the_newest_least_urgent():
    s = make(max_num_seqs=2, scheduling_policy="priority")
    a, b = seq(0, 4, 20, priority=3), seq(1, 4, 20, priority=3)
    s.add(a)
    s.add(b)
    step(s)
    same = seq(2, 4, 2, priority=3)
    s.add(same)
    out = step(s)
    assert out.num_preempted == 0 and same.status is SequenceStatus.WAITING  # equals never preempt each other
    urgent = seq(3, 4, 2, priority=-1)
    s.add(urgent)
    out = step(s)
    assert out.num_preempted == 1 and b.status is SequenceStatus.WAITING and a.status is SequenceStatus.RUNNING
    assert urgent.status is SequenceStatus.RUNNING
    assert s.waiting == [b, same]  # the preempted one resumes before the unstarted of its priority


def test_the_least_urgent_gives_back_tokens_it_was_given_this_step():
    """Blocks run out for a running sequence: the victim is the least urgent even if it came earlier in the running
    list and was already scheduled in this step; it leaves the step's batch and the token budget gets its share."""
    s = make(num_blocks=4, block_size=4, budget=64, scheduling_policy="priority")
    low, high = seq(0, 6, 8, priority=2), seq(1, 7, 8, base=60, priority=0)
    s.add(low)
    s.add(high)
    step(s)  # both prefilled: 2 blocks each, the pool is full
    step(s)
    out = s.schedule()  # low decodes first, within its 2 blocks; high needs a 3rd: low makes room
    assert out.seqs == [high] and out.num_new_tokens == [1] and out.num_preempted == 1
    assert low.status is SequenceStatus.WAITING and not low.block_table and s.running == [high]
    s.update(out, [1])
    s.block_manager.check_integrity(s.running + s.waiting)
    while s.has_unfinished():
        step(s)
    assert low.num_output_tokens == 8 and high.num_output_tokens == 8 and high.num_preemptions == 0


def test_a_sequence_preempted_to_make_room_waits_for_the_next_step():
    """Room made for an urgent request is not handed straight back to the request it was taken from."""
    s = make(num_blocks=6, block_size=4, budget=16, prefix=False, scheduling_policy="priority")
    low = seq(0, 12, 4, priority=1)
    s.add(low)
    step(s)  # low holds 3 blocks: 3 are left, the urgent 13-token prompt needs 4
    urgent = seq(1, 13, 2, base=60, priority=0)
    s.add(urgent)
    out = s.schedule()
    assert out.seqs == [urgent] and out.num_new_tokens == [13] and out.num_preempted == 1
    # 3 tokens of budget and 2 blocks are left, enough for the start of low's recompute: it still waits
    assert low.status is SequenceStatus.WAITING and s.block_manager.num_free_blocks == 2
    s.update(out, [1])
    while s.has_unfinished():
        step(s)
    assert low.num_output_tokens == 4 and urgent.num_output_tokens == 2


def test_a_less_urgent_running_sequence_gets_the_budget_after_an_urgent_waiting_one():
    """The token budget goes to the urgent request first: a less urgent prompt being prefilled in chunks does not
    keep it out of the step."""
    s = make(budget=16, scheduling_policy="priority")
    low = seq(0, 40, 2, priority=3)
    s.add(low)
    step(s)
    urgent = seq(1, 6, 2, base=60, priority=1)
    s.add(urgent)
    out = s.schedule()
    assert out.seqs == [urgent, low] and out.num_new_tokens == [6, 10] and out.num_preempted == 0


def token_of(q):
    """A fake model that depends only on the sequence: the same schedule gets the same tokens."""
    return EOS if (q.seq_id * 31 + q.num_tokens) % 17 == 0 else 1 + (q.seq_id + q.num_tokens) % 3


OPS = st.lists(st.tuples(st.sampled_from(["add", "add", "step", "step", "step", "abort"]),
                         st.integers(1, 40), st.integers(1, 12), st.integers(0, 10**6)), min_size=1, max_size=60)


@settings(max_examples=80, deadline=None)
@given(ops=OPS, num_blocks=st.integers(12, 40), block_size=st.sampled_from([1, 2, 4, 8]),
       budget=st.integers(4, 48), max_num_seqs=st.integers(1, 6), prefix=st.booleans(), levels=st.integers(1, 4))
def test_priority_interleavings_preempt_the_least_urgent_and_never_leak(ops, num_blocks, block_size, budget,
                                                                       max_num_seqs, prefix, levels):
    """Random interleavings under the priority policy: every request finishes and every block comes back (`drive`),
    ref counts match the block tables after every step, admission takes the most urgent first, and whoever is
    preempted is less urgent than everyone who keeps running (the newest among equals) and than the most urgent
    request admitted in that step."""
    s = make(num_blocks, block_size, max_num_seqs, budget, prefix=prefix, scheduling_policy="priority")

    def checked_step():
        running, waiting = list(s.running), list(s.waiting)
        out = s.schedule()
        victims = [q for q in running if q.status is SequenceStatus.WAITING]
        kept = [q for q in running if q.status is SequenceStatus.RUNNING]
        assert len(victims) == out.num_preempted
        for v in victims:
            assert all((k.params.priority, running.index(k)) < (v.params.priority, running.index(v)) for k in kept)
            assert v not in out.seqs
        admitted = [q for q in waiting if q.status is SequenceStatus.RUNNING]
        left = [q for q in waiting if q.status is SequenceStatus.WAITING]
        assert all(priority_admission_key(a) <= priority_admission_key(b) for a in admitted for b in left)
        assert all(min(a.params.priority for a in admitted) < v.params.priority for v in victims if admitted)
        assert s.waiting == sorted(s.waiting, key=priority_admission_key)
        s.update(out, [token_of(q) if want else None for q, want in zip(out.seqs, out.sample)])
        s.block_manager.check_integrity(s.running + s.waiting)

    drive(s, ops, checked_step, priority=lambda pick: pick % levels)


@settings(max_examples=60, deadline=None)
@given(ops=OPS, num_blocks=st.integers(12, 40), block_size=st.sampled_from([1, 4]), budget=st.integers(4, 48),
       max_num_seqs=st.integers(1, 6))
def test_equal_priorities_schedule_exactly_as_fcfs(ops, num_blocks, block_size, budget, max_num_seqs):
    fcfs = make(num_blocks, block_size, max_num_seqs, budget)
    prio = make(num_blocks, block_size, max_num_seqs, budget, scheduling_policy="priority")
    outs = {id(fcfs): [], id(prio): []}
    for s in (fcfs, prio):  # the same arrival times in both runs, so the same deadlines
        def add(q, add=s.add):
            q.arrival_time = q.arrival_time if q.deadline is not None else q.seq_id / 100
            add(q)
        s.add = add

    def stepper(s):
        def run():
            out = s.schedule()
            outs[id(s)].append(([q.seq_id for q in out.seqs], out.num_new_tokens, out.num_preempted))
            s.update(out, [token_of(q) if want else None for q, want in zip(out.seqs, out.sample)])
        return run

    drive(fcfs, ops, stepper(fcfs), priority=lambda pick: 7)
    drive(prio, ops, stepper(prio), priority=lambda pick: 7)
    assert outs[id(fcfs)] == outs[id(prio)]


def test_check_stop_decides_every_finish_in_its_order():
    """The one stop check: a stop string, EOS or a stop token is "stop" even on the last allowed token; max_tokens is
    "length"; a complete grammar is "stop" only before that; a prompt-only request is done at once."""
    stop, length = SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH

    def after(tokens, max_tokens=3, match=None, **params):
        q = Sequence(0, "r", [5, 6], SamplingParams(max_tokens=max_tokens, **params), max_tokens, frozenset({EOS}))
        for t in tokens:
            q.append_token(t)
        return check_stop(q, match)

    assert after([7]) is None and after([7, 8]) is None
    assert after([7, EOS]) is stop and after([7, EOS], ignore_eos=True) is None
    assert after([9], stop_token_ids=[9]) is stop and after([9], stop_token_ids=[9], ignore_eos=True) is stop
    assert after([7, 8, 9]) is length
    assert after([7], match=StopMatch.STOP_STRING) is stop
    assert after([7, 8, 9], match=StopMatch.STOP_STRING) is stop  # the last allowed token completed it
    assert after([7, 8, EOS]) is stop
    assert after([7], match=StopMatch.GRAMMAR_COMPLETE) is stop
    assert after([7, 8, 9], match=StopMatch.GRAMMAR_COMPLETE) is length
    assert after([], max_tokens=0, prompt_logprobs=0) is length


def test_update_finishes_through_the_stop_check_and_drops_tokens_after_it():
    """Accepted drafts after a stop token never reach the sequence; a prompt-only request ends as its prompt
    completes, without a token; what the observer reports ends a request too."""
    s = make()
    a, c = seq(0, 4, 8), seq(2, 4, 8)
    b = Sequence(1, "r1", [1, 2, 3, 4], SamplingParams(max_tokens=0, prompt_logprobs=0), 0, frozenset({EOS}))
    for q in (a, b, c):
        s.add(q)
    out = s.schedule()
    assert out.sample == [True, True, True]
    seen = []

    def observe(q, token):
        seen.append((q.seq_id, token))
        return StopMatch.STOP_STRING if q is c else None

    sampled = {0: [3, EOS, 4], 1: 9, 2: 5}
    got = s.update(out, [sampled[q.seq_id] for q in out.seqs], observe)
    assert [q.seq_id for q in got] == [q.seq_id for q in out.seqs] and not s.has_unfinished()
    assert a.output_token_ids == [3, EOS] and a.status is SequenceStatus.FINISHED_STOPPED
    assert b.output_token_ids == [] and b.status is SequenceStatus.FINISHED_LENGTH
    assert c.output_token_ids == [5] and c.status is SequenceStatus.FINISHED_STOPPED
    assert sorted(seen) == sorted([(0, 3), (0, EOS), (2, 5)]) and s.stats.generation_tokens == 3
    assert s.block_manager.num_used_blocks == 0
