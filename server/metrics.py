"""Prometheus metrics under vLLM's names, so existing dashboards work unchanged."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from functools import partial

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..engine.llm_engine import EngineStats
from ..engine.output_processor import RequestOutput

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0)


class _EngineCollector:
    """Gauges and counters read at scrape time from `EngineClient.stats()`: one engine's, or a fleet's (replica id ->
    stats), which adds a `replica` label and keeps the names, so a dashboard sums or splits as it likes."""

    def __init__(self, stats: Callable[[], EngineStats | Mapping[str, EngineStats] | None], model_name: str) -> None:
        self.stats = stats
        self.model_name = model_name

    def collect(self):
        snap = self.stats()
        if snap is None:
            return
        if isinstance(snap, EngineStats):
            labels, rows = ["model_name"], [([self.model_name], snap)]
        else:
            labels, rows = ["model_name", "replica"], [([self.model_name, r], s) for r, s in sorted(snap.items())]
        for name, doc, kind, field in (
            ("vllm:num_requests_running", "Requests in the running batch.", GaugeMetricFamily, "num_running"),
            ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", GaugeMetricFamily, "num_waiting"),
            ("vllm:kv_cache_usage_perc", "KV-cache usage, 0 to 1 (1 = every block in use).", GaugeMetricFamily,
             "kv_cache_usage"),
            ("vllm:num_preemptions", "Preemptions (blocks ran out; the request is recomputed).", CounterMetricFamily,
             "num_preemptions"),
            ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", CounterMetricFamily,
             "prefix_cache_queries"),
            ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", CounterMetricFamily,
             "prefix_cache_hits"),
        ):
            m = kind(name, doc, labels=labels)
            for values, s in rows:
                m.add_metric(values, getattr(s, field))
            yield m
        spec = snap.spec_decode if isinstance(snap, EngineStats) else None
        if spec is not None:  # only when speculative decoding is on, as in vLLM
            yield from _spec_metrics(spec, self.model_name)


def _spec_metrics(spec, model_name: str):
    for name, doc, value in (
        ("vllm:spec_decode_num_drafts", "Verification passes that had draft tokens.", spec.num_drafts),
        ("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed and verified.", spec.num_draft_tokens),
        ("vllm:spec_decode_num_accepted_tokens", "Draft tokens the target accepted.", spec.num_accepted_tokens),
    ):
        c = CounterMetricFamily(name, doc, labels=["model_name"])
        c.add_metric([model_name], value)
        yield c
    c = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                            "Accepted draft tokens by position in the draft (0 = first).",
                            labels=["model_name", "position"])
    for pos, value in enumerate(spec.accepted_per_pos):
        c.add_metric([model_name, str(pos)], value)
    yield c


class Metrics:
    def __init__(self, model_name: str, stats: Callable[[], EngineStats | Mapping[str, EngineStats] | None]) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r, m = self.registry, ["model_name"]
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed.", m, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", m, registry=r)
        self.request_success = Counter("vllm:request_success", "Finished requests by reason.",
                                       m + ["finished_reason"], registry=r)
        self.rejected = Counter("pagedserve:rejected_requests", "Requests refused before running, by reason.",
                                m + ["reason"], registry=r)
        self.requests = Counter("pagedserve:http_requests", "Requests to the API's routes (each dialect's "
                                "endpoint apart), by route and status code.", m + ["endpoint", "status"], registry=r)
        latency = partial(Histogram, labelnames=m, buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = latency("vllm:time_to_first_token_seconds", "Time to first token.")
        self.itl = latency("vllm:inter_token_latency_seconds", "Time between consecutive tokens.")
        self.e2e = latency("vllm:e2e_request_latency_seconds", "Arrival to finish.")
        self.queue_time = latency("vllm:request_queue_time_seconds", "Arrival to first scheduled.")
        r.register(_EngineCollector(stats, model_name))
        self.num_overloaded = 0  # 429s issued (queue full, or too late to start), for the live view without a scrape
        self._last_token: dict[str, float] = {}

    def observe(self, outputs: list[RequestOutput]) -> None:
        """Called on the event loop with each engine step's outputs."""
        now = time.monotonic()
        name = self.model_name
        for out in outputs:
            rid = out.request_id
            if out.new_token_ids:
                self.generation_tokens.labels(name).inc(len(out.new_token_ids))
                last = self._last_token.get(rid)
                if last is None:
                    self.prompt_tokens.labels(name).inc(out.num_prompt_tokens - out.num_cached_tokens)
                    if out.metrics.ttft is not None:
                        self.ttft.labels(name).observe(out.metrics.ttft)
                else:
                    self.itl.labels(name).observe(now - last)
                self._last_token[rid] = now
            if out.finished:
                self._last_token.pop(rid, None)
                self.request_success.labels(name, out.finish_reason).inc()
                m = out.metrics
                if m.finish_time is not None:
                    self.e2e.labels(name).observe(m.finish_time - m.arrival_time)
                if m.queue_time is not None:
                    self.queue_time.labels(name).observe(m.queue_time)

    def request(self, endpoint: str, status: int | None) -> None:
        """An HTTP request to `endpoint` (a route's path) answered with `status` (None: no answer was sent)."""
        self.requests.labels(self.model_name, endpoint, str(status or "none")).inc()

    def reject(self, reason: str) -> None:
        self.rejected.labels(self.model_name, reason).inc()
        if reason in ("queue_full", "queue_wait"):
            self.num_overloaded += 1

    def render(self) -> bytes:
        return generate_latest(self.registry)
