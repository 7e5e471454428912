"""The two `Delivery` implementations, transition by transition, on fakes (worker/ledger/guarantees.py
has the state tables)."""

from __future__ import annotations

from confluent_kafka import TopicPartition

from tests.fakes.transactions import FakeTxnProducer
from worker.deadline import Deadline
from worker.ledger.exactly_once.loop import ExactlyOnce
from worker.ledger.exactly_once.producer import ExactlyOnceProducer
from worker.ledger.exactly_once.transactions import Transactions
from worker.ledger.at_least_once import AtLeastOnce
from worker.ledger.inflight import InFlight, InFlightTable
from worker.formats.headers import NO_HEADERS
from worker.ledger.committer import Committer
from worker.ledger.offsets import PartitionOffsets
from worker.kafka.producer import OutputProducer
from worker.latch import FatalLatch


class CommitConsumer:
    """The consumer as the committer uses it: commits answered at once (sync) or recorded (async)."""

    def __init__(self) -> None:
        self.commits: list[tuple[list[tuple[int, int]], bool]] = []

    def commit(self, offsets: list[TopicPartition], asynchronous: bool) -> list[TopicPartition] | None:
        self.commits.append(([(tp.partition, tp.offset) for tp in offsets], asynchronous))
        return None if asynchronous else offsets

    def consumer_group_metadata(self) -> str:
        return "group-metadata"

    def seek(self, tp: TopicPartition) -> None:
        pass


def _at_least_once() -> tuple[AtLeastOnce, Committer, CommitConsumer]:
    consumer = CommitConsumer()
    committer = Committer(consumer, interval_s=0.0)
    committer.assign([TopicPartition("in", 0)])
    return AtLeastOnce(committer, OutputProducer({}, FatalLatch(), producer_factory=lambda config: object())), \
        committer, consumer


def _finished(committer: Committer, *offsets: int) -> None:
    part = committer.tracker.get("in", 0)
    assert part is not None
    for off in offsets:
        part.track(off)
        part.done(off)


def test_at_least_once_commits_on_each_step_on_revoke_and_at_finish() -> None:
    d, committer, consumer = _at_least_once()
    assert d.phase == "created"
    d.start()
    assert d.phase == "running"
    _finished(committer, 0, 1)
    assert d.poll_step(flow_paused=False) is None
    assert consumer.commits[-1] == ([(0, 2)], True)  # asynchronous, at the interval
    assert d.poll_step(flow_paused=True) == "flow control"
    assert d.bound_counts == "uncommitted"  # every uncommitted record is redone after a crash
    d.before_intake()  # nothing to open
    _finished(committer, 2)
    part = committer.tracker.get("in", 0)
    assert part is not None and d.on_revoke([part], 0.0)
    assert consumer.commits[-1] == ([(0, 3)], False)  # synchronous, inside the callback
    _finished(committer, 3)
    d.finish(Deadline.after(1.0), lambda s: None, drained=True, aborted=False)
    assert consumer.commits[-1] == ([(0, 4)], False) and d.phase == "finished"
    n = len(consumer.commits)
    d.finish(Deadline.after(1.0), lambda s: None, drained=True, aborted=False)
    assert len(consumer.commits) == n  # finished: no more commits


def test_at_least_once_commits_nothing_at_finish_after_an_abort() -> None:
    d, committer, consumer = _at_least_once()
    d.start()
    _finished(committer, 0)
    d.finish(Deadline.after(1.0), lambda s: None, drained=False, aborted=True)
    assert consumer.commits == [] and d.phase == "finished"


