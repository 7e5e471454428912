"""Exactly-once rewinds on the poll thread, with a fake consumer that serves rebalance ops in
queue order the way librdkafka does (tests/fakes/consumer.py): the group member, the committer's
offset state, intake and the transaction loop are the real ones.

The case of the review (finding 1): a revoke op queued behind prefetched records runs inside the
*second* consume() call of one poll, while the list already holds a record X from the first; the
revoke aborts the open transaction and rewinds the partition that stays. X must not be tracked
by the rewound partition's fresh state, or the re-fetched records below it are skipped as
duplicates and never committed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tests.fakes.consumer import FakeGroupConsumer
from tests.fakes.transactions import FakeTxnProducer, interval_up
from worker.ledger.acks import Acknowledger
from worker.output.dead_letters import DeadLetters
from worker.ledger.exactly_once.loop import ExactlyOnce
from worker.ledger.exactly_once.producer import ExactlyOnceProducer
from worker.ledger.exactly_once.transactions import Transactions
from worker.ledger.inflight import InFlightTable
from worker.intake.stage import Intake
from worker.ledger.committer import Committer
from worker.kafka.consumer import GroupMember
from worker.kafka.producer import OutputProducer
from worker.latch import FatalLatch
from worker.operations.metrics import Metrics
from worker.settings.schema import Settings


@dataclass
class _Encoded:
    ids: list[int]
    length: int
    truncated: bool = False


class _Tokenizer:
    special_tokens = 2

    def encode(self, texts: list[str]) -> list[_Encoded]:
        return [_Encoded([101, len(t), 102], 3) for t in texts]


class Member:
    """One exactly-once member's poll thread over the fake consumer; `submitted` is what the
    bucketer would have, and `finish_all` plays the rest of the pipeline (output produced into
    the open transaction and acknowledged, or dropped when its partition state was revoked)."""

    def __init__(self, partitions: int = 2, records: int = 20) -> None:
        self.latch = FatalLatch()
        self.metrics = Metrics()
        self.inflight = InFlightTable()
        self.acks = Acknowledger(self.inflight, self.metrics)
        self.producer = FakeTxnProducer()
        self.committer = Committer(None, interval_s=1.0)
        self.fake: FakeGroupConsumer | None = None

        def make(config: dict[str, Any]) -> FakeGroupConsumer:
            self.fake = FakeGroupConsumer(config, partitions=partitions, records=records)
            return self.fake

        self.member = GroupMember({}, self.committer, self.latch, self.metrics, revoke_wait_s=lambda: 0.0,
                                  consumer_factory=make)
        self.txn = Transactions(self.producer, self.member.client, self.committer.tracker, self.latch,
                                lambda: len(self.inflight), interval_s=3600.0, sleep=lambda s: None)
        self.delivery = ExactlyOnce(self.txn, lambda: len(self.inflight), ExactlyOnceProducer(
            OutputProducer({}, self.latch, producer_factory=lambda config: object()), self.inflight))
        self.submitted: list[int] = []
        self.intake = Intake(Settings(input_format="raw"), _Tokenizer(), self.committer.tracker, self.inflight,
                             lambda seqs, ids: self.submitted.extend(seqs),
                             DeadLetters("dlq", 1 << 20, None, self.acks).send,  # type: ignore[arg-type]
                             self.metrics, watermarks=self.member.watermarks)
        self.delivery.start()
        self.member.subscribe("in", self)

    @property
    def consumer(self) -> FakeGroupConsumer:
        assert self.fake is not None
        return self.fake

    def on_lost(self) -> bool:
        return self.delivery.on_lost()

    def on_revoke(self, parts: Any, left_s: float) -> bool:
        """The member's rebalance listener: ExactlyOnce's, with the rest of the pipeline draining."""
        # The revoke cannot wait (revoke_timeout_s=0): the transaction aborts once the pipeline drained.
        def drained(timeout_s: float) -> bool:
            if timeout_s > 0:  # given time, what is in flight finishes (its outputs dropped: revoked)
                self.finish_all()
            return len(self.inflight) == 0
        return self.txn.on_revoke(drained, left_s)

    def poll(self, max_records: int = 8) -> None:
        msgs = self.member.consume(max_records, 0.0)
        if msgs:
            self.delivery.before_intake()
            self.intake.handle(msgs)

    def settle(self, turns: int = 3) -> None:
        """Polls and finishes everything fetched, `turns` times, then closes the transaction."""
        for _ in range(turns):
            self.poll(max_records=20)
            self.finish_all()
        interval_up(self.txn)

    def finish_all(self) -> None:
        for seq in list(self.submitted):
            rec = self.inflight.get(seq)
            if rec is not None and not rec.part.revoked:
                self.producer.produce(rec.qid)
            self.acks.embedded(seq)()
        self.acks.flush()  # what the delivery thread does after each poll
        self.submitted.clear()


def test_a_rewind_inside_the_second_consume_call_drops_the_record_of_the_first() -> None:
    m = Member(partitions=2, records=20)
    m.consumer.assign_op([0, 1])()
    m.poll(max_records=4)  # p0@0..3 into the open transaction, in flight
    assert m.txn.state == "open" and len(m.inflight) == 4
    # The next fetch holds p0@4.. then p1; a revoke of p1 is queued behind the first record, so it
    # runs inside the second call of the next poll, with p0@4 (X) already returned by the first.
    m.consumer.queue_op(m.consumer.revoke([1]), behind=1)
    m.poll(max_records=8)
    assert m.txn.aborted == 1 and m.consumer.seeks == [(0, 0)]  # aborted, p0 rewound to where it began
    for _ in range(10):
        m.poll(max_records=8)
        m.finish_all()
    interval_up(m.txn)
    interval_up(m.txn)
    assert m.txn.committed == 1 and not m.latch.is_set()
    assert sorted(m.producer.visible, key=lambda k: int(k.split("-")[1])) == [f"0-{o}" for o in range(20)]
    assert m.producer.offsets == {("in", 0): 20}


def test_records_of_a_partition_not_rewound_are_kept() -> None:
    """Only partitions whose state the second call replaced lose their first-call records: a
    partition with nothing in the aborted transaction keeps its fetch position and its record."""
    m = Member(partitions=3, records=5)
    m.consumer.assign_op([0, 1, 2])()
    m.consumer.paused = {1, 2}
    m.poll(max_records=5)  # p0@0..4 open, in flight
    m.consumer.paused = set()
    m.consumer.queue.clear()
    m.consumer._fetch()  # p1@0..4, p2@0..4 queued
    m.consumer.queue_op(m.consumer.revoke([2]), behind=1)  # behind p1@0
    m.poll(max_records=20)
    assert m.txn.aborted == 1 and m.consumer.seeks == [(0, 0)]
    for _ in range(5):
        m.poll(max_records=20)
        m.finish_all()
    interval_up(m.txn)
    interval_up(m.txn)
    assert sorted(m.producer.visible) == sorted([f"0-{o}" for o in range(5)] + [f"1-{o}" for o in range(5)])
    assert m.producer.offsets == {("in", 0): 5, ("in", 1): 5}


def test_offsets_that_go_back_without_a_rewind_are_new_records_not_duplicates() -> None:
    """Finding 7: the input topic recreated under the worker (or a log truncated): librdkafka
    resets the position to the new log's start, with no new assignment and no seek of ours. The
    lower offsets hold new records: processed and committed, never skipped."""
    m = Member(partitions=1, records=10)
    m.consumer.assign_op([0])()
    m.settle()
    assert m.txn.committed == 1 and m.producer.offsets == {("in", 0): 10}
    # Recreated with 4 records; the fetch at 10 is out of range and resets to the start (0).
    m.consumer.logs[0] = [f"new-{o}".encode() for o in range(4)]
    m.consumer.fetch_at[0] = 0
    m.consumer.queue.clear()
    m.settle()
    assert m.txn.committed == 2 and not m.latch.is_set()
    assert m.producer.visible.count("0-0") == 2 and len(m.producer.visible) == 14
    assert m.producer.offsets == {("in", 0): 4}


def test_a_refetch_from_the_start_of_the_assignment_is_skipped_not_written_again() -> None:
    """Seen in CI (the exactly-once chaos test, 218 duplicates): within one assignment, with no
    seek and no rebalance of ours, librdkafka delivered a partition again from where the member
    began, after those records were committed (there the log start: an offset reset, issue 32). The same records are skipped, and the
    partition's new records after them are processed as usual."""
    m = Member(partitions=1, records=10)
    m.consumer.assign_op([0])()
    m.settle()
    assert m.txn.committed == 1 and m.producer.offsets == {("in", 0): 10}
    m.consumer.logs[0] += [f"0-{o}".encode() for o in range(10, 13)]
    m.consumer.fetch_at[0] = 0  # the client fetches again from the start, same log
    m.consumer.queue.clear()
    m.settle()
    assert m.txn.committed == 2 and not m.latch.is_set()
    assert sorted(m.producer.visible) == sorted(f"0-{o}" for o in range(13))
    assert m.producer.offsets == {("in", 0): 13}


