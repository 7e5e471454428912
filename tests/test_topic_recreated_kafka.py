"""The input topic deleted and recreated under a running worker (finding 7 of the core review).

The recreated topic's offsets start again at 0, below where the worker's partitions stood:
those are new records, and every one of them is embedded (before the fix they were skipped as
"re-fetched" and the worker went on with nothing to do). Both guarantees.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient, NewTopic

from tests.kafka_tools import TopicReader, WorkerProcess, load_queries, produce_queries

pytestmark = pytest.mark.kafka


@pytest.fixture(scope="module")
def onnx_ready() -> None:
    from engines.export_onnx import ensure_onnx

    ensure_onnx()


def _recreate(bootstrap: str, topic: str, partitions: int) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.delete_topics([topic], operation_timeout=30)[topic].result(timeout=30)
    deadline = time.monotonic() + 60
    while True:
        try:
            admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1)],
                                operation_timeout=30)[topic].result(timeout=30)
            return
        except Exception:  # noqa: BLE001 - the deletion is still under way: TOPIC_ALREADY_EXISTS
            assert time.monotonic() < deadline, "the topic could not be recreated"
            time.sleep(0.5)


@pytest.mark.parametrize("guarantee", ["at-least-once", "exactly-once"])
def test_records_of_a_recreated_input_topic_are_all_embedded(
        kafka_bootstrap: str, make_topic: Callable[..., str], group_id: str, tmp_path: Path, onnx_ready: None,
        guarantee: str) -> None:
    src, out, dlq = make_topic("kw", 2), make_topic("emb", 2), make_topic("dlq", 1)
    before, after = load_queries(0, 400), load_queries(400, 100)
    produce_queries(kafka_bootstrap, src, before)
    w = WorkerProcess(kafka_bootstrap, src, out, dlq, group_id, tmp_path / "w.log",
                      ["--processing-guarantee", guarantee, "--intra-op-threads", "1"]).start()
    reader = TopicReader(kafka_bootstrap, out, f"r-{group_id}")
    try:
        w.wait_ready()
        reader.wait_for({q for q, _ in before}, 120, alive=[w])
        _recreate(kafka_bootstrap, src, 2)
        produce_queries(kafka_bootstrap, src, after)  # offsets 0.. again, below where the worker stood
        reader.wait_for({q for q, _ in after}, 120, alive=[w])
        assert w.stop() == 0, w.log()[-3000:]
    finally:
        if w.proc and w.proc.poll() is None:
            w.kill()
        reader.close()
