"""OpenTelemetry spans, one per generation request (`--otlp-traces-endpoint`; needs `pip install 'pagedserve[otel]'`).

Only server/tracing.py imports this module, and only when tracing is on: a server without the flag never loads the
SDK or the exporter. The span is a SERVER span from the request's arrival to its last byte, a child of the caller's
trace when the request carries a W3C `traceparent`. Its attributes use the OpenTelemetry GenAI names where they
exist (`gen_ai.usage.input_tokens`, ...) and vLLM's where they do not (`gen_ai.request.id`,
`gen_ai.latency.time_to_first_token`, ...; vLLM's `gen_ai.usage.prompt_tokens` / `completion_tokens` too, so its
dashboards read ours). Each engine request (one per choice) adds child spans `queued`, `prefill` and `decode`: their
lengths are the engine's stamps (RequestMetrics), placed where this process saw the first token arrive, so a
replica on another host needs no common clock. Spans are exported in batches on the SDK's thread, never on the
event loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:  # server/tracing.py imports this module when tracing is on
    from .tracing import ChoiceRecord, RequestRecord

SCOPE = "pagedserve.server"


class Tracing:
    """A tracer of our own (the global provider is left to the application around us): OTLP over HTTP to
    `endpoint`, batched; or, in tests, each span handed to `exporter` as it ends."""

    def __init__(self, endpoint: str | None = None, exporter: SpanExporter | None = None) -> None:
        resource = Resource.create()  # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES, when set, name the service
        if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
            resource = resource.merge(Resource({SERVICE_NAME: "pagedserve"}))
        self.provider = TracerProvider(resource=resource)
        # OTEL_EXPORTER_OTLP_HEADERS, _TIMEOUT, _CERTIFICATE ... configure the exporter as usual
        self.provider.add_span_processor(SimpleSpanProcessor(exporter) if exporter is not None
                                         else BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self.tracer = self.provider.get_tracer(SCOPE)
        self.propagator = TraceContextTextMapPropagator()

    def start(self, record: RequestRecord, operation: str, headers: dict[bytes, bytes]) -> Span:
        """The request's span, begun at its arrival; `headers`: its trace-context headers."""
        parent = self.propagator.extract({k.decode("latin-1"): v.decode("latin-1") for k, v in headers.items()})
        span = self.tracer.start_span(f"{operation} {record.model}" if record.model else operation, context=parent,
                                      kind=SpanKind.SERVER, start_time=record.start_ns)
        span.set_attributes({"gen_ai.operation.name": operation, "gen_ai.request.id": record.request_id,
                             "http.request.method": record.method, "url.path": record.path})
        if record.model:
            span.set_attributes({"gen_ai.request.model": record.model, "gen_ai.response.model": record.model})
        return span

    def end(self, span: Span, record: RequestRecord, end_ns: int) -> None:
        """The request's results and phases, then the span's end."""
        if record.status is not None:
            span.set_attribute("http.response.status_code", record.status)
            if record.status >= 500:  # a server span's 4xx is the client's error, not ours
                span.set_status(Status(StatusCode.ERROR))
                span.set_attribute("error.type", str(record.status))
        if record.response_id is not None:
            span.set_attribute("gen_ai.response.id", record.response_id)
        if (u := record.usage) is not None:
            cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
            span.set_attributes({"gen_ai.usage.input_tokens": u.prompt_tokens,
                                 "gen_ai.usage.output_tokens": u.completion_tokens,
                                 "gen_ai.usage.cache_read.input_tokens": cached,
                                 "gen_ai.usage.prompt_tokens": u.prompt_tokens,
                                 "gen_ai.usage.completion_tokens": u.completion_tokens,
                                 "gen_ai.usage.num_sequences": len(record.choices)})
        if record.choices:
            span.set_attribute("gen_ai.response.finish_reasons", [str(c.finish_reason) for c in record.choices])
            metrics = [c.metrics for c in record.choices if c.metrics is not None]
            if queued := [m.queue_time for m in metrics if m.queue_time is not None]:
                span.set_attribute("gen_ai.latency.time_in_queue", max(queued))
            if ttft := [m.ttft for m in metrics if m.ttft is not None]:
                span.set_attribute("gen_ai.latency.time_to_first_token", min(ttft))
        span.set_attribute("gen_ai.latency.e2e", (end_ns - record.start_ns) / 1e9)
        context = trace.set_span_in_context(span)
        for i, choice in enumerate(record.choices):
            self.phases(context, i, choice, record.start_ns, end_ns)
        span.end(end_time=end_ns)

    def phases(self, context, index: int, c: ChoiceRecord, lo: int, hi: int) -> None:
        """`queued` (arrival to first scheduled), `prefill` (to the first token) and `decode` (to the finish, or the
        last output seen) for one engine request: those it reached, within the request's span."""
        m = c.metrics
        if m is None:
            return
        stamps = [c.wall_ns(m.arrival_time), c.wall_ns(m.first_scheduled_time), c.wall_ns(m.first_token_time),
                  c.wall_ns(m.finish_time) if m.finish_time is not None else c.last_ns]
        attrs = {"pagedserve.engine_request_id": c.engine_id, "pagedserve.choice": index}
        extra = {"prefill": {"gen_ai.usage.cache_read.input_tokens": c.cached_tokens},
                 "decode": {"gen_ai.usage.output_tokens": c.completion_tokens}}
        for name, start, stop in zip(("queued", "prefill", "decode"), stamps, stamps[1:]):
            if start is None or stop is None:
                continue
            start = min(max(start, lo), hi)  # a wall clock stepped under us must not put a phase outside
            phase = self.tracer.start_span(name, context=context, start_time=start,
                                           attributes={**attrs, **extra.get(name, {})})
            phase.end(end_time=min(max(stop, start), hi))

    def shutdown(self) -> None:
        """Exports what is still batched."""
        self.provider.shutdown()