def test_a_reset_to_the_log_start_of_a_member_that_began_above_it_is_skipped_not_written_again() -> None:
    """Issue 32, finding 2. librdkafka's error-driven resets (OFFSET_OUT_OF_RANGE, and KIP-320's "No
    epoch found ... Reset using configured policy": rdkafka_offset.c, rd_kafka_offset_reset) go to
    auto.offset.reset, earliest: the log start, not where the member began. Here it began at its
    group's committed offset 5, and the same log (every record's leader epoch as before, its end
    past what the member consumed) comes again from 0: 0-4 were committed before the member
    began, 5-9 by it. Only 10-12 are new."""
    m = Member(partitions=1, records=10)
    m.consumer.committed = {0: 5}
    m.consumer.assign_op([0])()
    m.settle()
    assert m.txn.committed == 1 and m.producer.offsets == {("in", 0): 10}
    m.consumer.logs[0] += [f"0-{o}".encode() for o in range(10, 13)]
    m.consumer.fetch_at[0] = 0  # reset to the log start, same log
    m.consumer.queue.clear()
    m.settle()
    assert not m.latch.is_set(), m.latch.error
    assert sorted(m.producer.visible, key=lambda k: int(k.split("-")[1])) == [f"0-{o}" for o in range(5, 13)]
    assert m.producer.offsets == {("in", 0): 13}


