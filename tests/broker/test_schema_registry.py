"""Schema Registry formats in-process, against the real registry (Apicurio, deploy/local/registry.sh).

The worker's encoder and decoder (worker/formats/schema_registry.py) are confluent-kafka's own
serdes; these tests check what the worker adds: the shipped schemas register and round-trip,
a reader needs nothing but the registry URL, the start check refuses a missing or incompatible
schema, and each decode failure lands where it should (a
schema_error dead letter for the record's fault, a stop for the registry's). Through Kafka and a
worker process: tests/broker/test_schema_registry_kafka.py; without a registry (an unreachable one,
faults told apart, the shipped .proto files): tests/unit/worker/formats/test_schema_registry.py.
"""

from __future__ import annotations

import base64
import json
import uuid

import numpy as np
import pytest

pytest.importorskip("fastavro", reason="the registry extra is not installed (pip install -e '.[registry]')")

from confluent_kafka.schema_registry import Schema, SchemaRegistryClient  # noqa: E402
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer  # noqa: E402
from confluent_kafka.schema_registry.json_schema import JSONDeserializer, JSONSerializer  # noqa: E402
from confluent_kafka.serialization import MessageField, SerializationContext  # noqa: E402

from worker.core.vectors import default_int8_range, dequantize_int8  # noqa: E402
from worker.errors import SchemaRegistryFailure  # noqa: E402
from worker.formats.messages import Keyword, OutputCodec, Rejection  # noqa: E402
from worker.settings.schema import Settings  # noqa: E402
from worker.formats.schema_registry import (SCHEMA_DIR, RegistryInput, RegistryOutput, check_reachable,  # noqa: E402
                                            registry_client, schema_file)

DIM = 384


def _vec(seed: int = 0) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal(DIM).astype(np.float32)
    return v / np.linalg.norm(v)


def _topic() -> str:
    return f"sr-{uuid.uuid4().hex[:10]}"


def _settings(url: str, topic: str, **kw: object) -> Settings:
    return Settings(schema_registry_url=url, output_topic=topic, input_topic=topic, **kw)  # type: ignore[arg-type]


def _ctx(topic: str) -> SerializationContext:
    return SerializationContext(topic, MessageField.VALUE)


@pytest.mark.parametrize("encoding", ["float-list", "base64-f32", "int8"])
def test_avro_output_registers_and_a_reader_with_only_the_url_gets_the_vector(schema_registry: str,
                                                                             encoding: str) -> None:
    topic = _topic()
    r = default_int8_range(DIM)
    codec = OutputCodec(model="all-MiniLM-L6-v2", dim=DIM, encoding=encoding,  # type: ignore[arg-type]
                        int8_range=(-r, r) if encoding == "int8" else None)
    settings = _settings(schema_registry, topic, output_format="avro", schema_auto_register=True,
                         output_encoding=encoding)
    out = RegistryOutput(settings, codec, registry_client(settings))
    out.check(DIM)
    value = out.value("q-1", _vec(), 7, False)
    assert value[0] == 0  # the registry's wire format: magic byte, then the schema ID
    got = AvroDeserializer(SchemaRegistryClient({"url": schema_registry}))(value, _ctx(topic))
    assert got["id"] == "q-1" and got["tokens"] == 7 and got["dim"] == DIM and got["encoding"] == encoding
    if encoding == "float-list":
        assert np.allclose(got["embedding"], _vec(), atol=1e-7)
    elif encoding == "base64-f32":
        assert isinstance(got["embedding"], bytes)  # raw bytes in Avro, not base64 text
        assert np.array_equal(np.frombuffer(got["embedding"], "<f4"), _vec())
    else:
        assert got["int8_range"] == [-r, r]
        back = dequantize_int8(np.frombuffer(got["embedding"], np.int8), -r, r)
        assert np.abs(back - _vec()).max() <= 2 * r / 255
    registered = SchemaRegistryClient({"url": schema_registry}).get_latest_version(f"{topic}-value")
    fields = {f["name"]: f["type"] for f in json.loads(registered.schema.schema_str)["fields"]}
    assert fields["embedding"] == ({"type": "array", "items": "float"} if encoding == "float-list" else "bytes")


