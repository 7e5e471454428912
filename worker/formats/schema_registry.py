"""Schema Registry formats: input and output values through confluent-kafka's own serdes.

Imported only when input_format or output_format is a registry format (it needs the `registry`
extra: fastavro, jsonschema, protobuf, httpx). The wire format is the registry's (magic byte,
schema ID, payload), written and read by confluent-kafka's Avro/JSON Schema serialisers and
deserialisers; nothing here encodes it by hand. The reference schemas are in
worker/formats/registry_schemas/ (also reachable as schemas/registry/).

Threads: `RegistryInput` runs on the poll thread (intake), `RegistryOutput` on the output thread.
Both serdes cache what they fetched or registered by schema ID, so after a schema's first record
neither calls the registry again: a registry that goes down mid-run stops nothing until a record
with a schema ID the worker has not seen arrives.

Errors, and where they end:
- the record's fault (not the registry's wire format, an unknown schema ID (404), bytes that do
  not decode, a record without string id/text): a `schema_error` dead letter with the message;
- the registry's fault (unreachable after the client's retries, 5xx, 401/403): a
  `SchemaRegistryFailure`, which stops the worker; the record's offset is not committed, so the
  restarted worker reads it again once the registry is back;
- at start: the registry unreachable, or the output schema not registered while
  schema_auto_register is off: a `SchemaRegistryFailure` before the model loads (exit 2).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import structlog
from confluent_kafka.schema_registry import (
    SchemaRegistryClient,
    record_subject_name_strategy,
    topic_record_subject_name_strategy,
    topic_subject_name_strategy,
)
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.schema_registry.error import SchemaRegistryError
from confluent_kafka.schema_registry.json_schema import JSONDeserializer, JSONSerializer
from confluent_kafka.schema_registry.protobuf import ProtobufDeserializer, ProtobufSerializer
from confluent_kafka.serialization import MessageField, SerializationContext

from worker.errors import SchemaRegistryFailure
from worker.formats.messages import (
    Headers,
    Keyword,
    OutputCodec,
    Rejection,
    check_size,
    keyword_from_object,
    values_one_by_one,
)
from worker.formats.protobuf_schemas import ADDED_FIELDS, message_class
from worker.formats.sparse_codec import SparseOutputCodec
from worker.settings.schema import Settings

try:  # confluent-kafka's registry client speaks HTTP through httpx2 (Python 3.10+) or httpx
    from httpx2 import TransportError
except ImportError:  # pragma: no cover - older confluent-kafka
    from httpx import TransportError  # type: ignore[no-redef]

log = structlog.get_logger(__name__)

SCHEMA_DIR = Path(__file__).resolve().parent / "registry_schemas"
# The output schemas as first registered, before the optional `fingerprint` field was added
# (Avro; Protobuf's is the message without the field; JSON Schema's file is unchanged, its open
# content model allows the field): RegistryOutput's fallback.
PREVIOUS_DIR = SCHEMA_DIR / "previous"

STRATEGIES: dict[str, Callable[..., Any]] = {
    "topic": topic_subject_name_strategy,
    "record": record_subject_name_strategy,
    "topic-record": topic_record_subject_name_strategy,
}

# The client's own retries (with jittered backoff) before a call fails: the bounded retry of a
# registry that is briefly away. Then the worker stops (SchemaRegistryFailure).
_CLIENT_RETRIES = 3
_CLIENT_TIMEOUT_S = 10


def schema_file(fmt: str, encoding: str) -> Path:
    """The output schema for a registry format and embedding encoding (worker/formats/registry_schemas/);
    a sparse model's records ("sparse") have their own, with the same fields as its JSON record."""
    if encoding == "sparse":
        suffix = {"avro": ".avsc", "json-schema": ".schema.json", "protobuf": ".proto"}.get(fmt)
        if suffix is None:
            raise ValueError(f"no output schema for format {fmt!r}")
        return SCHEMA_DIR / f"sparse-embedding{suffix}"
    if fmt == "avro":
        return SCHEMA_DIR / ("embedding-floats.avsc" if encoding == "float-list" else "embedding-bytes.avsc")
    if fmt == "json-schema":
        return SCHEMA_DIR / "embedding.schema.json"
    if fmt == "protobuf":
        return SCHEMA_DIR / ("embedding-floats.proto" if encoding == "float-list" else "embedding-bytes.proto")
    raise ValueError(f"no output schema for format {fmt!r}")


def client_conf(settings: Settings) -> dict[str, Any]:
    """The SchemaRegistryClient configuration of the settings (the password read from its file)."""
    conf: dict[str, Any] = {"url": settings.schema_registry_url, "max.retries": _CLIENT_RETRIES,
                            "timeout": _CLIENT_TIMEOUT_S}
    password = settings.schema_registry_password
    if settings.schema_registry_password_file:
        try:
            password = Path(settings.schema_registry_password_file).read_text(encoding="utf-8").rstrip("\n")
        except OSError as exc:
            raise SchemaRegistryFailure(f"setting 'schema_registry_password_file': cannot read "
                                        f"{settings.schema_registry_password_file}: {exc.strerror}") from None
    if settings.schema_registry_username or password:
        conf["basic.auth.user.info"] = f"{settings.schema_registry_username}:{password}"
    if settings.schema_registry_ca_location:
        conf["ssl.ca.location"] = settings.schema_registry_ca_location
    return conf


