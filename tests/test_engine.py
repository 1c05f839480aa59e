"""The whole engine on the real SmolLM2 weights (fp32, CPU): batching, prefix caching, preemption, errors."""

import pytest
import torch
from conftest import greedy, record_comparison, run_to_completion

from pagedserve.benchmarks.workloads import load_words
from pagedserve.engine import (
    ContextLengthExceededError,
    InvalidRequestError,
    LLMEngine,
    ModelLoadError,
    SamplingParams,
    make_config,
)

PROMPTS = [
    "It is a truth universally acknowledged, that a single man",
    "The capital of France is",
    "Once upon a time, in a land far away,",
    "def add(a, b):",
    "My favourite colour is",
    "The meaning of life is",
    "Water boils at",
    "List three fruits:",
]


@pytest.mark.slow  # load, flood or fuzz: the heavy tier
def test_batch_invariance_greedy(make_engine, smollm):
    """Each prompt alone == the same prompt inside 32 mixed requests arriving at different steps."""
    tok = smollm.tokenizer
    ids = [tok.encode(p) for p in PROMPTS]
    alone = {}
    engine = make_engine()
    for i, p in enumerate(ids):
        engine.add_request(f"a{i}", p, greedy(24))
        alone[i] = run_to_completion(engine)[f"a{i}"]

    words = load_words()
    fillers = [tok.encode(" ".join(words[k * 50: k * 50 + 10 + 7 * k])) for k in range(24)]
    engine = make_engine(max_num_batched_tokens=96)  # forces chunked prefill beside decodes
    order = [("f", k) for k in range(24)]
    for i in range(8):
        order.insert(3 * i + 1, ("p", i))
    results = {}
    pending = list(order)
    while pending or engine.has_unfinished():
        for _ in range(2):  # two arrivals per step
            if pending:
                kind, k = pending.pop(0)
                if kind == "p":
                    engine.add_request(f"p{k}", ids[k], greedy(24))
                else:
                    engine.add_request(f"f{k}", fillers[k], greedy(8 + k))
        for out in engine.step():
            r = results.setdefault(out.request_id, {"tokens": [], "logprobs": []})
            r["tokens"] += out.new_token_ids
            r["logprobs"] += out.logprobs
    assert len(results) == 32
    for i in range(8):
        record_comparison(f"batch-invariance prompt {i}", results[f"p{i}"]["tokens"], alone[i]["tokens"],
                          results[f"p{i}"]["logprobs"])


def test_prefix_caching_computes_only_the_tail(make_engine, smollm):
    tok = smollm.tokenizer
    words = load_words()
    shared = tok.encode(" ".join(words[1000:1800]))
    assert len(shared) >= 1000
    first = shared + tok.encode(" Who said this?")
    second = shared + tok.encode(" What happens next in the story?")

    engine = make_engine(num_blocks=512)
    engine.add_request("first", first, greedy(16))
    run_to_completion(engine)
    before = engine.scheduler.stats.prompt_tokens_computed
    engine.add_request("second", second, greedy(16))
    cached = run_to_completion(engine)["second"]
    computed = engine.scheduler.stats.prompt_tokens_computed - before

    bs = engine.config.cache.block_size
    common = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert cached["num_cached_tokens"] == common // bs * bs
    assert computed == len(second) - cached["num_cached_tokens"]
    assert computed < 3 * bs + (len(second) - common)  # only the unshared tail (+ a partial block)

    fresh_engine = make_engine(num_blocks=512, enable_prefix_caching=False)
    fresh_engine.add_request("second", second, greedy(16))
    fresh = run_to_completion(fresh_engine)["second"]
    assert fresh["num_cached_tokens"] == 0
    record_comparison("prefix-cache", cached["tokens"], fresh["tokens"], cached["logprobs"])


