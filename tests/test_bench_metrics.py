"""Metric math of the serving benchmark on synthetic timestamps (no server, no clock)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from pagedserve.benchmarks.metrics import (
    LATENCY_METRICS,
    STATS,
    RequestRecord,
    best_point,
    compute_metrics,
    find_knee,
    format_table,
    max_concurrency_seen,
    meets_slos,
    percentile,
    summarize,
)


def ok_record(index: int, send: float, chunks: list[float], n_out: int | None = None, n_in: int = 10,
              end: float | None = None) -> RequestRecord:
    return RequestRecord(index=index, send_time=send, chunk_times=list(chunks),
                         end_time=chunks[-1] if end is None else end, n_in=n_in,
                         n_out=len(chunks) if n_out is None else n_out, usage=True, ok=True, status=200)


def test_ttft_tpot_exclude_first_token() -> None:
    # first token after 100 ms, then 3 more tokens 20 ms apart: TPOT is 20 ms, not (160 ms / 4)
    r = ok_record(0, send=1.0, chunks=[1.10, 1.12, 1.14, 1.16])
    assert r.ttft == pytest.approx(0.10)
    assert r.e2e == pytest.approx(0.16)
    assert r.tpot == pytest.approx(0.02)
    assert r.first_token_time == pytest.approx(1.10)


def test_tpot_uses_token_count_not_chunk_count() -> None:
    # 2 chunks carrying 5 tokens (a server that batches tokens per chunk): TPOT = (E2E - TTFT) / 4
    r = ok_record(0, send=0.0, chunks=[0.1, 0.5], n_out=5)
    assert r.tpot == pytest.approx(0.4 / 4)
    assert r.itls == pytest.approx([0.4])


def test_tpot_undefined_for_one_token() -> None:
    r = ok_record(0, send=0.0, chunks=[0.05], n_out=1, end=0.06)
    assert r.tpot is None
    m = compute_metrics([r, ok_record(1, 0.0, [0.1, 0.13, 0.16])], duration=1.0)
    assert m["mean_tpot_ms"] == pytest.approx(30.0)  # only the second request has a TPOT
    assert m["mean_ttft_ms"] == pytest.approx(75.0)  # both have a TTFT


def test_itl_pooled_over_requests() -> None:
    a = ok_record(0, 0.0, [0.1, 0.2, 0.4])      # gaps 100, 200 ms
    b = ok_record(1, 0.0, [0.5, 0.8])           # gap 300 ms
    m = compute_metrics([a, b], duration=1.0)
    assert m["mean_itl_ms"] == pytest.approx(200.0)
    assert m["median_itl_ms"] == pytest.approx(200.0)
    assert m["p99_itl_ms"] == pytest.approx(np.percentile([100, 200, 300], 99))


@pytest.mark.parametrize("n", [1, 2, 7, 100, 1001])
def test_percentile_matches_numpy(n: int) -> None:
    rng = random.Random(n)
    xs = [rng.expovariate(1.0) for _ in range(n)]
    for q in (0, 1, 25, 50, 90, 99, 99.9, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    s = summarize(xs)
    assert s["mean"] == pytest.approx(float(np.mean(xs)))
    assert s["median"] == pytest.approx(float(np.median(xs)))
    assert s["std"] == pytest.approx(float(np.std(xs)))


def test_percentile_edges() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0  # unsorted input
    assert percentile([1.0, 2.0], 50) == 1.5       # interpolates
    with pytest.raises(ValueError):
        percentile([1.0], 101)
    assert summarize([]) == dict.fromkeys(STATS)


def test_throughputs() -> None:
    recs = [ok_record(i, 0.0, [0.1 * (i + 1)], n_out=n, n_in=5) for i, n in enumerate((10, 20, 30))]
    m = compute_metrics(recs, duration=2.0)
    assert m["completed"] == 3 and m["failed"] == 0 and m["num_requests"] == 3
    assert m["total_input_tokens"] == 15 and m["total_output_tokens"] == 60
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(30.0)
    assert m["total_token_throughput"] == pytest.approx(37.5)
    assert m["request_goodput"] is None  # no SLOs given


def test_429_is_a_rejection_not_a_failure() -> None:
    recs = [
        ok_record(0, 0.0, [0.1, 0.2]),
        RequestRecord(index=1, send_time=0.0, end_time=0.01, status=429, error="overloaded", num_429=1),
        RequestRecord(index=2, send_time=0.0, end_time=0.02, status=500, error="HTTP 500: boom"),
        RequestRecord(index=3, send_time=0.0, end_time=0.5, status=200, error="cancelled", cancelled=True),
        RequestRecord(index=4, status=None, cancelled=True),  # never sent before --max-duration
        # retried twice after 429s, then succeeded: counted in the 429 responses, not as a rejection
        RequestRecord(index=5, send_time=0.0, chunk_times=[2.1, 2.2], end_time=2.2, n_out=2, ok=True,
                      status=200, num_429=2, usage=True),
    ]
    m = compute_metrics(recs, duration=4.0)
    assert (m["completed"], m["failed"], m["rejected_429"], m["cancelled"]) == (2, 1, 1, 2)
    assert m["http_429_responses"] == 3
    assert m["completed"] + m["failed"] + m["rejected_429"] + m["cancelled"] == m["num_requests"]
    assert m["total_output_tokens"] == 4  # failed/rejected requests add no tokens
    assert recs[1].rejected and not recs[2].rejected


def test_cancelled_at_max_duration_is_not_a_failure() -> None:
    """The bench stopped them, the server did not fail them: their own count, in the JSON and the table. One
    cancelled while it waited to retry a 429 is cancelled, not rejected."""
    recs = [ok_record(0, 0.0, [0.1, 0.2]),
            RequestRecord(index=1, send_time=0.0, status=200, chunk_times=[0.3], cancelled=True),  # mid-stream
            RequestRecord(index=2, cancelled=True),  # never sent
            RequestRecord(index=3, send_time=0.0, status=429, num_429=1, cancelled=True),  # waiting to retry
            RequestRecord(index=4, send_time=0.0, end_time=0.1, status=503, error="HTTP 503: loading")]
    m = compute_metrics(recs, duration=1.0)
    assert (m["completed"], m["failed"], m["rejected_429"], m["cancelled"]) == (1, 1, 0, 3)
    assert [r.failed for r in recs] == [False, False, False, False, True]
    table = format_table(m).splitlines()
    assert "Failed requests:                         1" in table
    assert "Cancelled requests (--max-duration):     3" in table
    assert "Cancelled requests (--max-duration):     0" in format_table(compute_metrics(recs[:1], 1.0))


def test_goodput() -> None:
    fast = ok_record(0, 0.0, [0.1, 0.12, 0.14])              # TTFT 100, TPOT 20
    slow_first = ok_record(1, 0.0, [0.6, 0.62, 0.64])        # TTFT 600
    slow_decode = ok_record(2, 0.0, [0.1, 0.2, 0.3])         # TPOT 100
    one_token = ok_record(3, 0.0, [0.2], n_out=1)            # TPOT undefined: passes the TPOT SLO
    failed = RequestRecord(index=4, send_time=0.0, end_time=0.1, status=500)
    slos = {"ttft": 500.0, "tpot": 50.0}
    assert [meets_slos(r, slos) for r in (fast, slow_first, slow_decode, one_token, failed)] == \
        [True, False, False, True, False]
    m = compute_metrics([fast, slow_first, slow_decode, one_token, failed], duration=2.0, slos=slos)
    assert m["request_goodput"] == pytest.approx(1.0)
    assert m["goodput_slos_ms"] == slos
    assert meets_slos(slow_decode, {"e2el": 300.0}) and not meets_slos(slow_decode, {"e2el": 299.0})


def test_every_key_present_even_when_nothing_succeeded() -> None:
    m = compute_metrics([RequestRecord(index=0, status=429, num_429=1)], duration=1.0, slos={"ttft": 1.0})
    for name in LATENCY_METRICS:
        for stat in STATS:
            assert m[f"{stat}_{name}_ms"] is None
    assert m["request_goodput"] == 0.0 and m["output_throughput"] == 0.0
    assert "n/a" in format_table(m)  # the table prints missing latencies instead of crashing
    with pytest.raises(ValueError):
        compute_metrics([], duration=0.0)


def test_max_concurrency_seen() -> None:
    recs = [RequestRecord(index=0, send_time=0.0, end_time=1.0),
            RequestRecord(index=1, send_time=0.5, end_time=2.0),
            RequestRecord(index=2, send_time=1.0, end_time=3.0),  # starts exactly when #0 ends
            RequestRecord(index=3)]                               # never sent
    assert max_concurrency_seen(recs) == 2


def _point(conc: int, ttft: float, tpot: float, out: float, completed: int = 8, goodput: float | None = None,
           ) -> dict:
    return {"max_concurrency": conc, "p99_ttft_ms": ttft, "p99_tpot_ms": tpot, "output_throughput": out,
            "completed": completed, "request_goodput": goodput}


def test_find_knee() -> None:
    pts = [_point(1, 50, 10, 100), _point(2, 60, 11, 190), _point(4, 80, 12, 350), _point(8, 400, 13, 380)]
    assert find_knee(pts) == 2           # p99 TTFT 80 -> 400 ms is a >2x jump
    pts[3] = _point(8, 90, 30, 380)
    assert find_knee(pts) == 2           # p99 TPOT 12 -> 30 ms is a >2x jump
    pts[3] = _point(8, 150, 20, 380)
    assert find_knee(pts) == 3           # no jump: the sweep never saturated
    pts[2] = _point(4, 80, 12, 0, completed=0)
    assert find_knee(pts) == 1           # a point where nothing succeeded ends the curve
    assert find_knee([_point(1, 0.2, 0.1, 5), _point(2, 0.9, 0.3, 9)]) == 1  # sub-ms noise is no jump
    assert find_knee([]) is None


def test_best_point() -> None:
    pts = [_point(1, 50, 10, 100, goodput=1.0), _point(2, 60, 11, 190, goodput=3.0),
           _point(4, 900, 30, 350, goodput=2.0)]
    assert best_point(pts) == 1          # max goodput when SLOs were given
    for p in pts:
        p["request_goodput"] = None
    assert best_point(pts) == 2          # else max output throughput


def test_table_layout_like_vllm() -> None:
    recs = [ok_record(i, 0.0, [0.1, 0.15, 0.2]) for i in range(4)]
    recs[0].usage = False
    m = compute_metrics(recs, duration=1.0, slos={"ttft": 500})
    table = format_table(m, [("Maximum request concurrency", 4), ("Request rate configured (RPS)", math.inf)])
    lines = table.splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    for label in ("Successful requests:", "Failed requests:", "Rejected requests (HTTP 429):",
                  "Benchmark duration (s):", "Total input tokens:", "Total generated tokens:",
                  "Request throughput (req/s):", "Request goodput (req/s):",
                  "Output token throughput (tok/s):",
                  "Total Token throughput (tok/s):", "Mean TTFT (ms):", "Median TTFT (ms):", "P99 TTFT (ms):",
                  "Mean TPOT (ms):", "P90 TPOT (ms):", "Mean ITL (ms):", "Mean E2EL (ms):"):
        assert any(line.startswith(label) for line in lines), label
    assert "Successful requests:                     4" in table  # values start at column 41
    assert "Request rate configured (RPS):           inf" in table
    assert "-----Time per Output Token (excl. 1st token)------" in table
    assert "1 of 4 successful requests had no `usage`" in table