class _Eos:
    def __init__(self) -> None:
        self.producer = FakeTxnProducer()
        self.consumer = CommitConsumer()
        self.committer = Committer(self.consumer, interval_s=0.0)
        self.committer.assign([TopicPartition("in", 0)])
        self.in_flight: set[int] = set()
        self.stop = Deadline()
        self.latch = FatalLatch()
        self.stopped_writes = 0
        self.txn = Transactions(self.producer, self.consumer, self.committer.tracker, self.latch,
                                lambda: len(self.in_flight), interval_s=3600.0, sleep=lambda s: None, stop=self.stop)

        def stop_writes() -> None:
            self.stopped_writes += 1

        producer = ExactlyOnceProducer(OutputProducer({}, self.latch, producer_factory=lambda config: object()),
                                       InFlightTable())
        producer.interrupt = stop_writes  # type: ignore[method-assign]
        self.d = ExactlyOnce(self.txn, lambda: len(self.in_flight), producer)

    def consume(self, *offsets: int) -> None:
        self.d.before_intake()
        part = self.committer.tracker.get("in", 0)
        assert part is not None
        for off in offsets:
            part.track(off)
            self.in_flight.add(off)

    def finish_all(self) -> None:
        part = self.committer.tracker.get("in", 0)
        assert part is not None
        for off in sorted(self.in_flight):
            self.producer.produce(f"out-{off}")
            part.done(off)
        self.in_flight.clear()


def test_exactly_once_opens_on_intake_pauses_while_closing_and_commits_once_drained() -> None:
    e = _Eos()
    e.d.start()
    assert e.d.phase == "running" and e.producer.calls == ["init"]
    assert e.d.poll_step(flow_paused=False) is None
    e.consume(0, 1)
    assert e.txn.state == "open"
    assert e.d.bound_counts == "unacknowledged"  # acknowledgements bring room back, not commits
    assert e.d.poll_step(flow_paused=True) == "flow control" and e.txn.state == "open"
    assert e.d.relieve(0)  # at the bound with the transaction open: intake holds
    e.txn.began_at -= e.txn.interval_s
    assert e.d.poll_step(flow_paused=False) == "closing a transaction"
    assert e.d.relieve(0)  # intake holds while it closes: its commit brings the room back
    e.finish_all()
    assert e.d.poll_step(flow_paused=False) is None and e.txn.committed == 1
    assert e.producer.visible == ["out-0", "out-1"] and e.producer.offsets == {("in", 0): 2}
    e.d.drain_step()  # nothing: the transaction closes at finish
    e.consume(2)
    e.finish_all()
    e.d.finish(Deadline.after(1.0), lambda s: None, drained=True, aborted=False)
    assert e.txn.committed == 2 and e.d.phase == "finished" and e.d.summary() == {
        "transactions_committed": 2, "transactions_aborted": 0, "producers_taken_over": 0,
        "producers_taken_over_fenced": 0, "purged_by_abort": 0, "writes_given_up": 0}


def test_exactly_once_finish_undrained_stops_writes_then_aborts() -> None:
    e = _Eos()
    e.d.start()
    e.consume(0)
    e.stop.start(0.5)
    e.d.finish(e.stop, lambda s: None, drained=True, aborted=False)  # 0 stays in flight
    assert e.stopped_writes == 1 and e.producer.calls[-1] == "abort" and e.txn.aborted == 1
    assert not e.latch.is_set()


def test_exactly_once_start_stopped_before_init_completes_leaves_nothing_to_finish() -> None:
    e = _Eos()
    e.stop.start(5.0)  # a SIGTERM during start-up
    e.d.start()
    assert e.d.phase == "created" and e.producer.calls == []
    e.d.finish(e.stop, lambda s: None, drained=True, aborted=False)
    assert e.producer.calls == [] and e.d.phase == "finished"


def test_exactly_once_lost_partitions_abort_a_young_transaction() -> None:
    e = _Eos()
    e.d.start()
    e.consume(0)
    e.d.on_lost()
    # At the next step, without waiting for the record in flight: abort_transaction purges it
    # (tests/unit/worker/ledger/exactly_once/test_transactions.py holds the timing against the broker's own timeout).
    assert e.d.poll_step(flow_paused=False) is None
    assert e.producer.calls[-1] == "abort" and len(e.in_flight) == 1


def test_take_live_drops_records_of_revoked_partitions_and_skips_finished_ones() -> None:
    ours, gone = PartitionOffsets("in", 0, 1), PartitionOffsets("in", 1, 1)
    table = InFlightTable()
    for seq, part in enumerate([ours, gone, ours, ours]):
        table.add(seq, InFlight(part, seq, f"q{seq}", 3, False, None, 10, None, NO_HEADERS))
    live, dropped = table.take_live([0, 2, 3])  # every one live: all of them, in the batch's order
    assert [seq for seq, _ in live] == [0, 2, 3] and dropped == 0
    table.finish(2)
    gone.revoked = True
    live, dropped = table.take_live(iter([3, 1, 2, 0]))  # any iterable, read once
    assert [seq for seq, _ in live] == [3, 0] and dropped == 1
    assert len(table) == 2 and table.bytes == 20  # the revoked one left the table, the live ones stay