@pytest.mark.slow  # load, flood or fuzz: the heavy tier
def test_preemption_with_a_tiny_cache(make_engine, smollm):
    tok = smollm.tokenizer
    words = load_words()
    prompts = [tok.encode(" ".join(words[300 * k: 300 * k + 8 + (k * 5) % 30])) for k in range(32)]
    lengths = [10 + (k * 7) % 25 for k in range(32)]

    def run(engine, check=None):
        for k, (p, n) in enumerate(zip(prompts, lengths)):
            engine.add_request(str(k), p, greedy(n))
        return run_to_completion(engine, check)

    def integrity(engine):
        s = engine.scheduler
        engine.block_manager.check_integrity(s.running + list(s.waiting))

    small = make_engine(num_blocks=40, block_size=16, max_num_seqs=32)  # 640 tokens for 32 requests
    constrained = run(small, integrity)
    assert small.scheduler.stats.num_preemptions > 0
    assert small.block_manager.num_used_blocks == 0
    reference = run(make_engine())
    assert set(constrained) == set(reference) == {str(k) for k in range(32)}
    for k in range(32):
        r = constrained[str(k)]
        assert len(r["tokens"]) == lengths[k] and r["finish_reason"] == "length"
        record_comparison(f"preemption request {k}", r["tokens"], reference[str(k)]["tokens"], r["logprobs"])


def test_kv_bytes_per_token(make_engine, smollm):
    engine = make_engine(num_blocks=100, block_size=16)
    cfg = smollm.config
    formula = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4  # fp32
    assert formula == 2 * 30 * 3 * 64 * 4
    runner = engine.runner
    assert runner.kv_bytes_per_token == formula
    assert runner.kv_capacity_tokens == 1600
    assert runner.kv_cache_bytes() == runner.kv_cache.numel() * runner.kv_cache.element_size()
    assert runner.kv_cache_bytes() / runner.kv_capacity_tokens == formula


def test_memory_budget_sizes_the_cache(make_engine):
    engine = make_engine(num_blocks=None, memory_gib=0.05)
    per_block = engine.runner.kv_bytes_per_token * 16
    assert engine.runner.num_blocks == int(0.05 * 2**30 // per_block)


def test_gpu_kv_budget_leaves_room_for_the_profiled_step():
    """The GPU pool: at most 90 % of the GPU in use, minus what is in use now and the largest step's peak."""
    from pagedserve.engine.model_runner import gpu_kv_budget

    gib = 2**30
    assert gpu_kv_budget(free=100 * gib, total=140 * gib, activations=3 * gib) == 100 * gib - 14 * gib - 3 * gib
    assert gpu_kv_budget(free=10 * gib, total=140 * gib, activations=3 * gib) < 0  # _num_blocks then refuses


def test_profile_step_runs_the_largest_step_without_touching_the_cache(make_engine, smollm):
    """The profile run (what sizes a GPU pool) is a real forward at the full token budget through a scratch
    cache: the engine's own KV blocks stay as they were, and it still serves afterwards."""
    engine = make_engine(num_blocks=64, max_num_batched_tokens=96)
    runner = engine.runner
    before = runner.kv_cache.clone()
    runner._profile_forward()
    assert torch.equal(runner.kv_cache, before)
    engine.add_request("after", "The weather today is", greedy(4))
    assert len(run_to_completion(engine)["after"]["tokens"]) == 4


@pytest.mark.parametrize("kwargs,param", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(stop=["a", "b", "c", "d", "e"]), "stop"),
    (dict(seed=2**64), "seed"),
    (dict(seed="abc"), "seed"),
    (dict(cache_salt=123), "cache_salt"),
    (dict(priority=1.5), "priority"),
])
def test_bad_sampling_params(kwargs, param):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param and param in str(e.value)


