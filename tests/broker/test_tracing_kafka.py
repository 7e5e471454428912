"""Trace context through the real broker and the in-process pipeline, spans to an in-memory exporter.

Every keyword produced with a traceparent is linked from exactly one batch span, the batch sizes
add up to the keywords embedded, and each embedding's traceparent is a child in its keyword's
trace. A keyword without a traceparent is embedded like any other and linked from nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import orjson
import pytest

pytest.importorskip("opentelemetry.sdk", reason="the otel extra is not installed (pip install -e '.[otel]')")

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from tests.kafka_tools import TopicReader, load_queries, produce  # noqa: E402
from worker.app import wire_pipeline  # noqa: E402
from worker.formats.messages import OutputCodec  # noqa: E402
from worker.output.tracing import batch_spans  # noqa: E402
from worker.formats.propagation import parse_traceparent  # noqa: E402
from worker.settings.schema import Settings  # noqa: E402

pytestmark = pytest.mark.kafka


def test_each_traced_keyword_is_linked_from_one_batch_span(kafka_bootstrap: str, make_topic: Callable[..., str],
                                                           group_id: str) -> None:
    from worker.backend_choice.select import load_backend
    from worker.intake.tokenize import KeywordTokenizer

    inp, out, dlq = make_topic("kw", 2), make_topic("emb", 2), make_topic("dlq", 1)
    queries = load_queries(2000, 120)
    traced = {q: f"00-{i + 1:032x}-{i + 1:016x}-01" for i, (q, _) in enumerate(queries) if i % 3}
    produce(kafka_bootstrap, inp, [(q.encode(), orjson.dumps({"id": q, "text": t}),
                                    [("traceparent", traced[q].encode())] if q in traced else None)
                                   for q, t in queries])
    loaded = load_backend(Settings(intra_op_threads=1))
    exporter = InMemorySpanExporter()
    settings = Settings(bootstrap_servers=kafka_bootstrap, input_topic=inp, output_topic=out, dead_letter_topic=dlq,
                        group_id=group_id, pad_to=loaded.profile.pad_to, cache_bytes=0)
    pipeline = wire_pipeline(settings, tokenizer=KeywordTokenizer.from_model(loaded.model), backend=loaded.backend,
                             profile=loaded.profile, model_name="all-MiniLM-L6-v2",
                             codec=OutputCodec(model="all-MiniLM-L6-v2", dim=384, encoding="float-list"),
                             spans=batch_spans("", model="all-MiniLM-L6-v2", exporter=exporter))
    code: list[Any] = []
    thread = threading.Thread(target=lambda: code.append(pipeline.run()), name="test-worker")
    thread.start()
    reader = TopicReader(kafka_bootstrap, out, group_id + "-r")
    try:
        reader.wait_for({q for q, _ in queries}, 180)
    finally:
        pipeline.request_stop()
        thread.join(60)
        reader.close()
    assert code == [0]
    spans = exporter.get_finished_spans()
    assert sum(s.attributes["kwe.batch.size"] for s in spans) == len(queries)
    links = [(link.context.trace_id, link.context.span_id) for s in spans for link in s.links]
    assert sorted(links) == sorted((int(tp[3:35], 16), int(tp[36:52], 16)) for tp in traced.values())
    assert all(s.end_time >= s.start_time > 0 for s in spans)
    for rec in reader.records:
        if rec.key in traced:
            child = parse_traceparent(rec.headers["traceparent"])
            parent = parse_traceparent(traced[rec.key].encode())
            assert child is not None and parent is not None
            assert child.trace_id == parent.trace_id and child.span_id != parent.span_id
        else:
            assert "traceparent" not in rec.headers
