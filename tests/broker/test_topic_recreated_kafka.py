"""The input log reset under a running worker: offsets that go back with no rebalance and no seek
of the worker's (docs/delivery.md, "Offsets that go back"). Both guarantees.

- The input topic deleted and recreated (finding 7 of the core review): its offsets start again at
  0, below where the worker's partitions stood; those are new records, and every one of them is
  embedded (before that fix they were skipped as "re-fetched").
- The same, with each partition's first record restored as it was (same timestamp, key and value,
  as a replicator that keeps timestamps would; issue 32, finding 3): still a new log, every record
  embedded (comparing the first record's content took it for a re-fetch and skipped the rest).
- librdkafka's own offset reset on the same log (issue 32, finding 2): a member that began above the
  log start (its group's committed offset) sees its partition's position go out of range, and
  librdkafka resets it to auto.offset.reset, earliest: the log start. Those records were processed
  already (by the member, or before it by its group): nothing is written twice.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from tests.kafka_tools import TopicReader, WorkerProcess, load_queries, produce_queries
from tests.in_process import InProcessWorker, loaded  # noqa: F401 - the fixture
from worker.app import wire_pipeline
from worker.formats.messages import OutputCodec
from worker.settings.schema import Settings

pytestmark = pytest.mark.kafka


@pytest.fixture(scope="module")
def onnx_ready() -> None:
    from engines.onnx_export.export import ensure_onnx

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


@pytest.mark.parametrize("restored", [False, True], ids=["new-records", "first-records-restored"])
@pytest.mark.parametrize("guarantee", ["at-least-once", "exactly-once"])
def test_records_of_a_recreated_input_topic_are_all_embedded(
        kafka_bootstrap: str, make_topic: Callable[..., str], group_id: str, tmp_path: Path, onnx_ready: None,
        guarantee: str, restored: bool) -> None:
    src, out, dlq = make_topic("kw", 2), make_topic("emb", 2), make_topic("dlq", 1)
    before, after = load_queries(0, 400), load_queries(400, 100)
    produce_queries(kafka_bootstrap, src, before)
    w = WorkerProcess(kafka_bootstrap, src, out, dlq, group_id, tmp_path / "w.log",
                      ["--processing-guarantee", guarantee, "--intra-op-threads", "1"]).start()
    reader = TopicReader(kafka_bootstrap, out, f"r-{group_id}")
    try:
        w.wait_ready()
        reader.wait_for({q for q, _ in before}, 120, alive=[w])
        first = _first_records(kafka_bootstrap, src, 2) if restored else []
        _recreate(kafka_bootstrap, src, 2)
        if first:  # offset 0 of each partition exactly as it was (a replicator that keeps timestamps)
            p = Producer({"bootstrap.servers": kafka_bootstrap, "enable.idempotence": True})
            for partition, key, value, ts in first:
                p.produce(src, key=key, value=value, partition=partition, timestamp=ts)
            assert p.flush(30) == 0
        produce_queries(kafka_bootstrap, src, after)  # offsets 0.. again, below where the worker stood
        reader.wait_for({q for q, _ in after}, 120, alive=[w])
        assert w.stop() == 0, w.log()[-3000:]
    finally:
        if w.proc and w.proc.poll() is None:
            w.kill()
        reader.close()


def _first_records(bootstrap: str, topic: str, partitions: int) -> list[tuple[int, bytes, bytes, int]]:
    """(partition, key, value, timestamp ms) of each partition's record at offset 0."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "first-records", "enable.auto.commit": False})
    try:
        c.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
        got: dict[int, tuple[int, bytes, bytes, int]] = {}
        deadline = time.monotonic() + 30
        while len(got) < partitions and time.monotonic() < deadline:
            for m in c.consume(10, timeout=0.5):
                if m.error() is None and m.offset() == 0:
                    got[m.partition()] = (m.partition(), m.key(), m.value(), m.timestamp()[1])
        assert len(got) == partitions, got
        return sorted(got.values())
    finally:
        c.close()


