"""Sink-ready JSON output through the real broker and a worker process: output_fields renames and
drops fields (a vector-store sink reads the vector from a named field and the ID from the key),
pass_headers carries the producer's headers onto embeddings and dead letters, and the trace
continues in a child traceparent. Nothing of this touches a record without headers."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import orjson
import pytest

from tests.kafka_tools import TopicReader, WorkerProcess, load_queries, produce

pytestmark = pytest.mark.kafka

TP = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_renamed_fields_passed_headers_and_trace_context_reach_embeddings_and_dead_letters(
        kafka_bootstrap: str, make_topic: Callable[..., str], group_id: str, tmp_path: Path) -> None:
    inp, out, dlq = make_topic("kw", 2), make_topic("emb", 2), make_topic("dlq", 1)
    queries = load_queries(1000, 200)
    headers = [("tenant", b"acme"), ("correlation-id", b"c-42"), ("other", b"not passed"),
               ("kwe-dim", b"1"), ("traceparent", TP)]
    records = [(q.encode(), orjson.dumps({"id": q, "text": t}), headers if i % 2 else None)
               for i, (q, t) in enumerate(queries)]
    records.append((b"blank", orjson.dumps({"id": "blank", "text": "   "}), headers))
    produce(kafka_bootstrap, inp, records)
    w = WorkerProcess(kafka_bootstrap, inp, out, dlq, group_id, tmp_path / "worker.log",
                      # A Qdrant point, as its sink connector reads one: collection_name, a UUID id, vector.
                      ("--output-fields", "embedding=vector,id=query_id,uuid=id,+collection_name=keywords",
                       "--output-fields=-model,-encoding",  # with "=": argparse reads a leading - as a flag
                       "--pass-headers", "tenant", "--pass-headers", "correlation-id,kwe-dim"))
    w.start()
    reader = TopicReader(kafka_bootstrap, out, group_id + "-r")
    dead = TopicReader(kafka_bootstrap, dlq, group_id + "-d")
    try:
        reader.wait_for({q for q, _ in queries}, 300, alive=[w])
        dead.wait_for({"blank"}, 60, alive=[w])
        assert w.stop() == 0
    finally:
        if w.proc is not None and w.proc.poll() is None:
            w.kill()
        reader.close()
        dead.close()
    by_id = {r.key: r for r in reader.records}
    with_headers, without = by_id[queries[1][0]], by_id[queries[0][0]]
    assert set(with_headers.value) == {"query_id", "vector", "dim", "tokens", "truncated", "id", "collection_name",
                                       "fingerprint"}
    assert with_headers.value["query_id"] == with_headers.key == queries[1][0]
    assert with_headers.value["id"] == str(uuid.uuid5(uuid.NAMESPACE_URL, queries[1][0]))
    assert with_headers.value["collection_name"] == "keywords"
    assert len(with_headers.value["vector"]) == 384
    assert abs(float(np.linalg.norm(with_headers.value["vector"])) - 1.0) < 1e-4
    assert with_headers.headers["tenant"] == b"acme" and with_headers.headers["correlation-id"] == b"c-42"
    assert "other" not in with_headers.headers and with_headers.headers["kwe-dim"] == b"384"
    trace = with_headers.headers["traceparent"].decode().split("-")
    assert trace[1] == "0af7651916cd43dd8448eb211c80319c" and trace[2] != "b7ad6b7169203331"
    assert set(without.headers) == {"kwe-model", "kwe-encoding", "kwe-dim", "kwe-fingerprint"}  # nothing to pass, nothing added
    letter = dead.records[0]
    assert letter.headers["kwe-dlq-reason"] == b"empty_text" and letter.headers["tenant"] == b"acme"
    assert "kwe-dim" not in letter.headers  # an input kwe-* header stays in the value only
    assert ["kwe-dim", "MQ=="] in letter.value["headers"]
