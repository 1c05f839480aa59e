"""Verification keeps the target's distribution; the adaptive γ follows the chapter's formula."""

import math

import pytest
import torch

from pagedserve.engine import LLMEngine, SamplingParams, make_config
from pagedserve.engine.rejection_sampler import verify
from pagedserve.engine.sampler import SampleRequest
from pagedserve.engine.sequence import Sequence
from pagedserve.engine.spec_decode.proposer import NgramProposer
from pagedserve.engine.spec_decode.speculator import best_gamma, expected_tokens, speedup
from pagedserve.engine.step_cost import StepCostModel, StepShape


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Wilson–Hilferty approximation of the chi-square quantile (z = 3.09: p = 0.001)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2_two_sample(a: dict, b: dict) -> tuple[float, int]:
    """Chi-square statistic of two samples over their pooled categories (rare ones merged)."""
    na, nb = sum(a.values()), sum(b.values())
    cats = sorted(set(a) | set(b), key=lambda c: -(a.get(c, 0) + b.get(c, 0)))
    rows, rest = [], [0, 0]
    for c in cats:
        x, y = a.get(c, 0), b.get(c, 0)
        if x + y >= 10:
            rows.append((x, y))
        else:
            rest[0] += x
            rest[1] += y
    if sum(rest) >= 10:
        rows.append(tuple(rest))
    stat = 0.0
    for x, y in rows:
        tot = x + y
        for obs, n in ((x, na), (y, nb)):
            exp = tot * n / (na + nb)
            stat += (obs - exp) ** 2 / exp
    return stat, len(rows) - 1


def reference_probs(logits: list[float], params: SamplingParams, counts: dict[int, int]) -> list[float]:
    """The plain sampler's distribution, written out longhand: penalties, temperature, top-k, then top-p."""
    x = [v - params.frequency_penalty * counts.get(i, 0) - params.presence_penalty * (counts.get(i, 0) > 0)
         for i, v in enumerate(logits)]
    x = [v / params.temperature for v in x]
    order = sorted(range(len(x)), key=lambda i: -x[i])
    keep = order[:params.top_k] if params.top_k > 0 else order
    z = sum(math.exp(x[i]) for i in keep)
    p = {i: math.exp(x[i]) / z for i in keep}
    kept, mass = [], 0.0
    for i in keep:
        if mass >= params.top_p:
            break
        kept.append(i)
        mass += p[i]
    z = sum(p[i] for i in kept)
    return [p[i] / z if i in kept else 0.0 for i in range(len(x))]


def tv(counts: dict[int, int], probs: list[float]) -> float:
    n = sum(counts.values())
    return 0.5 * sum(abs(counts.get(i, 0) / n - p) for i, p in enumerate(probs))


def test_greedy_verification_accepts_the_agreeing_prefix():
    logits = torch.full((4, 10), -5.0)
    for row, tok in enumerate([3, 7, 1, 9]):
        logits[row, tok] = 5.0
    req = SampleRequest(SamplingParams(temperature=0.0), [], None)
    gen = torch.Generator().manual_seed(0)
    assert verify(logits, [3, 7, 1], req, gen) == [3, 7, 1, 9]  # all accepted + bonus
    assert verify(logits, [3, 2, 1], req, gen) == [3, 7]  # stops at the first disagreement
    assert verify(logits, [4, 7, 1], req, gen) == [3]
    assert verify(logits[:1], [], req, gen) == [3]


def test_greedy_verification_applies_penalties_with_the_drafts_counted():
    logits = torch.zeros(3, 5)
    logits[:, 2] = 1.0
    logits[:, 4] = 0.6
    req = SampleRequest(SamplingParams(temperature=0.0, presence_penalty=0.5), [], None)
    # row 0: 2 wins; row 1 counts the draft 2 (1.0 - 0.5 < 0.6): 4 wins; row 2: both penalised, 2 wins again
    assert verify(logits, [2, 4], req, torch.Generator()) == [2, 4, 2]


