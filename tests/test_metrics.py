"""server/metrics.py without a server: what each step's outputs add to vLLM's counters and histograms, the engine
gauges read at scrape time (one engine, or a fleet labelled by replica), and which refusals count as overload."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from pagedserve.engine.llm_engine import EngineStats
from pagedserve.engine.output_processor import RequestMetrics, RequestOutput
from pagedserve.engine.spec_decode.speculator import SpecStats
from pagedserve.server.metrics import Metrics


def samples(m: Metrics) -> dict[tuple, float]:
    """(sample name, sorted labels) -> value, from the rendered exposition."""
    out = {}
    for family in text_string_to_metric_families(m.render().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def output(rid: str, tokens: list[int], finished: bool = False, prompt: int = 10, cached: int = 4,
           reason: str | None = None) -> RequestOutput:
    metrics = RequestMetrics(arrival_time=100.0, first_scheduled_time=100.5, first_token_time=101.0,
                             finish_time=103.0 if finished else None)
    return RequestOutput(rid, tokens, "", finished, reason, prompt, len(tokens), cached, metrics)


STATS = EngineStats(num_running=2, num_waiting=3, kv_cache_usage=0.25, num_preemptions=1, prefix_cache_queries=40,
                    prefix_cache_hits=16, spec_decode=None)
M = (("model_name", "m"),)


def k(name: str, **labels: str) -> tuple:
    return name, tuple(sorted({"model_name": "m", **labels}.items()))


def test_tokens_latencies_and_finishes_per_request():
    m = Metrics("m", lambda: None)
    m.observe([output("a", [1]), output("b", [7, 8])])  # both requests' first outputs
    m.observe([output("a", [2, 3]), output("b", [], finished=True, reason="stop")])
    m.observe([output("a", [4], finished=True, reason="length")])
    s = samples(m)
    assert s[("vllm:generation_tokens_total", M)] == 6
    assert s[("vllm:prompt_tokens_total", M)] == 2 * (10 - 4)  # once per request, cached tokens not counted
    assert s[("vllm:time_to_first_token_seconds_count", M)] == 2
    assert s[("vllm:time_to_first_token_seconds_sum", M)] == 2 * 1.0
    assert s[("vllm:inter_token_latency_seconds_count", M)] == 2  # a's 2nd and 3rd outputs; b's last had no token
    assert s[("vllm:e2e_request_latency_seconds_count", M)] == 2
    assert s[("vllm:e2e_request_latency_seconds_sum", M)] == 2 * 3.0
    assert s[("vllm:request_queue_time_seconds_sum", M)] == 2 * 0.5
    assert s[k("vllm:request_success_total", finished_reason="length")] == 1
    assert s[k("vllm:request_success_total", finished_reason="stop")] == 1
    assert m._last_token == {}  # nothing kept per finished request


def test_a_reused_id_starts_a_new_request():
    m = Metrics("m", lambda: None)
    m.observe([output("a", [1], finished=True, reason="stop")])
    m.observe([output("a", [1])])
    s = samples(m)
    assert s[("vllm:time_to_first_token_seconds_count", M)] == 2 and s[("vllm:prompt_tokens_total", M)] == 12
    assert s.get(("vllm:inter_token_latency_seconds_count", M), 0) == 0


def test_rejections_by_reason_and_which_are_overload():
    m = Metrics("m", lambda: None)
    for reason in ("queue_full", "queue_wait", "queue_wait", "context_length"):
        m.reject(reason)
    s = samples(m)
    assert s[k("pagedserve:rejected_requests_total", reason="queue_wait")] == 2
    assert s[k("pagedserve:rejected_requests_total", reason="context_length")] == 1
    assert m.num_overloaded == 3  # the 429s: a full queue or a wait too long, not a bad request


def test_engine_gauges_are_read_at_scrape_time():
    current = {"stats": None}
    m = Metrics("m", lambda: current["stats"])
    assert not any(name.startswith("vllm:num_requests") for name, _ in samples(m))  # no engine yet: no gauges
    current["stats"] = STATS
    s = samples(m)
    assert s[("vllm:num_requests_running", M)] == 2 and s[("vllm:num_requests_waiting", M)] == 3
    assert s[("vllm:kv_cache_usage_perc", M)] == 0.25
    assert s[("vllm:num_preemptions_total", M)] == 1
    assert s[("vllm:prefix_cache_hits_total", M)] == 16 and s[("vllm:prefix_cache_queries_total", M)] == 40
    assert not any(name.startswith("vllm:spec_decode") for name, _ in s)  # only with speculative decoding on


def test_a_fleet_is_labelled_by_replica_under_the_same_names():
    other = EngineStats(0, 1, 0.5, 0, 0, 0, None)
    s = samples(Metrics("m", lambda: {"r2": other, "r1": STATS}))
    assert s[k("vllm:num_requests_waiting", replica="r1")] == 3
    assert s[k("vllm:num_requests_waiting", replica="r2")] == 1


def test_speculative_counters_by_position():
    spec = SpecStats(num_drafts=4, num_draft_tokens=10, num_accepted_tokens=6, accepted_per_pos=[4, 2])
    s = samples(Metrics("m", lambda: EngineStats(0, 0, 0.0, 0, 0, 0, spec)))
    assert s[("vllm:spec_decode_num_draft_tokens_total", M)] == 10
    assert s[("vllm:spec_decode_num_accepted_tokens_total", M)] == 6
    assert s[k("vllm:spec_decode_num_accepted_tokens_per_pos_total", position="1")] == 2