class OutOfRange(Consumer):
    """The worker's real consumer, which, once `after` records of partition 0 were returned, seeks
    that partition far past its log end, as if the log had lost the position: librdkafka's next
    fetch is answered OFFSET_OUT_OF_RANGE and rd_kafka_offset_reset moves the position to
    auto.offset.reset, earliest, the log start, on its own (rdkafka_fetcher.c, rdkafka_offset.c).
    The worker sees lower offsets with no rebalance and no seek of its own. `again` holds the
    offsets of partition 0 returned after the reset."""

    def __init__(self, config: dict[str, Any], after: int) -> None:
        super().__init__(config)
        self._after, self._seen = after, 0
        self.reset = False
        self.again: list[int] = []

    def consume(self, num_messages: int = 1, timeout: float = -1) -> list[Any]:  # type: ignore[override]
        msgs = super().consume(num_messages=num_messages, timeout=timeout)
        ours = [m for m in msgs if m.error() is None and m.partition() == 0]
        if self.reset:
            self.again += [m.offset() for m in ours]
        elif ours:
            self._seen += len(ours)
            if self._seen >= self._after:
                self.seek(TopicPartition(ours[0].topic(), 0, 1 << 40))
                self.reset = True
        return msgs


@pytest.mark.parametrize("guarantee", ["at-least-once", "exactly-once"])
def test_an_out_of_range_reset_of_a_member_that_began_above_the_log_start_writes_nothing_twice(
        kafka_bootstrap: str, make_topic: Callable[..., str], group_id: str, loaded: tuple[Any, Any, Any],
        guarantee: str) -> None:
    src, out, dlq = make_topic("kw", 2), make_topic("emb", 2), make_topic("dlq", 1)
    produce_queries(kafka_bootstrap, src, load_queries(0, 1200))
    began = 150  # the group's committed offset on both partitions: what came before was processed
    c = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": group_id, "enable.auto.commit": False})
    c.commit(offsets=[TopicPartition(src, p, began) for p in (0, 1)], asynchronous=False)
    c.close()
    source = TopicReader(kafka_bootstrap, src, f"s-{group_id}")
    source.poll(5.0)
    source.close()
    expected = {r.key for r in source.records if r.offset >= began}
    assert len(source.records) == 1200 and len(expected) == 1200 - 2 * began
    made: list[OutOfRange] = []

    def consumer(config: dict[str, Any]) -> OutOfRange:
        made.append(OutOfRange(config, after=200))
        return made[-1]

    tokenizer, backend, profile = loaded
    s = Settings(bootstrap_servers=kafka_bootstrap, input_topic=src, output_topic=out, dead_letter_topic=dlq,
                 group_id=group_id, pad_to=profile.pad_to, processing_guarantee=guarantee)
    w = InProcessWorker(wire_pipeline(s, tokenizer=tokenizer, backend=backend, profile=profile,
                                      model_name="all-MiniLM-L6-v2", consumer_factory=consumer,
                                      codec=OutputCodec(model="all-MiniLM-L6-v2", dim=384, encoding="float-list"))).start()
    reader = TopicReader(kafka_bootstrap, out, f"r-{group_id}")
    try:
        reader.wait_for(expected, 120)
        reader.settle(3.0)
        assert w.stop() == 0
    finally:
        if w.code is None:
            w.stop()
        reader.close()
    assert made[0].reset and made[0].again and min(made[0].again) == 0  # librdkafka went back to the log start
    ids = Counter(r.key for r in reader.records)
    assert set(ids) >= expected  # nothing lost, in both guarantees
    if guarantee == "exactly-once":
        assert set(ids) == expected and max(ids.values()) == 1, \
            f"{len(set(ids) - expected)} records from before the member began, {sum(n > 1 for n in ids.values())} twice"