def test_json_schema_output_validates_and_reads_back(schema_registry: str) -> None:
    topic = _topic()
    codec = OutputCodec(model="m", dim=DIM, encoding="base64-f16")
    settings = _settings(schema_registry, topic, output_format="json-schema", schema_auto_register=True,
                         output_encoding="base64-f16")
    out = RegistryOutput(settings, codec, registry_client(settings))
    out.check(DIM)
    got = JSONDeserializer(None, schema_registry_client=SchemaRegistryClient({"url": schema_registry}))(
        out.value("q-2", _vec(1), 5, True), _ctx(topic))
    assert got["id"] == "q-2" and got["truncated"] is True
    assert np.allclose(np.frombuffer(base64.b64decode(got["embedding"]), "<f2"), _vec(1), atol=1e-3)


def test_without_auto_register_the_output_schema_must_exist(schema_registry: str) -> None:
    topic = _topic()
    codec = OutputCodec(model="m", dim=DIM, encoding="float-list")
    settings = _settings(schema_registry, topic, output_format="avro")  # schema_auto_register off: the default
    client = registry_client(settings)
    out = RegistryOutput(settings, codec, client)
    with pytest.raises(SchemaRegistryFailure, match="not registered.*schema_auto_register"):
        out.check(DIM)
    assert f"{topic}-value" not in client.get_subjects()  # nothing registered behind the user's back
    # Registered by its owner (as docs/formats.md shows): the worker uses it.
    client.register_schema(f"{topic}-value", Schema(schema_file("avro", "float-list").read_text(), "AVRO"))
    out = RegistryOutput(settings, codec, client)
    out.check(DIM)
    assert AvroDeserializer(client)(out.value("q", _vec(), 3, False), _ctx(topic))["id"] == "q"


def test_an_incompatible_output_schema_is_refused_by_the_registry(schema_registry: str) -> None:
    topic = _topic()
    client = SchemaRegistryClient({"url": schema_registry})
    old = {"type": "record", "name": "Embedding", "namespace": "dev.keyword_embedder",
           "fields": [{"name": "id", "type": "string"}, {"name": "embedding", "type": "string"}]}
    client.register_schema(f"{topic}-value", Schema(json.dumps(old), "AVRO"))
    client.set_compatibility(f"{topic}-value", "BACKWARD")
    settings = _settings(schema_registry, topic, output_format="avro", schema_auto_register=True)
    out = RegistryOutput(settings, OutputCodec(model="m", dim=DIM, encoding="float-list"), registry_client(settings))
    with pytest.raises(SchemaRegistryFailure, match="incompatible") as err:
        out.check(DIM)
    assert "409" in str(err.value)
    assert len(client.get_versions(f"{topic}-value")) == 1


def test_the_record_strategy_names_the_subject_after_the_record(schema_registry: str) -> None:
    topic = _topic()
    settings = _settings(schema_registry, topic, output_format="avro", schema_auto_register=True,
                         schema_subject_strategy="topic-record")
    RegistryOutput(settings, OutputCodec(model="m", dim=DIM, encoding="float-list"), registry_client(settings)).check(DIM)
    assert f"{topic}-dev.keyword_embedder.Embedding" in SchemaRegistryClient({"url": schema_registry}).get_subjects()


