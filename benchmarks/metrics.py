"""Serving-benchmark metrics with vLLM's `bench serve` definitions. Pure: no I/O, no clock.

All times in a `RequestRecord` are seconds since the benchmark started; reported latencies are ms.

- TTFT: send -> first chunk with non-empty content.
- TPOT: (E2E - TTFT) / (n_out - 1), i.e. excluding the first token; undefined for n_out <= 1.
- ITL:  gaps between consecutive content chunks (pooled over all requests; a chunk may hold >1 token).
- E2EL: send -> end of stream.
Throughputs divide by the benchmark's wall duration and count successful requests only.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

SLO_KEYS = ("ttft", "tpot", "e2el")
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
STATS = ("mean", "median", "std", "p90", "p99")


@dataclass(slots=True)
class RequestRecord:
    index: int
    max_tokens: int = 0                 # output length asked for
    send_time: float | None = None      # first attempt (a retried 429 keeps its original send time)
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk with content
    end_time: float | None = None       # end of stream (or of the failed response)
    n_in: int = 0                       # prompt tokens (server usage, else an estimate)
    n_out: int = 0                      # output tokens (server usage, else the number of content chunks)
    usage: bool = False                 # True when n_in/n_out came from the server's `usage`
    ok: bool = False
    status: int | None = None           # final HTTP status; None when no response came back
    error: str = ""
    num_429: int = 0                    # 429 responses seen, retries included
    cancelled: bool = False             # still outstanding when --max-duration ran out: its own outcome

    @property
    def first_token_time(self) -> float | None:
        return self.chunk_times[0] if self.chunk_times else None

    @property
    def rejected(self) -> bool:
        """Turned away by admission control (HTTP 429): a counted outcome, not a failure of the bench. One
        cancelled while it waited to retry a 429 counts as cancelled."""
        return not self.ok and self.status == 429 and not self.cancelled

    @property
    def failed(self) -> bool:
        """Neither served, nor turned away (429), nor cancelled by the bench at --max-duration: the server failed
        it (an HTTP error, an error event, a broken stream or connection)."""
        return not self.ok and not self.rejected and not self.cancelled

    @property
    def ttft(self) -> float | None:
        if self.send_time is None or not self.chunk_times:
            return None
        return self.chunk_times[0] - self.send_time

    @property
    def e2e(self) -> float | None:
        if self.send_time is None or self.end_time is None:
            return None
        return self.end_time - self.send_time

    @property
    def tpot(self) -> float | None:
        ttft, e2e = self.ttft, self.e2e
        if ttft is None or e2e is None or self.n_out <= 1:
            return None
        return (e2e - ttft) / (self.n_out - 1)

    @property
    def itls(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    def to_dict(self) -> dict[str, Any]:
        def ms(x: float | None) -> float | None:
            return None if x is None else round(x * 1000, 3)

        def r6(x: float | None) -> float | None:
            return None if x is None else round(x, 6)

        return {"index": self.index, "ok": self.ok, "status": self.status, "error": self.error,
                "rejected": self.rejected, "cancelled": self.cancelled, "num_429": self.num_429,
                "n_in": self.n_in, "n_out": self.n_out, "max_tokens": self.max_tokens, "usage": self.usage,
                "send_time": r6(self.send_time), "first_token_time": r6(self.first_token_time),
                "end_time": r6(self.end_time), "chunk_times": [round(t, 6) for t in self.chunk_times],
                "ttft_ms": ms(self.ttft), "tpot_ms": ms(self.tpot), "e2el_ms": ms(self.e2e)}


def percentile(values: Iterable[float], q: float) -> float | None:
    """q-th percentile with linear interpolation between closest ranks (numpy's default method)."""
    xs = sorted(values)
    if not xs:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values: Sequence[float]) -> dict[str, float | None]:
    """mean, median, std (population, like np.std), p90, p99 — all None for an empty sample."""
    if not values:
        return dict.fromkeys(STATS)
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
    return {"mean": mean, "median": percentile(values, 50), "std": std,
            "p90": percentile(values, 90), "p99": percentile(values, 99)}


def meets_slos(rec: RequestRecord, slos: dict[str, float]) -> bool:
    """All SLOs (ms) met. Undefined TPOT (n_out <= 1) passes, as in vLLM; undefined TTFT/E2E fails."""
    if not rec.ok:
        return False
    values = {"ttft": rec.ttft, "tpot": rec.tpot, "e2el": rec.e2e}
    for key, limit_ms in slos.items():
        v = values[key]
        if v is None:
            if key == "tpot":
                continue
            return False
        if v * 1000 > limit_ms:
            return False
    return True


def max_concurrency_seen(records: Iterable[RequestRecord]) -> int:
    """Most requests in flight at once (send -> end), from the records' own timestamps."""
    events = []
    for r in records:
        if r.send_time is not None and r.end_time is not None:
            events += [(r.send_time, 1), (r.end_time, -1)]
    events.sort(key=lambda e: (e[0], e[1]))  # at equal times an end (-1) is processed before a start
    peak = cur = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return peak


