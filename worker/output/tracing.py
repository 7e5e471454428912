"""OpenTelemetry: one span per output batch, linked to the trace context of each keyword in it.

Only when otel_exporter_otlp_endpoint is set; the OpenTelemetry SDK (the `otel` extra) is
imported then, never on the default path. A batch holds keywords of many traces, so its span
cannot be a child of all of them: it starts a trace of its own and carries one link per keyword
that came with a valid traceparent (the OpenTelemetry convention for batch processing; Redpanda
Connect does the same). Each embedding's own traceparent (worker/formats/propagation.py) stays in
its keyword's trace.

Threads: `BatchSpans.record` runs on the output thread; the SDK's BatchSpanProcessor exports from
its own thread, with a bounded queue (a slow or absent collector drops spans, never stalls the
worker). `close` runs once, at shutdown, bounded by its timeout. The tracer provider is the
worker's own, not the SDK's global one.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from worker.core.errors import extra_missing
from worker.formats.propagation import TraceParent
from worker.settings.schema import SettingsError

SPAN_NAME = "keyword-embedder embed"
# Links per span: the OpenTelemetry SDK's default limit (OTEL_SPAN_LINK_COUNT_LIMIT) is 128;
# a batch is at most the largest bucket size.
MAX_LINKS = 1024


class BatchSpans:
    """Records one finished span per batch on a tracer of the worker's own provider."""

    def __init__(self, provider: Any, attributes: dict[str, Any] | None = None) -> None:
        from opentelemetry.trace import Link, SpanContext, TraceFlags

        self._provider = provider
        self._tracer = provider.get_tracer("keyword-embedder")
        self._attributes = attributes or {}
        self._Link, self._SpanContext, self._TraceFlags = Link, SpanContext, TraceFlags

    def record(self, parents: Sequence[TraceParent], *, size: int, start_ns: int, end_ns: int,
               cached: bool = False, attributes: dict[str, Any] | None = None) -> None:
        """One span for a batch of `size` embeddings produced between start_ns and end_ns (epoch ns),
        linked to `parents` (the keywords' contexts; keywords without one have none)."""
        links = [self._Link(self._SpanContext(trace_id=int(p.trace_id, 16), span_id=int(p.span_id, 16),
                                              is_remote=True, trace_flags=self._TraceFlags(int(p.flags, 16))))
                 for p in parents[:MAX_LINKS]]
        span = self._tracer.start_span(SPAN_NAME, links=links, start_time=start_ns, attributes={
            **self._attributes, **(attributes or {}), "kwe.batch.size": size, "kwe.batch.cached": cached,
            "kwe.batch.linked": len(links)})
        span.end(end_time=end_ns)

    def close(self, timeout_s: float = 2.0) -> None:
        """Exports what is queued (within timeout_s) and stops the exporter thread."""
        self._provider.force_flush(int(timeout_s * 1000))
        self._provider.shutdown()


def batch_spans(endpoint: str, *, model: str, exporter: Any = None, service_name: str = "keyword-embedder") -> BatchSpans:
    """A BatchSpans exporting over OTLP/HTTP to `endpoint` (the collector's base URL; /v1/traces is
    added unless the URL has a path), or to `exporter` (tests pass an in-memory one)."""
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import SpanLimits, TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError as exc:
        raise SettingsError(extra_missing("otel", "otel_exporter_otlp_endpoint (span export)",
                                          exc.name or str(exc))) from None
    if exporter is None:
        from urllib.parse import urlsplit

        url = endpoint if urlsplit(endpoint).path not in ("", "/") else endpoint.rstrip("/") + "/v1/traces"
        exporter = OTLPSpanExporter(endpoint=url, timeout=5)
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}),
                              span_limits=SpanLimits(max_links=MAX_LINKS))
    provider.add_span_processor(BatchSpanProcessor(exporter, max_queue_size=2048, schedule_delay_millis=1000))
    return BatchSpans(provider, {"kwe.model": model})


def epoch_ns(monotonic_s: float) -> int:
    """A time.monotonic() reading as Unix epoch nanoseconds (what span timestamps are)."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)