def test_input_decoding_sorts_record_faults_from_registry_faults(schema_registry: str) -> None:
    topic = _topic()
    client = SchemaRegistryClient({"url": schema_registry})
    ser = AvroSerializer(client, (SCHEMA_DIR / "keyword.avsc").read_text())
    good = ser({"id": "q-7", "text": "cheap flights"}, _ctx(topic))
    settings = _settings(schema_registry, topic, input_format="avro")
    check_reachable(settings, registry_client(settings))
    decode = RegistryInput(settings, registry_client(settings))
    assert decode(topic, None, good, [], 0) == Keyword("q-7", "cheap flights")
    # Not the registry's wire format.
    bad = decode(topic, None, b'{"id": "q", "text": "json"}', [], 0)
    assert isinstance(bad, Rejection) and bad.reason == "schema_error" and "magic byte" in bad.detail
    # A schema ID the registry does not have: the registry's own message.
    bad = decode(topic, None, b"\x00" + (987654).to_bytes(4, "big") + b"\x02x", [], 0)
    assert isinstance(bad, Rejection) and bad.reason == "schema_error" and "987654" in bad.detail and "404" in bad.detail
    # Bytes that do not decode with the (real) writer schema.
    bad = decode(topic, None, good[:5] + b"\xff\xff\xff", [], 0)
    assert isinstance(bad, Rejection) and bad.reason == "schema_error"
    # A registered record without the fields: the same checks as JSON input.
    other = AvroSerializer(client, json.dumps({"type": "record", "name": "Other", "fields": [
        {"name": "id", "type": "string"}, {"name": "n", "type": "int"}]}))({"id": "q", "n": 1}, _ctx(topic + "-o"))
    assert decode(topic, None, other, [], 0) == Rejection("missing_text", "the object has no 'text'")
    # Size and tombstone checks come first, without a registry call.
    assert decode(topic, None, None, [], 0).reason == "null_value"  # type: ignore[union-attr]
    assert decode(topic, None, good, [], 20000).reason == "oversized"  # type: ignore[union-attr]


def test_json_schema_input_decodes(schema_registry: str) -> None:
    topic = _topic()
    client = SchemaRegistryClient({"url": schema_registry})
    ser = JSONSerializer((SCHEMA_DIR / "keyword.schema.json").read_text(), client)
    settings = _settings(schema_registry, topic, input_format="json-schema")
    decode = RegistryInput(settings, registry_client(settings))
    assert decode(topic, None, ser({"id": "j", "text": "weather"}, _ctx(topic)), [], 0) == Keyword("j", "weather")
    assert decode(topic, None, b"\x00\x00\x00", [], 0).reason == "schema_error"  # type: ignore[union-attr]


@pytest.mark.parametrize("encoding", ["float-list", "binary"])
def test_protobuf_output_and_input_round_trip(schema_registry: str, encoding: str) -> None:
    from confluent_kafka.schema_registry.protobuf import ProtobufDeserializer, ProtobufSerializer

    from worker.core.vectors import pack_binary
    from worker.formats.protobuf_schemas import message_class

    topic = _topic()
    settings = _settings(schema_registry, topic, output_format="protobuf", input_format="protobuf",
                         schema_auto_register=True, output_encoding=encoding)
    out = RegistryOutput(settings, OutputCodec(model="m", dim=DIM, encoding=encoding),  # type: ignore[arg-type]
                         registry_client(settings))
    out.check(DIM)
    reader = ProtobufDeserializer(message_class(out.schema_path.stem), {},
                                  SchemaRegistryClient({"url": schema_registry}))
    got = reader(out.value("q-3", _vec(2), 9, False), _ctx(topic))
    assert got.id == "q-3" and got.tokens == 9 and got.dim == DIM and got.prompt_name == ""
    if encoding == "float-list":
        assert np.allclose(list(got.embedding), _vec(2), atol=1e-7)
    else:
        assert got.embedding == pack_binary(_vec(2)).tobytes()
    keyword = message_class("keyword")
    value = ProtobufSerializer(keyword, SchemaRegistryClient({"url": schema_registry}))(
        keyword(id="p-1", text="pizza near me"), _ctx(topic + "-in"))
    decode = RegistryInput(settings, registry_client(settings))
    assert decode(topic, None, value, [], 0) == Keyword("p-1", "pizza near me")
    assert decode(topic, None, ProtobufSerializer(keyword, SchemaRegistryClient({"url": schema_registry}))(
        keyword(id="p-2"), _ctx(topic + "-in")), [], 0).reason == "empty_text"  # type: ignore[union-attr]
    assert decode(topic, None, b"\x00\x00\x00\x00\x01\xff\xff", [], 0).reason == "schema_error"  # type: ignore[union-attr]