@pytest.fixture
def one_thread():
    """Thousands of tiny ops: OpenMP hand-offs would dominate on a loaded machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("with_q", [False, True])
def test_rejection_sampling_preserves_the_target_distribution(with_q, one_thread):
    torch.manual_seed(0)
    vocab, n = 6, 8000
    params = SamplingParams(temperature=0.8, top_k=5, top_p=0.95, presence_penalty=0.4, frequency_penalty=0.3)
    history = [1, 1, 2]
    logits = torch.randn(3, vocab) * 1.5
    q = torch.softmax(torch.randn(2, vocab), dim=-1)  # some other model's distribution
    gen = torch.Generator().manual_seed(1)
    req = SampleRequest(params, history, None)
    first: dict[int, int] = {}
    second: dict[int, dict[int, int]] = {}
    counts = {1: 2, 2: 1}
    p1 = reference_probs(logits[0].tolist(), params, counts)
    d1_fixed, d2_fixed = max(range(vocab), key=lambda i: p1[i]), 3
    for _ in range(n):
        if with_q:
            d1 = int(torch.multinomial(q[0], 1, generator=gen))
            d2 = int(torch.multinomial(q[1], 1, generator=gen))
            out = verify(logits, [d1, d2], req, gen, q)
        else:
            d1, d2 = d1_fixed, d2_fixed
            out = verify(logits, [d1, d2], req, gen)
        first[out[0]] = first.get(out[0], 0) + 1
        if len(out) > 1:  # the second token was produced after the first draft was accepted
            second.setdefault(out[0], {})
            second[out[0]][out[1]] = second[out[0]].get(out[1], 0) + 1
    assert tv(first, p1) < 0.025, (first, p1)
    tested = 0
    for tok, sub in second.items():
        if sum(sub.values()) < 800:
            continue
        tested += 1
        c = dict(counts)
        c[tok] = c.get(tok, 0) + 1
        p2 = reference_probs(logits[1].tolist(), params, c)
        assert tv(sub, p2) < 0.06, (tok, sub, p2)
    assert tested  # a draft was accepted often enough to test the position after it


def test_formula_matches_the_chapter():
    # the chapter: at α = 0.9 and γ = 8, 3.40x; at α = 0.3, 0.79x (draft cost c = 0.1 per token)
    assert speedup(0.9, 8, 0.1, 0.0) == pytest.approx(3.40, abs=0.01)
    assert speedup(0.3, 8, 0.1, 0.0) == pytest.approx(0.79, abs=0.01)
    assert expected_tokens(0.3, 8) == pytest.approx(1.43, abs=0.01)
    assert speedup(0.3, 4, 0.2, 0.0) < 0.8  # a fifth of the target's cost at 30 %: slower than no draft
    assert best_gamma(0.3, 8, 0.4, 0.0) == 0  # ... and where no γ pays, speculation switches off
    assert best_gamma(0.9, 8, 0.0, 0.02) == 8
    assert 1 <= best_gamma(0.7, 8, 0.1, 0.05) < 8


def test_extra_token_cost_from_the_engines_step_cost_model():
    """One more verified draft token costs what a prompt token costs, relative to the decodes' own step."""
    m = StepCostModel()
    assert m.extra_token_cost(1, 100) is None  # not fitted: the speculator uses its prior
    for i in range(64):  # 20 ms fixed, 2 ms per multi-token query token, 1 ms per decode
        prefill, decodes = (i % 4) * 3, 1 + i % 5
        m.observe(StepShape(prefill, decodes, 10 * decodes), 20.0 + 2.0 * prefill + 1.0 * decodes)
    assert m.extra_token_cost(1, 10) == pytest.approx(2.0 / 21.0, rel=1e-3)


def test_ngram_proposer_finds_the_longest_latest_match():
    def seq(ids):
        return Sequence(0, "a", ids, SamplingParams(), 10)

    p = NgramProposer(1, 3)
    assert p.propose(seq([1, 2, 3, 4, 5, 9, 1, 2, 3]), 3) == [4, 5, 9]
    assert p.propose(seq([7, 8, 1, 2, 5, 6, 8, 1, 2]), 2) == [5, 6]  # 3-gram 8 1 2 beats the 2-gram
    assert p.propose(seq([1, 2, 3, 4]), 3) == []
    assert p.propose(seq([5, 1, 5, 2, 5]), 2) == [2, 5]  # the latest occurrence wins
    assert NgramProposer(2, 3).propose(seq([5, 1, 5, 2, 5]), 2) == []


def _tiny(**kw) -> LLMEngine:
    """A small random model whose next-token distributions are peaked (random init gives near-uniform ones, on
    which any acceptance rule looks right): the final norm is scaled up, in the draft (same seed) too."""
    engine = LLMEngine(make_config(model="random:tiny", device="cpu", dtype="float32", num_blocks=512, seed=3, **kw))
    models = [engine.runner.model]
    if engine.speculator is not None and hasattr(engine.speculator.proposer, "runner"):
        models.append(engine.speculator.proposer.runner.model)
    with torch.no_grad():
        for m in models:
            m.norm.weight.mul_(30.0)
    return engine


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_sampled_engine_output_matches_plain_sampling(method):
    """Many seeded draws on a small random model: each position's token distribution with speculation
    equals the one without (two-sample chi-square at p = 0.001)."""
    prompt = [5, 6, 7, 8] * 6
    params = dict(max_tokens=6, temperature=1.0, top_k=6, ignore_eos=True)
    n = 400

    def run(engine):
        for i in range(n):
            engine.add_request(str(i), prompt, SamplingParams(seed=i, **params))
        outs = {}
        while engine.has_unfinished():
            for o in engine.step():
                outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        engine.block_manager.check_integrity([])
        assert engine.block_manager.num_used_blocks == 0
        return [outs[str(i)] for i in range(n)]

    plain = run(_tiny())
    spec = _tiny(speculative_method=method, num_speculative_tokens=3, draft_model="random:tiny",
                 draft_dtype="float32", prompt_lookup_min=1)
    spec.speculator.adaptive = False
    drafted = run(spec)
    stats = spec.speculator.stats
    assert stats.num_draft_tokens > 100 and 10 < stats.num_accepted_tokens < stats.num_draft_tokens
    for pos in range(params["max_tokens"]):
        a, b = {}, {}
        for x in plain:
            a[x[pos]] = a.get(x[pos], 0) + 1
        for x in drafted:
            b[x[pos]] = b.get(x[pos], 0) + 1
        stat, df = chi2_two_sample(a, b)
        assert stat < chi2_critical(df), f"position {pos}: chi2 {stat:.1f} on {df} dof"