def compute_metrics(records: Sequence[RequestRecord], duration: float,
                    slos: dict[str, float] | None = None) -> dict[str, Any]:
    """Every metric of one run; latency keys are `{mean,median,std,p90,p99}_{ttft,tpot,itl,e2el}_ms`."""
    if duration <= 0:
        raise ValueError("duration must be positive")
    good = [r for r in records if r.ok]
    rejected = [r for r in records if r.rejected]
    samples = {
        "ttft": [r.ttft for r in good if r.ttft is not None],
        "tpot": [r.tpot for r in good if r.tpot is not None],
        "itl": [gap for r in good for gap in r.itls],
        "e2el": [r.e2e for r in good if r.e2e is not None],
    }
    total_in = sum(r.n_in for r in good)
    total_out = sum(r.n_out for r in good)
    out: dict[str, Any] = {
        "num_requests": len(records),
        "completed": len(good),
        "failed": sum(r.failed for r in records),
        "rejected_429": len(rejected),
        "http_429_responses": sum(r.num_429 for r in records),
        "cancelled": sum(r.cancelled and not r.ok for r in records),  # outcomes: completed, failed, 429, cancelled
        "duration": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(good) / duration,
        "request_goodput": None,
        "goodput_slos_ms": dict(slos) if slos else None,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "max_concurrent_requests": max_concurrency_seen(records),
        "requests_without_usage": sum(not r.usage for r in good),
    }
    if slos:
        out["request_goodput"] = sum(meets_slos(r, slos) for r in good) / duration
    for name in LATENCY_METRICS:
        for stat, value in summarize(samples[name]).items():
            out[f"{stat}_{name}_ms"] = None if value is None else value * 1000
    return out


def find_knee(points: Sequence[dict[str, Any]], factor: float = 2.0, floor_ms: float = 1.0) -> int | None:
    """Index of the knee of a sweep whose points are in order of increasing load.

    The knee is the last point before the first *jump*: p99 TTFT or p99 TPOT growing by more than
    `factor` x from one point to the next (and by more than `floor_ms`, so sub-millisecond timer noise
    on an idle server is not a jump). A point with no successful request is a jump. No jump at all:
    the knee is the last point (the sweep never saturated the server).
    """
    if not points:
        return None
    for i in range(1, len(points)):
        prev, cur = points[i - 1], points[i]
        if not cur.get("completed"):
            return i - 1
        for key in ("p99_ttft_ms", "p99_tpot_ms"):
            a, b = prev.get(key), cur.get(key)
            if a is not None and b is not None and b > factor * a and b - a > floor_ms:
                return i - 1
    return len(points) - 1


def best_point(points: Sequence[dict[str, Any]]) -> int | None:
    """Index of the max-goodput point when SLOs were given, else of the max output-throughput point."""
    if not points:
        return None
    key = "request_goodput" if points[0].get("request_goodput") is not None else "output_throughput"
    return max(range(len(points)), key=lambda i: points[i].get(key) or 0.0)


def _fmt(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return "inf" if math.isinf(value) else f"{value:.2f}"
    return str(value)


def format_table(m: dict[str, Any], header: Sequence[tuple[str, Any]] = ()) -> str:
    """vLLM's `bench serve` result layout (40-column labels), preceded by `header` (label, value) rows."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label: str, value: Any) -> None:
        lines.append(f"{label:<40} {_fmt(value)}")

    for label, value in header:
        row(label + ":", value)
    row("Successful requests:", m["completed"])
    row("Failed requests:", m["failed"])
    row("Rejected requests (HTTP 429):", m["rejected_429"])
    if m["http_429_responses"] != m["rejected_429"]:
        row("HTTP 429 responses (incl. retried):", m["http_429_responses"])
    row("Cancelled requests (--max-duration):", m["cancelled"])
    row("Benchmark duration (s):", m["duration"])
    row("Total input tokens:", m["total_input_tokens"])
    row("Total generated tokens:", m["total_output_tokens"])
    row("Request throughput (req/s):", m["request_throughput"])
    if m["request_goodput"] is not None:
        row("Request goodput (req/s):", m["request_goodput"])
    row("Output token throughput (tok/s):", m["output_throughput"])
    row("Peak concurrent requests:", m["max_concurrent_requests"])
    row("Total Token throughput (tok/s):", m["total_token_throughput"])
    for title, short, key in (("Time to First Token", "TTFT", "ttft"),
                              ("Time per Output Token (excl. 1st token)", "TPOT", "tpot"),
                              ("Inter-token Latency", "ITL", "itl"),
                              ("End-to-end Latency", "E2EL", "e2el")):
        lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        for stat, label in (("mean", "Mean"), ("median", "Median"), ("p90", "P90"), ("p99", "P99")):
            row(f"{label} {short} (ms):", m[f"{stat}_{key}_ms"])
    spec = m.get("spec_decode")
    if spec:
        lines.append("{s:{c}^{n}}".format(s="Speculative Decoding", n=50, c="-"))
        row("Acceptance rate (%):", None if spec["acceptance_rate"] is None else 100 * spec["acceptance_rate"])
        row("Acceptance length:", spec["mean_acceptance_length"])
        row("Drafts:", spec["num_drafts"])
        row("Draft tokens:", spec["num_draft_tokens"])
        row("Accepted tokens:", spec["num_accepted_tokens"])
        if spec["acceptance_per_position"]:
            row("Per-position acceptance rate:", ", ".join(
                "-" if x is None else f"{x:.2f}" for x in spec["acceptance_per_position"]))
    lines.append("=" * 50)
    if m["requests_without_usage"]:
        lines.append(f"Note: {m['requests_without_usage']} of {m['completed']} successful requests had no "
                     "`usage` in the stream; their output tokens were counted as content chunks and "
                     "their input tokens estimated from the prompt's words.")
    return "\n".join(lines)