# ------------------------------------------------------------------ the fingerprint field


def _previous(fmt: str, encoding: str, *, as_the_worker_registered: bool = False) -> Schema:
    """The output schema as registered before the fingerprint field (what existing subjects hold).
    Protobuf: the .proto text a user registers, or the descriptor an auto-registering worker did."""
    from worker.formats.protobuf_schemas import ADDED_FIELDS, file_descriptor_proto, proto_source
    from worker.formats.schema_registry import PREVIOUS_DIR

    stem = schema_file(fmt, encoding).stem
    if fmt == "protobuf" and as_the_worker_registered:
        from confluent_kafka.schema_registry.protobuf import _schema_to_str
        from google.protobuf import descriptor_pool

        pool = descriptor_pool.DescriptorPool()
        fdp = file_descriptor_proto(stem, without=ADDED_FIELDS)
        pool.Add(fdp)
        return Schema(_schema_to_str(pool.FindFileByName(fdp.name)), "PROTOBUF")
    if fmt == "protobuf":
        return Schema(proto_source(stem, without=ADDED_FIELDS), "PROTOBUF")
    if fmt == "json-schema":  # unchanged: the field is allowed by its open content model, not declared
        return Schema(schema_file(fmt, encoding).read_text(), "JSON")
    return Schema((PREVIOUS_DIR / schema_file(fmt, encoding).name).read_text(), "AVRO")


def _read(fmt: str, encoding: str, url: str, value: bytes, topic: str) -> dict[str, object]:
    client = SchemaRegistryClient({"url": url})
    if fmt == "avro":
        return AvroDeserializer(client)(value, _ctx(topic))  # type: ignore[no-any-return]
    if fmt == "json-schema":
        return JSONDeserializer(None, schema_registry_client=client)(value, _ctx(topic))  # type: ignore[no-any-return]
    from confluent_kafka.schema_registry.protobuf import ProtobufDeserializer
    from google.protobuf.json_format import MessageToDict

    from worker.formats.protobuf_schemas import message_class

    got = ProtobufDeserializer(message_class(schema_file(fmt, encoding).stem), {}, client)(value, _ctx(topic))
    return MessageToDict(got, preserving_proto_field_name=True)


@pytest.mark.parametrize("fmt", ["avro", "json-schema", "protobuf"])
def test_the_fingerprint_field_is_a_compatible_new_version_of_a_registered_subject(schema_registry: str,
                                                                                  fmt: str) -> None:
    topic = _topic()
    client = SchemaRegistryClient({"url": schema_registry})
    client.register_schema(f"{topic}-value", _previous(fmt, "float-list"))
    client.set_compatibility(f"{topic}-value", "BACKWARD")
    codec = OutputCodec(model="m", dim=DIM, encoding="float-list", fingerprint="v1-0123456789abcdef")
    settings = _settings(schema_registry, topic, output_format=fmt, schema_auto_register=True)
    out = RegistryOutput(settings, codec, registry_client(settings))
    out.check(DIM)  # registered as version 2, not refused (409) as incompatible
    # JSON Schema's file is unchanged (the open content model allows the field): no new version.
    assert len(client.get_versions(f"{topic}-value")) == (1 if fmt == "json-schema" else 2)
    assert _read(fmt, "float-list", schema_registry, out.value("q-1", _vec(), 4, False), topic)["fingerprint"] == \
        "v1-0123456789abcdef"


