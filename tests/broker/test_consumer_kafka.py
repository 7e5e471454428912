"""The group member's consume against the real broker: a light load is not held back."""

from __future__ import annotations

import time
from collections.abc import Callable

from confluent_kafka import Producer

from worker.deadline import Deadline
from worker.ledger.at_least_once import AtLeastOnce
from worker.ledger.committer import Committer
from worker.kafka.client_config import consumer_config
from worker.kafka.consumer import GroupMember
from worker.kafka.producer import OutputProducer
from worker.latch import FatalLatch
from worker.operations.metrics import Metrics
from worker.settings.schema import Settings


def _member(bootstrap: str, group: str) -> GroupMember:
    settings = Settings(bootstrap_servers=bootstrap, group_id=group)
    return GroupMember(consumer_config(settings), Committer(None, interval_s=1.0), FatalLatch(), Metrics(),
                       revoke_wait_s=lambda: 0.0, group=group)


def _send(bootstrap: str, topic: str, n: int) -> None:
    p = Producer({"bootstrap.servers": bootstrap})
    for i in range(n):
        p.produce(topic, key=str(i).encode(), value=b'{"id": "x", "text": "y"}')
    assert p.flush(10) == 0


def test_consume_returns_a_lone_record_without_waiting_out_the_timeout(
        kafka_bootstrap: str, make_topic: Callable[..., str], group_id: str) -> None:
    topic = make_topic("lone", 1)
    member = _member(kafka_bootstrap, group_id)
    member.subscribe(topic, AtLeastOnce(member._committer, OutputProducer({}, member._latch,
                                                                          producer_factory=lambda config: object())))
    try:
        deadline = time.monotonic() + 30
        while not member._committer.tracker.partitions():
            assert time.monotonic() < deadline, "no partition assigned"
            member.consume(10, 0.2)
        _send(kafka_bootstrap, topic, 1)
        start = time.monotonic()
        got = member.consume(500, 20.0)
        # Returned with the one record long before the 20 s timeout (consume(500, 20) alone
        # would wait all 20 s for 499 more).
        assert len(got) == 1 and time.monotonic() - start < 10.0

        # Records already fetched all come in one call, up to the limit.
        _send(kafka_bootstrap, topic, 30)
        time.sleep(1.0)
        got = member.consume(20, 5.0)
        got += member.consume(20, 5.0)
        assert len(got) == 30 and len(member.consume(20, 0.5)) == 0
    finally:
        member.close(Deadline.after(10))
