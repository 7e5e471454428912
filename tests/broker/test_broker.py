"""Foundation: the real broker accepts produce/consume through a consumer group and keeps its offsets."""

from __future__ import annotations

import subprocess
import time

import pytest
from confluent_kafka import Consumer, Producer

from tests.conftest import KAFKA_SH


def _consume(bootstrap: str, topic: str, group: str, n: int, timeout: float = 30.0) -> list[bytes]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "auto.offset.reset": "earliest",
                         "enable.auto.commit": False})
    consumer.subscribe([topic])
    got: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while len(got) < n and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None or msg.error():
                continue
            got.append(msg.value())
            consumer.commit(message=msg, asynchronous=False)
    finally:
        consumer.close()
    return got


def test_group_commit_and_resume(kafka_bootstrap: str, make_topic, group_id: str) -> None:
    topic = make_topic("foundation", partitions=1)
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "enable.idempotence": True, "acks": "all"})
    for i in range(10):
        producer.produce(topic, key=str(i).encode(), value=f"kw-{i}".encode())
    assert producer.flush(30) == 0

    first = _consume(kafka_bootstrap, topic, group_id, 4)
    assert first == [f"kw-{i}".encode() for i in range(4)]
    # A second member of the same group resumes after the committed offset, not from the start.
    rest = _consume(kafka_bootstrap, topic, group_id, 6)
    assert rest == [f"kw-{i}".encode() for i in range(4, 10)]


def test_kafka_sh_reuses_running_broker(kafka_bootstrap: str) -> None:
    status = subprocess.run(["bash", str(KAFKA_SH), "status"], capture_output=True, text=True)
    if status.returncode != 0:
        pytest.skip("the broker was given by KAFKA_BOOTSTRAP_SERVERS, not started by kafka.sh")
    out = subprocess.run(["bash", str(KAFKA_SH), "start"], capture_output=True, text=True, check=True)
    assert "reusing" in out.stderr
    assert out.stdout.strip().splitlines()[-1] == f"KAFKA_BOOTSTRAP_SERVERS={kafka_bootstrap}"