def test_bad_requests_then_engine_still_serves(make_engine):
    engine = make_engine(num_blocks=64)  # 1024 tokens: max_model_len is capped to the cache
    assert engine.max_model_len == 1024
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("e1", "", SamplingParams())
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("e2", [], SamplingParams())
    with pytest.raises(ContextLengthExceededError) as e:
        engine.add_request("e3", list(range(1000)), SamplingParams(max_tokens=100))
    assert "1024" in str(e.value) and "1000" in str(e.value) and e.value.code == "context_length_exceeded"
    with pytest.raises(InvalidRequestError, match="token ids"):
        engine.add_request("e4", [1, 2, 10**9], SamplingParams())
    with pytest.raises(InvalidRequestError, match="a string or a list of token ids"):
        engine.add_request("e5", 7, SamplingParams())
    engine.add_request("ok", "Hello, my name is", greedy(5))
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("ok", "again", greedy(5))
    out = run_to_completion(engine)
    assert list(out) == ["ok"] and len(out["ok"]["tokens"]) == 5
    assert engine.block_manager.num_used_blocks == 0


def test_unknown_model_and_architecture(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file or directory"):
        LLMEngine(make_config(model=str(tmp_path / "nope")))
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        LLMEngine(make_config(model=str(tmp_path)))


def test_abort_frees_blocks_and_reports(make_engine):
    engine = make_engine(num_blocks=64)
    engine.add_request("a", "Tell me a story", greedy(50))
    engine.add_request("b", "Tell me another story", greedy(5))
    engine.step()
    engine.abort("a")
    outs = engine.step()
    aborted = [o for o in outs if o.request_id == "a"]
    assert aborted and aborted[0].finished and aborted[0].finish_reason == "abort"
    run_to_completion(engine)
    assert engine.block_manager.num_used_blocks == 0 and not engine.has_unfinished()


def test_stop_strings_and_finish_reasons(make_engine):
    engine = make_engine(num_blocks=64)
    engine.add_request("free", "1, 2, 3, 4, 5,", greedy(12, logprobs=None))
    free = run_to_completion(engine)["free"]
    assert free["finish_reason"] == "length"
    text = free["text"]
    stop = text[4:7]
    engine.add_request("stopped", "1, 2, 3, 4, 5,", SamplingParams(max_tokens=12, temperature=0, stop=[stop]))
    stopped = run_to_completion(engine)["stopped"]
    assert stopped["finish_reason"] == "stop"
    assert stopped["text"] == text[:text.index(stop)]


def test_seeded_sampling_is_reproducible(make_engine):
    engine = make_engine(num_blocks=128)
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    engine.add_request("x", "The weather today", params)
    engine.add_request("noise", "Some other request in the batch", SamplingParams(max_tokens=20, temperature=1.0))
    first = run_to_completion(engine)["x"]["tokens"]
    engine.add_request("y", "The weather today", params)
    second = run_to_completion(engine)["y"]["tokens"]
    assert first == second
    engine.add_request("z", "The weather today", SamplingParams(max_tokens=16, temperature=1.0, seed=99))
    assert run_to_completion(engine)["z"]["tokens"] != first


def test_offline_llm_generate(make_engine):
    from pagedserve.engine import LLM

    llm = LLM(engine=make_engine(num_blocks=64))
    results = llm.generate(["The capital of France is", [504, 3575]], SamplingParams(max_tokens=6, temperature=0))
    assert len(results) == 2
    assert results[0].text.strip().startswith("Paris")
    assert len(results[1].token_ids) == 6 and results[1].finish_reason == "length"
    m = results[0].metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finish_time


def test_bf16_engine_runs(smollm):
    """The default dtype path (bf16 where fast) produces sensible text too."""
    engine = LLMEngine(make_config(model=smollm.path, dtype="bfloat16", device="cpu", num_blocks=64),
                       tokenizer=smollm.tokenizer)
    engine.add_request("a", "The capital of France is", SamplingParams(max_tokens=4, temperature=0))
    out = run_to_completion(engine)["a"]
    assert "Paris" in out["text"]
    assert engine.runner.kv_cache.dtype == torch.bfloat16


def test_stop_string_on_the_last_allowed_token_is_stop(make_engine, smollm):
    engine = make_engine(num_blocks=64)
    engine.add_request("free", "1, 2, 3, 4, 5,", greedy(6, logprobs=None))
    free = run_to_completion(engine)["free"]
    last = smollm.tokenizer.decode(free["tokens"][-1:]).strip()
    assert last
    engine.add_request("s", "1, 2, 3, 4, 5,", SamplingParams(max_tokens=6, temperature=0, stop=[last]))
    out = run_to_completion(engine)["s"]
    if len(out["tokens"]) == 6:  # the stop string completed on the 6th (last allowed) token
        assert out["finish_reason"] == "stop"
    assert out["finish_reason"] == "stop" and last not in out["text"]


def test_generate_validates_every_prompt_before_queueing_any(make_engine):
    from pagedserve.engine import LLM

    engine = make_engine(num_blocks=64)
    llm = LLM(engine=engine)
    params = SamplingParams(max_tokens=4, temperature=0)
    with pytest.raises(ContextLengthExceededError):
        llm.generate(["fine", "also fine", "x " * 5000], params)
    assert not engine.has_unfinished() and engine.num_waiting == 0
    with pytest.raises(InvalidRequestError):
        llm.generate(["fine", [1, 2, 10**9]], params)
    assert not engine.has_unfinished()
    assert [r.finish_reason for r in llm.generate(["next call", "works"], params)] == ["length", "length"]
    engine.block_manager.check_integrity([])


def test_generate_aborts_what_it_queued_when_interrupted(make_engine):
    from pagedserve.engine import LLM

    engine = make_engine(num_blocks=64)
    llm = LLM(engine=engine)
    real_step, steps = engine.step, []

    def step():
        steps.append(1)
        if len(steps) == 3:
            raise KeyboardInterrupt
        return real_step()

    engine.step = step
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["one", "two", "three"], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    assert not engine.has_unfinished() and not engine.scheduler.running
    assert engine.block_manager.num_used_blocks == 0
    engine.step = real_step
    assert llm.generate("again", SamplingParams(max_tokens=2, temperature=0))[0].finish_reason == "length"


def test_add_request_from_many_threads(make_engine):
    """Tokenizing and queueing from 8 threads at once while the engine steps: nothing lost or miscounted."""
    import threading

    engine = make_engine(num_blocks=256, max_num_seqs=4)
    errors, counts = [], []
    barrier = threading.Barrier(8)

    def client(t: int) -> None:
        try:
            barrier.wait()
            for j in range(4):
                engine.add_request(f"t{t}-{j}", f"Thread {t} says hello number {j}. " * (1 + j),
                                   SamplingParams(max_tokens=2, temperature=0))
                counts.append(engine.num_waiting)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=client, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    results: dict = {}
    while any(th.is_alive() for th in threads) or engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
    for th in threads:
        th.join()
    assert not errors and len(results) == 32 and all(o.finish_reason == "length" for o in results.values())
    assert engine.num_waiting == 0
    engine.block_manager.check_integrity([])



def test_logprobs_go_out_with_their_text_and_a_stop_cut_drops_them(make_engine, smollm):
    engine = make_engine(num_blocks=64)
    engine.add_request("free", "1, 2, 3, 4, 5,", greedy(10, logprobs=1))
    free = run_to_completion(engine)["free"]
    assert [x.token_id for x in free["logprobs"]] == free["tokens"]
    stop = free["text"][5:8]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, stop=[stop], logprobs=1)
    engine.add_request("cut", "1, 2, 3, 4, 5,", params)
    sent_text, sent_lps = "", []
    while engine.has_unfinished():
        for out in engine.step():
            sent_text += out.text
            sent_lps += out.logprobs
            # never a logprob for a token whose text has not gone out yet
            pieces = [smollm.tokenizer.decode([x.token_id]) for x in sent_lps]
            assert len("".join(pieces[:-1])) < len(sent_text) or len(sent_lps) <= 1
    assert sent_text == free["text"][:free["text"].index(stop)]
    assert [x.token_id for x in sent_lps] == free["tokens"][:len(sent_lps)] and len(sent_lps) < 10
    assert len("".join(smollm.tokenizer.decode([x.token_id]) for x in sent_lps[:-1])) < len(sent_text)


