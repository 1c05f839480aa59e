"""The step-cost model (fit, inverse query) and the scheduler's time budget for prefill (no model)."""

import random

import numpy as np
from conftest import EOS, drive
from hypothesis import given, settings
from hypothesis import strategies as st
from test_scheduler import step

from pagedserve.engine.block_manager import BlockManager
from pagedserve.engine.config import SchedulerConfig
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.scheduler import MIN_PREFILL_TOKENS, Scheduler
from pagedserve.engine.sequence import Sequence, SequenceStatus
from pagedserve.engine.step_cost import DEFAULT_TARGET_FACTOR, StepCostModel, StepShape


def fitted(coef) -> StepCostModel:
    model = StepCostModel()
    model.coef = np.array(coef, dtype=float)
    return model


def test_fit_recovers_the_cost_of_each_part():
    rng = random.Random(0)
    truth = np.array([3.0, 0.05, 0.4, 0.002])
    model = StepCostModel()
    assert model.prefill_tokens_within(100.0, 4, 400) is None  # nothing measured: no time limit
    for _ in range(200):
        shape = StepShape(rng.choice([0, 0, 16, 256, 2048]), rng.randint(0, 64), 0)
        shape = StepShape(shape.prefill_tokens, shape.decode_seqs, shape.decode_seqs * rng.randint(10, 900))
        noise = 1 + 0.03 * rng.uniform(-1, 1)
        model.observe(shape, float(np.dot(truth, shape.row())) * noise)
    np.testing.assert_allclose(model.coef, truth, rtol=0.15, atol=0.3)
    assert "prefill_tokens" in model.describe()


def test_fit_waits_for_steps_with_and_without_prefill():
    model = StepCostModel()
    for _ in range(20):
        model.observe(StepShape(0, 8, 800), 10.0)  # decodes only: prefill cost unknown
    assert model.coef is None
    for n in (64, 128, 256):
        model.observe(StepShape(n, 8, 800), 10.0 + 0.1 * n)
    assert model.coef is not None and model.coef[1] > 0


def test_prefill_tokens_within_target():
    model = fitted([2.0, 0.1, 0.5, 0.01])  # decodes: 2 + 0.5 * 10 + 0.01 * 1000 = 17 ms
    assert model.prefill_tokens_within(57.0, 10, 1000) == 400
    assert model.prefill_tokens_within(10.0, 10, 1000) == 0  # the decodes alone exceed it
    assert model.prefill_tokens_within(None, 10, 1000) is None  # no target: no limit
    assert model.default_target_ms(10, 1000) == DEFAULT_TARGET_FACTOR * 17
    assert StepCostModel().default_target_ms(10, 1000) is None  # nothing measured


def test_time_budget_chunks_prefill_next_to_decodes():
    bm = BlockManager(256, 4, True)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=512, max_step_ms=20.0), bm,
                  fitted([0.0, 0.1, 1.0, 0.0]))
    decoders = [Sequence(i, f"d{i}", [1, 2], SamplingParams(max_tokens=50), 50, frozenset({EOS})) for i in range(10)]
    for q in decoders:
        s.add(q)
    step(s)  # prefills the 10 short prompts (no decodes yet: decodes cost 0, budget 200 tokens >= 20)
    long = Sequence(99, "long", list(range(1, 301)), SamplingParams(max_tokens=2), 2, frozenset({EOS}))
    s.add(long)
    out = step(s)  # 10 decodes cost 10 ms: 100 prefill tokens fit in 20 ms
    assert sorted(out.num_new_tokens) == [1] * 10 + [100]
    out = step(s)
    assert sorted(out.num_new_tokens) == [1] * 10 + [100]