def registry_client(settings: Settings) -> SchemaRegistryClient:
    return SchemaRegistryClient(client_conf(settings))


def registry_fault(exc: BaseException) -> bool:
    """True when the registry, not the record, is at fault: unreachable, a server error, or it
    refuses the worker's credentials. A 404 (unknown schema ID) or 422 is the record's fault."""
    if isinstance(exc, TransportError):
        return True
    if isinstance(exc, SchemaRegistryError):
        status = exc.http_status_code
        return status in (401, 403, 408, 429) or status >= 500 or status < 0
    return False


def describe(exc: BaseException) -> str:
    """The registry's (or the deserialiser's) message, for a dead letter or the fatal error."""
    if isinstance(exc, SchemaRegistryError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def _serdes_conf(settings: Settings) -> dict[str, Any]:
    return {"subject.name.strategy": STRATEGIES[settings.schema_subject_strategy]}


class RegistryInput:
    """Decodes an input record written with a registry format into a Keyword, or a Rejection.

    The writer's schema (fetched by the record's schema ID, then cached) is the reader's: any
    registered record with string fields `id` and `text` is accepted, whatever else it holds.
    """

    def __init__(self, settings: Settings, client: SchemaRegistryClient) -> None:
        conf = _serdes_conf(settings)
        fmt = settings.input_format
        self._url = settings.schema_registry_url
        self._max_bytes = settings.max_message_bytes
        self._deserialize: Callable[[bytes, SerializationContext], Any]
        if fmt == "avro":
            self._deserialize = AvroDeserializer(client, conf=conf)
        elif fmt == "json-schema":
            self._deserialize = JSONDeserializer(None, schema_registry_client=client, conf=conf)
        elif fmt == "protobuf":
            keyword = ProtobufDeserializer(message_class("keyword"), conf, client)
            self._deserialize = lambda value, ctx: _proto_dict(keyword(value, ctx))
        else:
            raise ValueError(f"input_format {fmt!r} is not a registry format this worker reads")

    def __call__(self, topic: str, key: bytes | None, value: bytes | None, headers: Headers,
                 headers_bytes: int) -> Keyword | Rejection:
        rejection = check_size(key, value, max_bytes=self._max_bytes, headers_bytes=headers_bytes)
        if rejection is not None:
            return rejection
        try:
            obj = self._deserialize(value, SerializationContext(topic, MessageField.VALUE, headers))  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001 - every failure is either the record's or the registry's
            if registry_fault(exc):
                raise SchemaRegistryFailure(f"cannot read a record of topic {topic!r}: the Schema Registry at "
                                            f"{self._url} failed ({describe(exc)}); stopping without committing "
                                            f"it, so it is read again after a restart") from exc
            return Rejection("schema_error", f"the value does not decode with the registry's schema: {describe(exc)}")
        return keyword_from_object(obj)


class RegistryOutput:
    """Encodes embeddings with a registry format: the codec's record (a dense model's OutputCodec, a
    sparse model's SparseOutputCodec) through the serialiser.

    The shipped schemas carry `fingerprint`, an optional field (a default of null in Avro; proto3
    fields are optional), so a registry that holds the version before it takes them as a compatible
    new version. JSON Schema's is unchanged: its open content model admits the field, and declaring
    it would be refused as narrowing that model. With
    schema_auto_register off and only that previous version registered, the start check falls back
    to it (PREVIOUS_DIR; Protobuf: the message without the field) rather than refuse to start:
    the records then carry the fingerprint in the kwe-fingerprint header only, and a warning says
    which schema to register.
    """

    def __init__(self, settings: Settings, codec: OutputCodec | SparseOutputCodec, client: SchemaRegistryClient) -> None:
        self._codec = codec
        self._fmt = settings.output_format
        self._url = settings.schema_registry_url
        self._client = client
        self._auto_register = settings.schema_auto_register
        # normalize.schemas: the lookup (auto-register off) matches the registered schema by its
        # canonical form, not its text, so a copy registered compact or re-indented is found.
        self._conf = {**_serdes_conf(settings), "auto.register.schemas": settings.schema_auto_register,
                      "normalize.schemas": True}
        self.schema_path = schema_file(self._fmt, codec.encoding)
        self._serialize = self._serializer(self.schema_path, previous=False)
        self._ctx = SerializationContext(settings.output_topic, MessageField.VALUE)
        self._bytes = self._fmt != "json-schema"  # JSON has no bytes: base64 as in the JSON output

    def _serializer(self, path: Path, *, previous: bool) -> Callable[[dict[str, object], SerializationContext],
                                                                      bytes | None]:
        without = ADDED_FIELDS if previous else ()
        serialize: Callable[[dict[str, object], SerializationContext], bytes | None]
        if self._fmt == "protobuf":
            embedding = message_class(path.stem, without=without)
            proto = ProtobufSerializer(embedding, self._client, self._conf)
            return lambda record, ctx: proto(
                embedding(**{k: v for k, v in record.items() if v is not None and k not in without}), ctx)
        schema_str = path.read_text(encoding="utf-8")
        if self._fmt == "avro":
            serialize = AvroSerializer(self._client, schema_str, conf=self._conf)
        else:
            serialize = JSONSerializer(schema_str, self._client, conf=self._conf)
        if not without:
            return serialize
        return lambda record, ctx: serialize({k: v for k, v in record.items() if k not in without}, ctx)

    @property
    def headers(self) -> Headers:
        return self._codec.headers

    def _record(self, qid: str, vec: Any, tokens: int, truncated: bool) -> dict[str, object]:
        record = self._codec.record(qid, vec, tokens, truncated, raw_bytes=self._bytes)
        embedding = record["embedding"]
        if isinstance(embedding, np.ndarray):
            record["embedding"] = embedding.tolist()
        elif isinstance(embedding, dict):  # sparse: {"indices", "values"} as lists (float32 values stay exact)
            record["embedding"] = {k: v.tolist() for k, v in embedding.items()}
        return record

    def value(self, qid: str, vec: Any, tokens: int, truncated: bool) -> bytes:
        record = self._record(qid, vec, tokens, truncated)
        try:
            out = self._serialize(record, self._ctx)
        except Exception as exc:  # noqa: BLE001 - not the record's fault: our record, our schema
            raise SchemaRegistryFailure(f"cannot encode an embedding as {self._fmt} with the Schema Registry at "
                                        f"{self._url}: {describe(exc)}") from exc
        assert out is not None
        return out

    def values(self, qids: Sequence[str], rows: Any, tokens: Sequence[int],
               truncated: Sequence[bool]) -> list[bytes]:
        return values_one_by_one(self, qids, rows, tokens, truncated)

    def check(self, dim: int | None = None) -> None:
        """At start: resolves the output schema's ID (registering it when schema_auto_register is
        on) by encoding one record, so a missing schema or registry stops the worker now."""
        if isinstance(self._codec, SparseOutputCodec):
            sample = self._record("kwe-start-check", self._codec.sample(), 2, False)
        else:
            dim = dim or self._codec.dim
            sample = self._record("kwe-start-check", np.full(dim, 1.0 / np.sqrt(dim), np.float32), 2, False)
        try:
            self._serialize(sample, self._ctx)
        except Exception as exc:  # noqa: BLE001
            if isinstance(exc, SchemaRegistryError) and exc.http_status_code == 404:
                if not self._auto_register and self._use_previous(sample):
                    return
                raise SchemaRegistryFailure(
                    f"output_format={self._fmt}: the schema {self.schema_path.name} is not registered under the "
                    f"output subject at {self._url} ({describe(exc)}); register it (docs/formats.md, Schema Registry formats) or "
                    f"set schema_auto_register=true") from None
            if isinstance(exc, SchemaRegistryError) and exc.http_status_code == 409:
                raise SchemaRegistryFailure(
                    f"output_format={self._fmt}: the registry at {self._url} refuses {self.schema_path.name} as "
                    f"incompatible with the output subject's schema ({describe(exc)})") from None
            raise SchemaRegistryFailure(f"output_format={self._fmt}: cannot reach the Schema Registry at "
                                        f"{self._url} ({describe(exc)})") from None

    def _use_previous(self, sample: dict[str, object]) -> bool:
        """The subject has the schema's previous version (before `fingerprint`): write with it."""
        previous = PREVIOUS_DIR / self.schema_path.name
        if isinstance(self._codec, SparseOutputCodec):
            return False  # a sparse model's schemas had the fingerprint from their first version
        if self._fmt != "protobuf" and not previous.is_file():
            return False  # JSON Schema: the schema did not change
        serialize = self._serializer(previous, previous=True)
        try:
            serialize(sample, self._ctx)
        except Exception:  # noqa: BLE001 - not registered either: the caller reports the current one
            return False
        log.warning("the output subject has the schema version before the fingerprint field; the records carry "
                    "the fingerprint in the kwe-fingerprint header only. Register the current schema (a compatible "
                    "new version) to write the field too", schema=self.schema_path.name, url=self._url)
        self._serialize = serialize
        return True


def _proto_dict(message: Any) -> dict[str, object] | None:
    """The id and text of a decoded Keyword message (proto3 strings: "" when unset)."""
    return None if message is None else {"id": message.id, "text": message.text}


def check_reachable(settings: Settings, client: SchemaRegistryClient) -> None:
    """At start, for input: the registry answers (a subject list). Raises SchemaRegistryFailure."""
    try:
        client.get_subjects()
    except Exception as exc:  # noqa: BLE001
        raise SchemaRegistryFailure(f"input_format={settings.input_format}: cannot reach the Schema Registry at "
                                    f"{settings.schema_registry_url} ({describe(exc)})") from None