def test_priority_takes_the_seat_and_the_preempted_request_resumes_intact(make_engine):
    """--scheduling-policy priority on the real model: an urgent request takes the only seat from a running one,
    which is recomputed later and ends with exactly the tokens it produces alone; no block leaks."""
    engine = make_engine(num_blocks=64, max_num_seqs=1, scheduling_policy="priority")
    engine.add_request("low", "Tell me a story about a dragon", greedy(12), priority=2)
    first = [out for _ in range(4) for out in engine.step()]  # its prompt and 3 tokens
    engine.add_request("urgent", "The capital of France is", greedy(4))
    finished = []
    results = run_to_completion(engine, lambda e: finished.extend(
        r for r in ("low", "urgent") if r not in finished and r not in e._requests))
    assert finished == ["urgent", "low"] and engine.scheduler.stats.num_preemptions == 1
    low = [t for out in first for t in out.new_token_ids] + results["low"]["tokens"]
    lps = [x for out in first for x in out.logprobs] + results["low"]["logprobs"]
    assert len(low) == 12 and results["low"]["finish_reason"] == "length"
    engine.block_manager.check_integrity([])
    assert engine.block_manager.num_used_blocks == 0
    engine.add_request("alone", "Tell me a story about a dragon", greedy(12))
    alone = run_to_completion(engine)["alone"]
    record_comparison("priority preemption", low, alone["tokens"], lps)