def test_a_log_truncated_and_rewritten_under_the_member_loses_none_of_its_new_records() -> None:
    """Issue 32, finding 3. An unclean leader election: the new leader's log holds offsets 0-5 of the
    old one (the same records, leader epoch 0) and new records from 6 on, written in its epoch 1;
    librdkafka resets to the log start. The first record is unchanged (same timestamp, key and
    value), so comparing it alone took the whole delivery for a re-fetch and skipped 6-11. The
    records that are the same ones (same offset, same leader epoch) are skipped; the new ones are
    all written, and committed."""
    m = Member(partitions=1, records=10)
    m.consumer.assign_op([0])()
    m.settle()
    assert m.txn.committed == 1 and m.producer.offsets == {("in", 0): 10}
    log = m.consumer.logs[0]
    m.consumer.logs[0] = log[:6] + [f"new-{o}".encode() for o in range(6, 12)]
    m.consumer.keys[0] = {o: f"new-{o}".encode() for o in range(6, 12)}
    m.consumer.epochs[0] = {o: 1 for o in range(6, 12)}
    m.consumer.fetch_at[0] = 0
    m.consumer.queue.clear()
    m.settle()
    assert not m.latch.is_set(), m.latch.error
    assert [k for k in m.producer.visible if k.startswith("new-")] == [f"new-{o}" for o in range(6, 12)]
    assert sorted(k for k in m.producer.visible if not k.startswith("new-")) == sorted(f"0-{o}" for o in range(10))
    assert m.producer.offsets == {("in", 0): 12}


def test_a_reset_to_the_log_start_right_after_a_rewind_is_skipped_not_written_again() -> None:
    """Issue 32, findings 1 and 2 together. An abort (or a take-over) rewinds a partition, with fresh
    offset state, to where its transaction began: here offset 10, committed. Before the first
    record from there arrives, librdkafka resets the fetch position to the log start (an
    error-driven reset: a leader moved during the fault that caused the abort). A fresh state
    knew nothing of where it stood, took offset 0 for its first record, and 0-9, committed
    already, were written again: duplicates for a read_committed reader. The rewound state begins
    at its rewind offset, with the leader epochs of the state it replaces, so what lies below is
    a re-fetch."""
    m = Member(partitions=1, records=10)
    m.consumer.assign_op([0])()
    m.settle()
    assert m.txn.committed == 1 and m.producer.offsets == {("in", 0): 10}
    m.consumer.logs[0] += [f"0-{o}".encode() for o in range(10, 15)]
    m.poll(max_records=20)  # 10-14 into the open transaction
    m.txn.request_abort("a write failed")
    m.finish_all()
    interval_up(m.txn)
    assert m.txn.aborted == 1 and m.consumer.seeks[-1] == (0, 10)
    m.consumer.fetch_at[0] = 0  # reset to the log start before the rewind's first record, same log
    m.consumer.queue.clear()
    m.settle()
    assert not m.latch.is_set(), m.latch.error
    assert sorted(m.producer.visible, key=lambda k: int(k.split("-")[1])) == [f"0-{o}" for o in range(15)]
    assert m.producer.offsets == {("in", 0): 15}
