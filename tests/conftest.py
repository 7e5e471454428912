"""Shared fixtures: the real Kafka broker and per-test topics.

The broker comes from KAFKA_BOOTSTRAP_SERVERS when set (`make test` sets it), otherwise the
session starts one with deploy/local/kafka.sh and stops it at the end.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data"
KAFKA_SH = ROOT / "deploy" / "local" / "kafka.sh"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "kafka_bootstrap" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.kafka)


@pytest.fixture(scope="session")
def kafka_bootstrap() -> Iterator[str]:
    given = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if given:
        yield given
        return
    out = subprocess.run(["bash", str(KAFKA_SH), "start"], check=True, capture_output=True, text=True)
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith("KAFKA_BOOTSTRAP_SERVERS="), out.stdout + out.stderr
    try:
        yield line.split("=", 1)[1]
    finally:
        subprocess.run(["bash", str(KAFKA_SH), "stop"], check=False)


@pytest.fixture()
def make_topic(kafka_bootstrap: str) -> Iterator[Callable[..., str]]:
    """Creates uniquely named topics with N partitions; deletes them after the test."""
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    created: list[str] = []

    def make(prefix: str = "t", partitions: int = 1) -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:10]}"
        futures = admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=1)],
                                      operation_timeout=30)
        futures[name].result(timeout=30)
        created.append(name)
        return name

    yield make
    if created:
        for fut in admin.delete_topics(created, operation_timeout=30).values():
            try:
                fut.result(timeout=30)
            except Exception:  # noqa: BLE001 - best-effort cleanup must not hide the test's own outcome
                pass


@pytest.fixture()
def group_id() -> str:
    return f"g-{uuid.uuid4().hex[:10]}"
