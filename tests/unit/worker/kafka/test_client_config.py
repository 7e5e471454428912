"""The exact configuration each Kafka client of the worker is handed, per guarantee (issue 60).

Pinned key by key, from the one module that builds them (worker/kafka/client_config.py:
`consumer_config`, and `producer_config`, transactional under exactly once; `worker_configs`, both from
one reading of the client settings). The secret is a fake one.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from worker.kafka.client_config import consumer_config, producer_config, worker_configs
from worker.settings.schema import Settings

SECURITY = {"security.protocol": "SASL_SSL", "sasl.mechanism": "PLAIN", "sasl.username": "u",
            "sasl.password": "fake-secret"}

CONSUMER = {
    "bootstrap.servers": "broker:9092", "group.id": "g", "partition.assignment.strategy": "cooperative-sticky",
    "enable.auto.offset.store": False, "enable.auto.commit": False, "auto.offset.reset": "earliest",
    "session.timeout.ms": 30000, "heartbeat.interval.ms": 1000, "max.poll.interval.ms": 300000,
    "isolation.level": "read_committed", "max.partition.fetch.bytes": 16384, "queued.max.messages.kbytes": 16384,
    "fetch.queue.backoff.ms": 10, "fetch.wait.max.ms": 10, "fetch.min.bytes": 16384,
    "client.id": "keyword-embedder-g", "logger": logging.getLogger("librdkafka"), **SECURITY,
}

PRODUCER = {
    "bootstrap.servers": "broker:9092", "enable.idempotence": True, "acks": "all", "linger.ms": 5,
    "compression.type": "none", "queue.buffering.max.messages": 100000, "message.timeout.ms": 3600000,
    "client.id": "keyword-embedder-g", "logger": logging.getLogger("librdkafka"), **SECURITY,
}

# Exactly once: transactional, its message timeout within the transaction's.
TRANSACTIONAL = {**PRODUCER, "message.timeout.ms": 60000, "transactional.id": "keyword-embedder-g-m-0",
                 "transaction.timeout.ms": 60000}


def settings(guarantee: str) -> Settings:
    return Settings(processing_guarantee=guarantee, bootstrap_servers="broker:9092", group_id="g", member_id="m-0",
                    security_protocol="SASL_SSL", sasl_mechanism="PLAIN", sasl_username="u",
                    sasl_password="fake-secret")


@pytest.mark.parametrize(("guarantee", "consumer", "producer"), [
    ("at-least-once", CONSUMER, PRODUCER),
    ("exactly-once", CONSUMER, TRANSACTIONAL),
])
def test_each_client_gets_exactly_this_configuration(guarantee: str, consumer: dict[str, Any],
                                                     producer: dict[str, Any]) -> None:
    s = settings(guarantee)
    assert consumer_config(s) == consumer
    assert producer_config(s) == producer


def test_a_pass_through_key_reaches_both_clients_and_the_transaction_bounds_the_message_timeout() -> None:
    s = Settings(processing_guarantee="exactly-once", bootstrap_servers="broker:9092", group_id="g", member_id="m-0",
                 kafka_config=("message.timeout.ms=90000", "socket.keepalive.enable=true"))
    produced = producer_config(s)
    assert produced["message.timeout.ms"] == 60000 and produced["socket.keepalive.enable"] == "true"
    assert consumer_config(s)["socket.keepalive.enable"] == "true"


def test_both_clients_come_from_one_reading_of_the_password_file(tmp_path: Any) -> None:
    secret = tmp_path / "password"
    secret.write_text("fake-secret\n")
    s = Settings(processing_guarantee="exactly-once", bootstrap_servers="broker:9092", group_id="g", member_id="m-0",
                 security_protocol="SASL_SSL", sasl_mechanism="PLAIN", sasl_username="u",
                 sasl_password_file=str(secret))
    reads: list[str] = []
    real = Path.read_text

    def counted(self: Path, *args: Any, **kw: Any) -> str:
        reads.append(str(self))
        return real(self, *args, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Path, "read_text", counted)
        configs = worker_configs(s)
    assert reads == [str(secret)]
    assert (configs.consumer, configs.producer) == (CONSUMER, TRANSACTIONAL)
