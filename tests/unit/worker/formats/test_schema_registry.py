"""Schema Registry formats without a registry: an unreachable registry stops the worker instead of
dead-lettering, registry faults are told from record faults, the password and its file, and the
shipped .proto files. Against the real registry (Apicurio): tests/broker/test_schema_registry.py.
"""

from __future__ import annotations

import pytest

pytest.importorskip("fastavro", reason="the registry extra is not installed (pip install -e '.[registry]')")

from confluent_kafka.schema_registry.error import SchemaRegistryError  # noqa: E402

from tests.kafka_tools import free_port  # noqa: E402
from worker.errors import SchemaRegistryFailure  # noqa: E402
from worker.formats.messages import OutputCodec  # noqa: E402
from worker.formats.schema_registry import (SCHEMA_DIR, RegistryInput, RegistryOutput, check_reachable,  # noqa: E402
                                            registry_client, registry_fault)
from worker.settings.schema import Settings  # noqa: E402

DIM = 384


def _settings(url: str, topic: str, **kw: object) -> Settings:
    return Settings(schema_registry_url=url, output_topic=topic, input_topic=topic, **kw)  # type: ignore[arg-type]


def test_an_unreachable_registry_stops_instead_of_dead_lettering() -> None:
    url = f"http://127.0.0.1:{free_port()}/apis/ccompat/v7"
    settings = _settings(url, "t", input_format="avro", output_format="avro")
    client = registry_client(settings)
    with pytest.raises(SchemaRegistryFailure, match="cannot reach the Schema Registry"):
        check_reachable(settings, client)
    with pytest.raises(SchemaRegistryFailure, match="cannot reach the Schema Registry"):
        RegistryOutput(settings, OutputCodec(model="m", dim=DIM, encoding="float-list"), client).check(DIM)
    decode = RegistryInput(settings, client)
    with pytest.raises(SchemaRegistryFailure, match="stopping without committing"):
        decode("t", None, b"\x00\x00\x00\x00\x05\x02x\x02y", [], 0)


def test_registry_faults_are_told_from_record_faults() -> None:
    assert registry_fault(SchemaRegistryError(503, 50301, "down"))
    assert registry_fault(SchemaRegistryError(401, 40101, "unauthorized"))
    assert not registry_fault(SchemaRegistryError(404, 40403, "schema not found"))
    assert not registry_fault(ValueError("bad bytes"))


def test_the_password_is_redacted_and_read_from_its_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from worker.formats.schema_registry import client_conf

    secret = tmp_path / "pw"
    secret.write_text("s3cret\n")
    s = Settings(schema_registry_url="https://sr", schema_registry_username="key",
                 schema_registry_password_file=str(secret), schema_registry_ca_location="/ca.pem")
    assert client_conf(s)["basic.auth.user.info"] == "key:s3cret" and client_conf(s)["ssl.ca.location"] == "/ca.pem"
    assert "hunter2" not in repr(Settings(schema_registry_url="https://sr", schema_registry_password="hunter2"))


def test_the_shipped_proto_files_are_the_messages_the_worker_builds() -> None:
    from worker.formats.protobuf_schemas import MESSAGES, proto_source

    for name in MESSAGES:
        assert (SCHEMA_DIR / f"{name}.proto").read_text() == proto_source(name), name
