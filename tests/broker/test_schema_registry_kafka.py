"""Schema Registry formats end to end: the real broker, the real registry (Apicurio) and a worker process.

Producers write keywords with confluent-kafka's serialiser; readers use its deserialiser with
nothing but the registry URL. Bad records land on the dead-letter topic with reason
schema_error and the registry's message, the rest of the stream still arrives; a registry that is
down at start stops the worker with one clear line (exit 2), and one that goes down mid-run
loses nothing: cached schemas keep the stream flowing, and a record whose schema cannot be
fetched stops the worker without committing it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

pytest.importorskip("fastavro", reason="the registry extra is not installed (pip install -e '.[registry]')")

from confluent_kafka.schema_registry import SchemaRegistryClient, record_subject_name_strategy  # noqa: E402
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer  # noqa: E402
from confluent_kafka.schema_registry.json_schema import JSONDeserializer, JSONSerializer  # noqa: E402
from confluent_kafka.serialization import MessageField, SerializationContext  # noqa: E402

from tests.conftest import OwnRegistry  # noqa: E402
from tests.kafka_tools import (ROOT, TopicReader, WorkerProcess, committed_offsets, free_port, load_queries,  # noqa: E402
                               produce)
from worker.formats.schema_registry import SCHEMA_DIR  # noqa: E402

pytestmark = [pytest.mark.kafka, pytest.mark.registry]

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01".encode()


def _ctx(topic: str) -> SerializationContext:
    return SerializationContext(topic, MessageField.VALUE)


def _embed(texts: list[str]) -> np.ndarray:
    from worker import Embedder

    with Embedder(backend="onnxruntime") as emb:
        return emb.embed(texts)


def _stopped(w: WorkerProcess) -> None:
    if w.proc is not None and w.proc.poll() is None:
        w.kill()


def test_avro_in_and_out_with_dead_letters_headers_and_trace_context(
        kafka_bootstrap: str, schema_registry: str, make_topic: Callable[..., str], group_id: str,
        tmp_path: Path) -> None:
    from engines.onnx_export.export import ensure_onnx

    ensure_onnx()
    inp, out, dlq = make_topic("kw", 2), make_topic("emb", 2), make_topic("dlq", 1)
    client = SchemaRegistryClient({"url": schema_registry})
    ser = AvroSerializer(client, (SCHEMA_DIR / "keyword.avsc").read_text())
    queries = load_queries(0, 300)
    headers = [("tenant", b"acme"), ("traceparent", TRACEPARENT), ("tracestate", b"vendor=1"),
               ("kwe-model", b"spoofed")]
    records: list[tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]] = [
        (q.encode(), ser({"id": q, "text": t}, _ctx(inp)), headers) for q, t in queries]
    # Three bad records among them: not the registry's wire format, a schema ID the registry does
    # not know, and a registered record without a text field.
    other = AvroSerializer(client, json.dumps({"type": "record", "name": "Other", "namespace": "kwe.test", "fields": [
        {"name": "id", "type": "string"}, {"name": "n", "type": "int"}]}),
        conf={"subject.name.strategy": record_subject_name_strategy})
    bad = [(b"bad-json", b'{"id": "bad-json", "text": "plain json"}', [("tenant", b"acme")]),
           (b"bad-id", b"\x00" + (876543).to_bytes(4, "big") + b"\x02x\x02y", []),
           (b"bad-fields", other({"id": "bad-fields", "n": 1}, _ctx(inp)), [])]
    produce(kafka_bootstrap, inp, records[:150] + bad + records[150:])
    w = WorkerProcess(kafka_bootstrap, inp, out, dlq, group_id, tmp_path / "worker.log",
                      ("--input-format", "avro", "--output-format", "avro", "--output-encoding", "base64-f32",
                       "--schema-registry-url", schema_registry, "--schema-auto-register", "true",
                       "--pass-headers", "tenant,kwe-model"))
    w.start()
    # The reader: confluent-kafka's deserialiser, with only the registry URL.
    deser = AvroDeserializer(SchemaRegistryClient({"url": schema_registry}))
    reader = TopicReader(kafka_bootstrap, out, group_id + "-r", decode=lambda v: deser(v, _ctx(out)))
    dead = TopicReader(kafka_bootstrap, dlq, group_id + "-d")
    try:
        reader.wait_for({q for q, _ in queries}, 300, alive=[w])
        dead.wait_for({"bad-json", "bad-id", "bad-fields"}, 60, alive=[w])
        assert w.stop() == 0
    finally:
        _stopped(w)
        reader.close()
        dead.close()
    by_id = {r.key: r for r in reader.records}
    assert set(by_id) == {q for q, _ in queries}
    got = np.stack([np.frombuffer(by_id[q].value["embedding"], "<f4") for q, _ in queries[:50]])
    assert np.abs(got - _embed([t for _, t in queries[:50]])).max() < 1e-4
    sample = by_id[queries[0][0]]
    assert sample.value["encoding"] == "base64-f32" and sample.value["dim"] == 384
    # Headers: the worker's own are not shadowed (kwe-model is not passed even when named),
    # tenant is passed, the trace continues in a child span of the same trace.
    assert sample.headers["kwe-model"] == b"all-MiniLM-L6-v2" and sample.headers["tenant"] == b"acme"
    version, trace, span, flags = sample.headers["traceparent"].decode().split("-")
    assert (version, trace, flags) == ("00", TRACE_ID, "01") and span != "00f067aa0ba902b7"
    assert sample.headers["tracestate"] == b"vendor=1"
    spans = {r.headers["traceparent"] for r in reader.records}
    assert len(spans) == len(reader.records)  # one child span per keyword
    subject = client.get_latest_version(f"{out}-value")
    assert json.loads(subject.schema.schema_str)["name"] == "Embedding"
    reasons = {r.key: r.value for r in dead.records}
    assert reasons["bad-json"]["reason"] == "schema_error" and "magic byte" in reasons["bad-json"]["detail"]
    assert reasons["bad-id"]["reason"] == "schema_error" and "876543" in reasons["bad-id"]["detail"]
    assert reasons["bad-fields"]["reason"] == "missing_text"
    dl = next(r for r in dead.records if r.key == "bad-json")
    assert dl.headers["tenant"] == b"acme" and dl.headers["kwe-dlq-reason"] == b"schema_error"


@pytest.mark.parametrize("fmt", ["json-schema", "protobuf"])
def test_json_schema_and_protobuf_in_and_out(kafka_bootstrap: str, schema_registry: str,
                                             make_topic: Callable[..., str], group_id: str, tmp_path: Path,
                                             fmt: str) -> None:
    from confluent_kafka.schema_registry.protobuf import ProtobufDeserializer, ProtobufSerializer

    from worker.formats.protobuf_schemas import message_class

    inp, out, dlq = make_topic("kw", 1), make_topic("emb", 1), make_topic("dlq", 1)
    client = SchemaRegistryClient({"url": schema_registry})
    reader_client = SchemaRegistryClient({"url": schema_registry})
    deser: Callable[[bytes, SerializationContext], Any]
    if fmt == "json-schema":
        json_ser = JSONSerializer((SCHEMA_DIR / "keyword.schema.json").read_text(), client)
        ser: Callable[[str, str], bytes] = lambda q, t: json_ser({"id": q, "text": t}, _ctx(inp))  # noqa: E731
        deser = JSONDeserializer(None, schema_registry_client=reader_client)
    else:
        keyword = message_class("keyword")
        proto_ser = ProtobufSerializer(keyword, client)
        ser = lambda q, t: proto_ser(keyword(id=q, text=t), _ctx(inp))  # noqa: E731
        proto = ProtobufDeserializer(message_class("embedding-floats"), {}, reader_client)
        deser = lambda v, ctx: {"embedding": list(proto(v, ctx).embedding), "model": proto(v, ctx).model}  # noqa: E731
    queries = load_queries(300, 100)
    produce(kafka_bootstrap, inp, [(q.encode(), ser(q, t)) for q, t in queries])
    w = WorkerProcess(kafka_bootstrap, inp, out, dlq, group_id, tmp_path / "worker.log",
                      ("--input-format", fmt, "--output-format", fmt,
                       "--schema-registry-url", schema_registry, "--schema-auto-register", "true"))
    w.start()
    reader = TopicReader(kafka_bootstrap, out, group_id + "-r", decode=lambda v: deser(v, _ctx(out)))
    try:
        reader.wait_for({q for q, _ in queries}, 300, alive=[w])
        assert w.stop() == 0
    finally:
        _stopped(w)
        reader.close()
    by_id = {r.key: r.value for r in reader.records}
    got = np.asarray([by_id[q]["embedding"] for q, _ in queries[:20]], np.float32)
    assert np.abs(got - _embed([t for _, t in queries[:20]])).max() < 1e-4
    assert by_id[queries[0][0]]["model"] == "all-MiniLM-L6-v2"


def test_a_registry_down_at_start_stops_the_worker_with_one_clear_line(
        kafka_bootstrap: str, make_topic: Callable[..., str], group_id: str) -> None:
    inp, out, dlq = make_topic("kw", 1), make_topic("emb", 1), make_topic("dlq", 1)
    url = f"http://127.0.0.1:{free_port()}/apis/ccompat/v7"
    run = subprocess.run([sys.executable, "-m", "worker.cli", "run", "--bootstrap-servers", kafka_bootstrap,
                          "--input-topic", inp, "--output-topic", out, "--dead-letter-topic", dlq, "--group-id",
                          group_id, "--output-format", "avro", "--schema-registry-url", url, "--log-format", "json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert run.returncode == 2, run.stderr[-2000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("keyword-embedder run: output_format=avro: cannot reach the Schema Registry at " + url), last


def test_a_registry_outage_mid_run_loses_nothing(kafka_bootstrap: str, own_registry: OwnRegistry,
                                                 make_topic: Callable[..., str], group_id: str,
                                                 tmp_path: Path) -> None:
    inp, out, dlq = make_topic("kw", 1), make_topic("emb", 1), make_topic("dlq", 1)
    client = SchemaRegistryClient({"url": own_registry.url})
    ser = AvroSerializer(client, (SCHEMA_DIR / "keyword.avsc").read_text())
    queries = load_queries(400, 400)
    first = [(q.encode(), ser({"id": q, "text": t}, _ctx(inp))) for q, t in queries[:200]]
    second = [(q.encode(), ser({"id": q, "text": t}, _ctx(inp))) for q, t in queries[200:]]
    # A keyword written with a second schema, registered now: its ID is one the worker has not seen.
    v2 = json.loads((SCHEMA_DIR / "keyword.avsc").read_text())
    v2["fields"].append({"name": "lang", "type": "string", "default": "en"})
    newer = AvroSerializer(client, json.dumps(v2))({"id": "q-new", "text": "late keyword", "lang": "de"},
                                                   _ctx(inp + "-v2"))
    produce(kafka_bootstrap, inp, first)
    w = WorkerProcess(kafka_bootstrap, inp, out, dlq, group_id, tmp_path / "worker.log",
                      ("--input-format", "avro", "--output-format", "avro", "--schema-registry-url",
                       own_registry.url, "--schema-auto-register", "true"))
    w.start()
    reader = TopicReader(kafka_bootstrap, out, group_id + "-r", decode=lambda v: v)
    try:
        reader.wait_for({q for q, _ in queries[:200]}, 300, alive=[w])
        own_registry.stop()  # registry.sh stop: returns once its JVM is gone
        status = subprocess.run(["bash", str(ROOT / "deploy" / "local" / "registry.sh"), "status"],
                                env=own_registry.env, capture_output=True, text=True)
        assert status.returncode == 1 and status.stdout.strip() == "not running"
        # Schemas seen before the outage are cached: the stream keeps flowing.
        produce(kafka_bootstrap, inp, second)
        reader.wait_for({q for q, _ in queries}, 120, alive=[w])
        # A schema never seen cannot be fetched: the worker stops, without committing that record.
        produce(kafka_bootstrap, inp, [(b"q-new", newer)])
        deadline = time.monotonic() + 120
        while w.proc is not None and w.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert w.proc is not None and w.proc.returncode == 1, w.log()[-3000:]
    finally:
        _stopped(w)
        reader.close()
    assert "Schema Registry" in w.log() and "stopping without committing" in w.log()
    assert {r.key for r in reader.records} == {q for q, _ in queries}
    assert committed_offsets(kafka_bootstrap, group_id, inp, 1)[0] == 400  # everything before q-new, not q-new
    with pytest.raises(orjson.JSONDecodeError):
        orjson.loads(reader.records[0].value)  # Avro on the wire, not JSON
