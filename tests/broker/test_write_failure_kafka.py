"""Exactly-once against the real broker: a write the broker refuses fails its transaction, not the
worker (worker/kafka/producer.py, worker/ledger/exactly_once/transactions.py).

The output topic's max.message.bytes is set below an embedding's size, so the broker refuses every
output record (MESSAGE_TOO_LARGE) and librdkafka makes the open transaction abortable:
- set back after the first abort, the member aborts, rewinds, waits, tries again and goes on:
  every ID once for a read_committed reader, and the member never exits;
- left in place, the member stops after a bounded number of failed transactions (exit 1, one
  clear message), having committed nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource

from tests.kafka_tools import TopicReader, WorkerProcess, committed_offsets, load_queries, produce_queries
from worker.ledger.exactly_once.transactions import WRITE_FAILURES

pytestmark = [pytest.mark.kafka]

QUERIES = 400
FLAGS = ["--processing-guarantee", "exactly-once", "--intra-op-threads", "1", "--transaction-interval-ms", "500"]


def set_max_message_bytes(bootstrap: str, topic: str, value: int) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    resource = ConfigResource(ConfigResource.Type.TOPIC, topic, incremental_configs=[
        ConfigEntry("max.message.bytes", str(value), incremental_operation=AlterConfigOpType.SET)])
    for fut in admin.incremental_alter_configs([resource]).values():
        fut.result(timeout=30)


def aborts(worker: WorkerProcess) -> list[dict]:
    # The refused write reaches the transaction loop as the broker's MSG_SIZE_TOO_LARGE, or as the
    # produce librdkafka refuses with _STATE once that error made the transaction abortable,
    # whichever of the two threads reports first (seen in CI: one abort of four had _STATE).
    return [e for e in worker.events("transaction aborted; partitions rewound")
            if f"write to topic '{worker.output_topic}'" in e.get("reason", "")
            and ("(MSG_SIZE_TOO_LARGE)" in e["reason"] or "(_STATE)" in e["reason"])]


def test_a_refused_write_aborts_its_transaction_and_the_stream_goes_on(
        kafka_bootstrap: str, make_topic: Callable[..., str], group_id: str, tmp_path: Path) -> None:
    src, out, dlq = make_topic("kw", 2), make_topic("emb", 2), make_topic("dlq", 1)
    set_max_message_bytes(kafka_bootstrap, out, 200)  # an embedding record is kilobytes
    queries = load_queries(0, QUERIES)
    produce_queries(kafka_bootstrap, src, queries)
    worker = WorkerProcess(kafka_bootstrap, src, out, dlq, group_id, tmp_path / "w.log",
                           [*FLAGS, "--member-id", "w"]).start()
    reader = TopicReader(kafka_bootstrap, out, f"r-{group_id}", isolation="read_committed")
    try:
        worker.wait_ready()
        deadline = time.monotonic() + 90
        while not aborts(worker):
            assert worker.proc is not None and worker.proc.poll() is None, worker.log()[-3000:]
            assert time.monotonic() < deadline, "no transaction was aborted on the refused writes"
            time.sleep(0.1)
        set_max_message_bytes(kafka_bootstrap, out, 1_048_588)
        reader.wait_for({q for q, _ in queries}, 120, alive=[worker])
        reader.settle(2.0)
        assert worker.stop() == 0, worker.log()[-3000:]
    finally:
        if worker.proc and worker.proc.poll() is None:
            worker.kill()
        reader.close()
    ids = reader.key_counts()
    assert set(ids) == {q for q, _ in queries}
    repeated = {k: n for k, n in ids.items() if n > 1}
    assert not repeated, f"{len(repeated)} IDs more than once, e.g. {list(repeated.items())[:5]}"
    stopped = worker.events("worker stopped")[-1]
    print(f"\ntransactions aborted on the refused writes: {len(aborts(worker))}; committed: "
          f"{stopped['transactions_committed']}")
    assert stopped["transactions_committed"] > 0 and stopped["writes_given_up"] > 0


def test_a_write_refused_for_good_stops_the_member_after_bounded_retries_committing_nothing(
        kafka_bootstrap: str, make_topic: Callable[..., str], group_id: str, tmp_path: Path) -> None:
    src, out, dlq = make_topic("kw", 2), make_topic("emb", 2), make_topic("dlq", 1)
    set_max_message_bytes(kafka_bootstrap, out, 200)
    produce_queries(kafka_bootstrap, src, load_queries(0, 100))
    worker = WorkerProcess(kafka_bootstrap, src, out, dlq, group_id, tmp_path / "w.log",
                           [*FLAGS, "--member-id", "w"]).start()
    try:
        worker.wait_ready()
        assert worker.proc is not None
        code = worker.proc.wait(90)
    finally:
        if worker.proc and worker.proc.poll() is None:
            worker.kill()
    assert code == 1, worker.log()[-3000:]
    assert f"writes failed {WRITE_FAILURES} transactions in a row" in worker.log()
    assert len(aborts(worker)) == WRITE_FAILURES - 1
    reader = TopicReader(kafka_bootstrap, out, f"r-{group_id}", isolation="read_committed")
    try:
        reader.settle(3.0)
    finally:
        reader.close()
    assert reader.records == []
    assert all(off < 0 for off in committed_offsets(kafka_bootstrap, group_id, src, 2).values())