def test_acknowledgements_are_finished_together_after_the_poll() -> None:
    """An embedding's delivery report only notes its record; `flush` (after each producer poll)
    takes the noted records out, marks their offsets done per partition, and counts them once."""
    from worker.ledger.acks import Acknowledger
    from worker.operations.metrics import Metrics

    p0, p1 = PartitionOffsets("in", 0, 1), PartitionOffsets("in", 1, 1)
    table, metrics = InFlightTable(), Metrics()
    acks = Acknowledger(table, metrics)
    layout = [(p0, 10), (p1, 20), (p0, 11), (p1, 21), (p0, 12)]
    for seq, (part, offset) in enumerate(layout):
        part.track(offset)
        table.add(seq, InFlight(part, offset, f"q{seq}", 3, False, 1_000 + seq, 10, None, NO_HEADERS))
        table.get(seq).t_produced = 1.0  # type: ignore[union-attr]
    reports = {seq: acks.embedded(seq) for seq in range(5)}
    for seq in (2, 0, 3):  # out of order, across both partitions
        reports[seq]()
    assert len(table) == 5 and p0.committable() == 10, "nothing is finished before the flush"
    table.finish(3)  # released meanwhile (an aborted transaction's record): skipped, not counted twice
    acks.flush()
    assert len(table) == 2 and table.bytes == 20
    assert p0.committable() == 12 and p0.unfinished() == 1  # 10 and 11 done, 12 not
    assert p1.committable() == 20 and p1.unfinished() == 2  # 20 not reported; 21 left the table, not done
    assert acks.embedded_count == 2
    assert metrics.registry.get_sample_value("kwe_produced_messages_total") == 2
    reports[4]()  # a callback made before the flush still reaches the next one
    acks.flush()
    acks.flush()  # nothing noted: nothing happens
    assert p0.committable() == 13 and acks.embedded_count == 3 and len(table) == 1


def test_flush_returns_once_the_last_acknowledgements_are_finished_not_when_the_queue_empties() -> None:
    """The queue is empty once the last delivery callbacks ran, but their records are finished by
    the hook after that poll: a final commit right after flush must see them done."""
    import threading
    import time
    from typing import Any

    from worker.ledger.acks import Acknowledger
    from worker.operations.metrics import Metrics

    class Client:
        def __init__(self, config: dict[str, Any]) -> None:
            self.reports: list[Any] = []
            self.lock = threading.Lock()

        def produce(self, topic: str, value: Any, key: Any, partition: int, on_delivery: Any, _alias: Any,
                    timestamp: int, headers: Any) -> None:
            with self.lock:
                self.reports.append(on_delivery)

        def poll(self, timeout: float) -> int:
            with self.lock:
                reports, self.reports = self.reports, []
            for report in reports:
                report(None, None)
            if not reports:
                time.sleep(timeout)
            return len(reports)

        def __len__(self) -> int:
            with self.lock:
                return len(self.reports)

    part, table = PartitionOffsets("in", 0, 1), InFlightTable()
    acks = Acknowledger(table, Metrics())
    producer = OutputProducer({}, FatalLatch(), producer_factory=Client, poll_interval_s=0.01)

    def slow_hook() -> None:
        time.sleep(0.2)  # the window a commit right after the queue emptied would fall in
        acks.flush()

    producer.after_poll(slow_hook)
    part.track(7)
    table.add(0, InFlight(part, 7, "q", 3, False, None, 1, None, NO_HEADERS))
    producer.start()
    try:
        assert producer.produce("out", b"q", b"v", [], acks.embedded(0))
        assert producer.flush(Deadline.after(5.0)) == 0
        assert len(table) == 0 and part.committable() == 8
    finally:
        producer.stop(2.0)