@pytest.mark.parametrize(("fmt", "encoding"), [("avro", "float-list"), ("avro", "int8"), ("json-schema", "base64-f32"),
                                               ("protobuf", "binary")])
def test_without_auto_register_the_previous_version_is_used_and_the_header_carries_it(
        schema_registry: str, fmt: str, encoding: str) -> None:
    topic = _topic()
    client = SchemaRegistryClient({"url": schema_registry})
    client.register_schema(f"{topic}-value", _previous(fmt, encoding, as_the_worker_registered=True))
    r = default_int8_range(DIM)
    codec = OutputCodec(model="m", dim=DIM, encoding=encoding, fingerprint="v1-0123456789abcdef",  # type: ignore[arg-type]
                        int8_range=(-r, r) if encoding == "int8" else None)
    settings = _settings(schema_registry, topic, output_format=fmt, output_encoding=encoding)  # auto-register off
    out = RegistryOutput(settings, codec, registry_client(settings))
    out.check(DIM)  # the worker starts: the subject's (previous) schema is used
    got = _read(fmt, encoding, schema_registry, out.value("q-2", _vec(), 4, False), topic)
    # JSON Schema's registered schema is the current one and takes the field; the others' previous do not.
    assert got["id"] == "q-2" and got.get("fingerprint") == ("v1-0123456789abcdef" if fmt == "json-schema" else None)
    assert dict(out.headers)["kwe-fingerprint"] == b"v1-0123456789abcdef"
    assert len(client.get_versions(f"{topic}-value")) == 1  # nothing registered behind the user's back


@pytest.mark.parametrize("fmt", ["avro", "protobuf", "json-schema"])
def test_a_sparse_models_records_register_and_read_back_with_only_the_url(schema_registry: str, fmt: str) -> None:
    """A sparse (SPLADE) model's records: worker/formats/registry_schemas/sparse-embedding.*, the fields
    of its JSON record, registered and read back by a reader that has nothing but the URL."""
    from confluent_kafka.schema_registry.protobuf import ProtobufDeserializer

    from worker.core.sparse import SparseRow
    from worker.formats.protobuf_schemas import message_class
    from worker.formats.sparse_codec import SparseOutputCodec

    topic = _topic()
    codec = SparseOutputCodec(model="splade-tiny-msmarco", dim=30522, vocabulary=tuple(f"t{i}" for i in range(30522)))
    settings = _settings(schema_registry, topic, output_format=fmt, schema_auto_register=True, sparse_terms=True)
    out = RegistryOutput(settings, codec, registry_client(settings))
    out.check()
    assert out.schema_path.name.startswith("sparse-embedding.")
    row = SparseRow(np.asarray([1012, 2770, 6007], np.int32), np.asarray([0.0625, 2.0776472, 2.2486408], np.float32))
    value = out.value("q-1", row, 4, False)
    reader_client = SchemaRegistryClient({"url": schema_registry})
    if fmt == "avro":
        got = AvroDeserializer(reader_client)(value, _ctx(topic))
    elif fmt == "json-schema":
        got = JSONDeserializer(None, schema_registry_client=reader_client)(value, _ctx(topic))
    else:
        msg = ProtobufDeserializer(message_class("sparse-embedding"), {}, reader_client)(value, _ctx(topic))
        got = {"id": msg.id, "embedding": {"indices": list(msg.embedding.indices), "values": list(msg.embedding.values)},
               "terms": list(msg.terms), "encoding": msg.encoding, "dim": msg.dim, "tokens": msg.tokens}
    assert got["id"] == "q-1" and got["encoding"] == "sparse" and got["dim"] == 30522 and got["tokens"] == 4
    assert got["embedding"]["indices"] == [1012, 2770, 6007] and got["terms"] == ["t1012", "t2770", "t6007"]
    assert np.array_equal(np.asarray(got["embedding"]["values"], np.float32), row.values)  # float32, exactly
