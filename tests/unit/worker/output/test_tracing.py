"""One OpenTelemetry span per batch (worker/output/tracing.py): links, attributes, and the OTLP/HTTP export.

The export goes to a local HTTP receiver on loopback that decodes the OTLP protobuf body, so the
bytes a collector would get are checked without a collector. Through the broker and the pipeline:
tests/broker/test_tracing_kafka.py.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk", reason="the otel extra is not installed (pip install -e '.[otel]')")

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from worker.output.tracing import SPAN_NAME, batch_spans  # noqa: E402
from worker.formats.propagation import parse_traceparent  # noqa: E402

PARENTS = [parse_traceparent(f"00-{i:032x}-{i + 100:016x}-01".encode()) for i in range(1, 4)]


def test_a_batch_span_links_every_keywords_context() -> None:
    exporter = InMemorySpanExporter()
    spans = batch_spans("", model="all-MiniLM-L6-v2", exporter=exporter)
    spans.record([p for p in PARENTS if p], size=5, start_ns=1_000, end_ns=9_000, attributes={"kwe.batch.bucket": 16})
    spans.close()
    (span,) = exporter.get_finished_spans()
    assert span.name == SPAN_NAME and (span.start_time, span.end_time) == (1_000, 9_000)
    assert [(link.context.trace_id, link.context.span_id) for link in span.links] == [(i, i + 100) for i in range(1, 4)]
    assert all(link.context.is_remote and link.context.trace_flags.sampled for link in span.links)
    assert span.attributes["kwe.batch.size"] == 5 and span.attributes["kwe.batch.linked"] == 3
    assert span.attributes["kwe.model"] == "all-MiniLM-L6-v2" and span.attributes["kwe.batch.bucket"] == 16
    assert span.context.trace_id not in {1, 2, 3}  # a trace of its own: links, not parents
    assert span.resource.attributes["service.name"] == "keyword-embedder"


class _Receiver(BaseHTTPRequestHandler):
    bodies: list[tuple[str, bytes]] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).bodies.append((self.path, body))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def test_spans_are_exported_over_otlp_http_to_the_endpoint() -> None:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    server = HTTPServer(("127.0.0.1", 0), _Receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        spans = batch_spans(f"http://127.0.0.1:{server.server_port}", model="m")
        spans.record([p for p in PARENTS if p], size=3, start_ns=10, end_ns=20)
        spans.close()
    finally:
        server.shutdown()
        server.server_close()
    (path, body), = _Receiver.bodies
    assert path == "/v1/traces"
    request = ExportTraceServiceRequest.FromString(body)
    (span,) = [s for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans]
    assert span.name == SPAN_NAME and len(span.links) == 3
    assert span.links[0].trace_id == (1).to_bytes(16, "big") and span.links[0].span_id == (101).to_bytes(8, "big")


def test_a_failing_tracer_never_stops_the_output_stage() -> None:
    import numpy as np

    from worker.ledger.inflight import InFlight, InFlightTable
    from worker.output.stage import OutputStage, _Finished
    from worker.formats.headers import InputHeaders
    from worker.ledger.offsets import PartitionOffsets
    from worker.latch import FatalLatch
    from worker.operations.metrics import Metrics

    class Spans:
        calls = 0

        def record(self, *args: Any, **kwargs: Any) -> None:
            type(self).calls += 1
            raise RuntimeError("exporter bug")

    class Producer:
        keys: list[bytes] = []

        def write(self, seq: int, topic: str, key: bytes, value: bytes, headers: Any, on_delivered: Any) -> bool:
            self.keys.append(key)
            return True

    class Acks:
        def embedded(self, seq: int) -> Any:
            return lambda: None

    class Codec:
        headers: list[Any] = []

        def value(self, qid: str, vec: Any, tokens: int, truncated: bool) -> bytes:
            return b"{}"

        def values(self, qids: list[str], rows: Any, tokens: Any, truncated: Any) -> list[bytes]:
            return [b"{}" for _ in qids]

    table = InFlightTable()
    latch = FatalLatch()
    stage = OutputStage("out", Codec(), Producer(), table, Acks(), None, Metrics(), latch,  # type: ignore[arg-type]
                        spans=Spans())  # type: ignore[arg-type]
    part = PartitionOffsets("in", 0, 0)
    for seq in range(2):
        table.add(seq, InFlight(part, seq, f"q-{seq}", 3, False, None, 10, None,
                                InputHeaders([("traceparent", PARENTS[0].header())])))  # type: ignore[union-attr]
        stage._emit(_Finished([seq], np.zeros((1, 4), np.float32), None))
    assert Producer.keys == [b"q-0", b"q-1"] and Spans.calls == 2 and not latch.is_set()