def test_default_target_is_sized_by_the_batch_a_burst_heads_for():
    """One stream decoding and twenty prompts waiting: the target is a multiple of a decode step of all 21, not of one
    (which would leave the prompts a sliver); an explicit target is kept to, down to MIN_PREFILL_TOKENS."""
    coef = [10.0, 0.5, 1.0, 0.0]
    for target, chunk in ((None, int((DEFAULT_TARGET_FACTOR * (10 + 21) - 11) / 0.5)), (22.0, MIN_PREFILL_TOKENS)):
        s = Scheduler(SchedulerConfig(max_num_batched_tokens=2048, max_step_ms=target), BlockManager(1024, 16, True),
                      fitted(coef))
        s.add(Sequence(0, "d", [1, 2], SamplingParams(max_tokens=50), 50, frozenset({EOS})))
        step(s)
        for i in range(20):
            s.add(Sequence(1 + i, f"p{i}", list(range(1, 301)), SamplingParams(max_tokens=2), 2, frozenset({EOS})))
        out = step(s)  # the decode alone costs 11 ms
        assert out.num_new_tokens[0] == 1 and sum(out.num_new_tokens[1:]) == chunk


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(st.tuples(st.sampled_from(["add", "step", "step", "step", "abort"]),
                           st.integers(1, 80), st.integers(1, 12), st.integers(0, 10**6)),
                 min_size=1, max_size=60),
    num_blocks=st.integers(16, 60),
    block_size=st.sampled_from([1, 4, 16]),
    budget=st.integers(4, 128),
    max_num_seqs=st.integers(1, 8),
    coef=st.tuples(st.floats(0, 5), st.floats(0.01, 1), st.floats(0, 3), st.floats(0, 0.05)),
    target=st.one_of(st.none(), st.floats(0.5, 200)),
)
def test_time_budget_keeps_the_scheduler_invariants(ops, num_blocks, block_size, budget, max_num_seqs, coef,
                                                    target):
    model = fitted(coef)
    s = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_step_ms=target),
                  BlockManager(num_blocks, block_size, True), model)
    rng = random.Random(0)

    def token(q):
        return EOS if rng.random() < 0.05 else rng.randint(1, 3)

    def checked_step():
        decodes = [q.num_tokens for q in s.running if q.num_tokens - q.num_computed_tokens == 1]
        goal = target
        if target is None and decodes:
            batch = s.running + s.waiting[:max(0, max_num_seqs - len(s.running))]
            goal = model.default_target_ms(len(batch), sum(q.num_tokens for q in batch))
        fit = model.prefill_tokens_within(goal, len(decodes), sum(decodes))
        limit = budget if fit is None else max(fit, MIN_PREFILL_TOKENS)
        oldest_prefill = next((q for q in s.running if q.num_tokens - q.num_computed_tokens > 1), None)
        out = step(s, token)
        assert sum(out.num_new_tokens) <= budget and len(out.seqs) <= max_num_seqs
        assert all(n >= 1 for n in out.num_new_tokens)
        assert sum(n for n in out.num_new_tokens if n > 1) <= limit  # within the time budget (or the minimum)
        if oldest_prefill is not None and not out.num_preempted and oldest_prefill.status is SequenceStatus.RUNNING:
            assert oldest_prefill in out.seqs  # the oldest waiting prompt always advances

    drive(s, ops, checked_step)


def test_offline_llm_turns_the_step_time_target_off(monkeypatch):
    """LLM.generate returns everything at the end: no stream to protect, so no step-time target unless asked."""
    from pagedserve.engine import llm as llm_module

    seen = []

    class Engine:
        tokenizer = None

        def __init__(self, config):
            seen.append(config)

    monkeypatch.setattr(llm_module, "LLMEngine", Engine)
    llm_module.LLM()
    llm_module.LLM(max_step_ms=None)
    llm_module.LLM(max_step_ms=50.0)
    assert [c.scheduler.max_step_ms for c in seen] == [0, 0, 50.0]


def test_a_serving_engine_is_fitted_before_its_first_request(make_engine):
    """warm_up times steps of varied shape so the first burst is sized by time; it leaves nothing behind."""
    engine = make_engine()
    assert engine.cost_model.coef is None
    engine.warm_up()
    assert engine.cost_model.coef is not None and engine.cost_model.coef[1] > 0
    assert not engine.has_unfinished() and engine.block_manager.usage() == 0.0
    assert engine.num_steps == 0 and engine.scheduler.stats.generation_tokens == 0
    assert engine.stats().prefix_cache_queries == 0
    offline = make_engine(max_step_ms=0)
    offline.warm_up()  # sizes nothing by time: nothing to fit
    assert offline.cost_model.coef is None and offline.num_steps == 0


def test_warm_up_fits_any_context_length():
    """Every warm-up request (prompt, its batch tail, its tokens) fits the context, and a context too short for any
    is left unfitted: a max_model_len near a warm-up prompt's length once made warm-up refuse its own request, and
    the server then answered 503 for ever."""
    from pagedserve.engine import LLMEngine, make_config

    for n in (5, 19, 20, 100, 170):
        engine = LLMEngine(make_config(model="random:tiny", device="cpu", dtype="float32", num_blocks=64,
                                       max_model_len=n))
        engine.warm_up()
        assert not engine.has_unfinished() and engine.block_manager.usage() == 0.0
        if n < 20 or n >= 100:  # nothing fits, or prompts of several lengths: fitted (in between, it may not be)
            assert (engine.cost_model.coef is None) == (n < 20), n