def test_priority_keyword_of_add_request_and_generate(make_engine):
    """vLLM's keywords: LLMEngine.add_request(priority=...) and LLM.generate(priority=[...]); under fcfs a non-zero
    priority is refused, naming the field."""
    from pagedserve.engine import LLM

    with pytest.raises(InvalidRequestError, match="priority") as e:
        make_engine(num_blocks=64).add_request("p", "Hello", greedy(2), priority=1)
    assert e.value.param == "priority"
    llm = LLM(engine=make_engine(num_blocks=64, max_num_seqs=1, scheduling_policy="priority"))
    params = SamplingParams(max_tokens=2, temperature=0)
    results = llm.generate(["One", "Two", "Three"], params, priority=[2, 0, 1])
    order = sorted(range(3), key=lambda i: results[i].metrics.first_scheduled_time)
    assert order == [1, 2, 0] and params.priority == 0  # the caller's params are not changed
    with pytest.raises(ValueError, match="one priority per prompt"):
        llm.generate(["One"], params, priority=[1, 2])


def test_estimated_wait_is_built_from_what_the_engine_knows(make_engine):
    """A Retry-After's estimate before any queue has drained: the prompts ahead at the prefill cost per token (the
    scheduler's prior while the step-cost model is unfitted), plus, for want of a seat, the running request's
    remaining max_tokens at the last step's time; a second batch as long as the longest."""
    from pagedserve.engine.scheduler import DEFAULT_PREFILL_MS_PER_TOKEN

    engine = make_engine(num_blocks=64, max_num_seqs=1)
    engine.add_request("running", "Tell me a story", greedy(20))
    engine.step()
    engine.step()  # its prompt and 2 tokens: 18 left
    assert engine.cost_model.ms_per_prefill_token() is None and engine.estimated_wait(0) == 0
    step_s = engine.last_step.ms / 1e3
    assert engine.estimated_wait(1) == pytest.approx(18 * step_s)
    n = engine.add_request("queued", "The capital of France is", greedy(4))
    assert engine.estimated_wait(2) == pytest.approx(n * DEFAULT_PREFILL_MS_PER_TOKEN / 1e3 + 2 * 18 * step_s)
    engine.abort("running")
    engine.abort("queued")
    run_to_completion(engine)
