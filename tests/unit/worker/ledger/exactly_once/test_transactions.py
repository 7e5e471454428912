"""The exactly-once transaction loop with fakes that behave like confluent-kafka's transactional
API: a state machine (ready -> in transaction -> ready), records visible only once their
transaction commits, errors raised as KafkaException carrying a KafkaError whose fatal(),
retriable() and txn_requires_abort() say what librdkafka would."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from tests.fakes.transactions import (ABORTABLE, FENCED, INVALID_TXN_STATE, RETRIABLE, FakeTxnProducer,
                                     interval_up)
from worker.ledger.exactly_once.loss_bound import check_session
from worker.ledger.exactly_once.take_over import FENCED_TAKE_OVERS
from worker.errors import WorkerError
from worker.kafka.client_config import SESSION_TIMEOUT_MS, transactional_id, worker_configs
from worker.ledger.offsets import OffsetTracker
from worker.ledger.exactly_once.transactions import (LULL_CLOSE_S, WRITE_FAILURES, WRITE_RETRY_BACKOFF_S,
                                                       TransactionError, TransactionFencedError, TransactionHungError,
                                                       Transactions, drained_waiter, kind_of)
import worker.ledger.exactly_once.transactions as txmod
from worker.latch import FatalLatch
from worker.settings.schema import Settings



class FakeConsumer:
    def __init__(self) -> None:
        self.seeks: list[tuple[str, int, int]] = []
        # What the group coordinator answers to committed(): the offsets the producers committed.
        self.group_offsets: Callable[[], dict[tuple[str, int], int]] = dict
        self.committed_errors: list[KafkaError] = []

    def consumer_group_metadata(self) -> str:
        return "group-metadata"

    def seek(self, tp: TopicPartition) -> None:
        self.seeks.append((tp.topic, tp.partition, tp.offset))

    def committed(self, partitions: list[TopicPartition], timeout: float) -> list[TopicPartition]:
        if self.committed_errors:
            raise KafkaException(self.committed_errors.pop(0))
        known = self.group_offsets()
        return [TopicPartition(tp.topic, tp.partition, known.get((tp.topic, tp.partition), -1001))
                for tp in partitions]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Loop:
    """A Transactions over the fakes, with an in-flight set the test finishes records from."""

    def __init__(self, partitions: int = 2) -> None:
        self.producer = FakeTxnProducer()
        self.consumer = FakeConsumer()
        self.tracker = OffsetTracker()
        self.latch = FatalLatch()
        self.clock = Clock()
        self.in_flight: dict[tuple[int, int], Any] = {}
        self.outcomes: list[tuple[str, float]] = []
        self.progress: list[float] = []
        for p in range(partitions):
            self.tracker.assign("in", p)
        self.txn = Transactions(self.producer, self.consumer, self.tracker, self.latch, lambda: len(self.in_flight),
                                interval_s=1.0, clock=self.clock, sleep=lambda s: None,
                                on_outcome=lambda o, s: self.outcomes.append((o, s)),
                                on_progress=lambda: self.progress.append(self.clock.now))
        self.txn.init()

    def consume(self, partition: int, *offsets: int) -> None:
        self.txn.ensure_open()
        part = self.tracker.get("in", partition)
        assert part is not None
        for off in offsets:
            part.track(off)
            self.in_flight[(partition, off)] = part

    def finish(self, partition: int, offset: int) -> None:
        """The record's output is produced (into the open transaction) and acknowledged."""
        part = self.in_flight.pop((partition, offset))
        if part.revoked:
            return
        self.producer.produce(f"out-{partition}-{offset}")
        part.done(offset)


def test_a_transaction_closes_only_when_everything_consumed_into_it_is_finished() -> None:
    loop = Loop()
    loop.consume(0, 10, 11, 12)
    loop.consume(1, 5)
    loop.finish(0, 11)
    loop.finish(1, 5)
    loop.clock.now = 1.5
    loop.txn.step()
    assert loop.txn.state == "closing" and loop.txn.closing  # intake pauses
    assert "commit" not in loop.producer.calls  # 10 and 12 are still in flight
    loop.finish(0, 12)
    loop.txn.step()
    assert "commit" not in loop.producer.calls
    loop.finish(0, 10)
    loop.txn.step()
    assert loop.producer.offsets == {("in", 0): 13, ("in", 1): 6}
    assert sorted(loop.producer.visible) == ["out-0-10", "out-0-11", "out-0-12", "out-1-5"]
    assert loop.txn.state == "idle" and not loop.txn.closing
    assert loop.outcomes == [("committed", 1.5)]
    assert loop.progress == [1.5]  # the stall check of /healthz sees the commit point move
    # The committed offsets count as committed: nothing is uncommitted any more.
    assert all(p.uncommitted() == 0 for p in loop.tracker.partitions())


def test_a_transaction_closes_in_a_lull_once_everything_in_it_is_finished() -> None:
    loop = Loop()
    loop.consume(0, 1, 2)
    loop.finish(0, 1)
    loop.clock.now = LULL_CLOSE_S
    loop.txn.step()
    assert loop.txn.state == "open"  # a record still in flight: closing now would drain it
    loop.finish(0, 2)
    loop.txn.step()
    assert loop.txn.state == "idle" and loop.producer.offsets == {("in", 0): 3}  # long before the interval (1 s)
    loop.consume(0, 3)
    loop.finish(0, 3)
    loop.clock.now += LULL_CLOSE_S / 2
    loop.txn.step()
    assert loop.txn.state == "open"  # too young: a trickle closes at most one a LULL_CLOSE_S


def test_a_transaction_stays_open_until_its_interval_is_up_whatever_flow_control_does() -> None:
    # Flow control bounds the records not yet acknowledged: a commit would free none of them, so
    # closing at the bound only drained the pipeline every max_in_flight records (issue 59).
    loop = Loop()
    loop.consume(0, 1)
    loop.finish(0, 1)
    loop.txn.step()
    assert loop.txn.state == "open" and not loop.txn.closing  # the interval is not up
    loop.clock.now = 1.0
    loop.txn.step()
    assert loop.txn.state == "idle" and loop.producer.offsets == {("in", 0): 2}


def test_no_transaction_is_begun_until_records_come_and_the_next_begins_after_the_commit() -> None:
    loop = Loop()
    loop.clock.now = 5.0
    loop.txn.step()
    assert "begin" not in loop.producer.calls
    loop.consume(0, 1)
    loop.finish(0, 1)
    loop.clock.now = 7.0
    loop.txn.step()
    loop.consume(0, 2)
    assert loop.producer.calls == ["init", "begin", "send_offsets", "commit", "begin"]


def test_a_retriable_error_is_retried_and_the_transaction_commits() -> None:
    loop = Loop()
    loop.producer.errors["commit"] = [RETRIABLE, RETRIABLE]
    loop.consume(0, 1)
    loop.finish(0, 1)
    loop.clock.now = 2
    loop.txn.step()
    assert loop.producer.calls.count("commit") == 3 and loop.producer.visible == ["out-0-1"]
    assert loop.txn.committed == 1 and loop.txn.aborted == 0


def test_a_commit_that_times_out_is_resumed_not_aborted() -> None:
    """Issue 32, finding 6. A commit_transaction that times out goes on in librdkafka's background;
    the call is made again to resume it ("This call is resumable when a retriable timeout error is
    returned", rdkafka.h), and abort_transaction meanwhile is refused with _CONFLICT (rdkafka_txnmgr.c,
    rd_kafka_txn_curr_api_begin). Seven timeouts in a row (more than RETRIES), then it completes."""
    loop = Loop()
    loop.producer.errors["commit"] = [RETRIABLE] * 7
    loop.consume(0, 1)
    loop.finish(0, 1)
    loop.clock.now = 2
    loop.txn.step()
    assert not loop.latch.is_set(), loop.latch.error
    assert loop.producer.calls.count("commit") == 8 and "abort" not in loop.producer.calls
    assert loop.producer.visible == ["out-0-1"] and loop.producer.offsets == {("in", 0): 2}
    assert loop.txn.committed == 1 and loop.txn.aborted == 0


def test_a_commit_unfinished_at_the_shutdown_deadline_is_left_to_the_next_init() -> None:
    """Stopping: resumed until the deadline, then left under way (not aborted: _CONFLICT); nothing
    more is consumed or committed and the member exits cleanly. The transaction commits or aborts
    as one, offsets included, when the next init_transactions of this member ends it."""
    import time

    loop = Loop()
    loop.txn.sleep = time.sleep
    loop.producer.errors["commit"] = [RETRIABLE] * 1000
    loop.consume(0, 1)
    loop.finish(0, 1)
    loop.txn.stop.start(0.5)
    loop.txn.finish(lambda timeout_s: True, 0.5)
    assert not loop.latch.is_set(), loop.latch.error
    assert "abort" not in loop.producer.calls and loop.producer.resuming == "commit"
    assert loop.txn.closing and loop.tracker.partitions() == []  # halted: nothing more is taken


@pytest.mark.parametrize("call", ["send_offsets", "commit"])
def test_an_abortable_error_aborts_and_rewinds_to_the_last_committed_offsets(call: str) -> None:
    loop = Loop()
    loop.consume(0, 0, 1)
    loop.consume(1, 7)
    for key in list(loop.in_flight):
        loop.finish(*key)
    loop.clock.now = 1
    loop.txn.step()  # first transaction commits: offsets 2 and 8
    old = {p.partition: p for p in loop.tracker.partitions()}
    loop.consume(0, 2, 3)
    loop.consume(1, 8)
    for key in list(loop.in_flight):
        loop.finish(*key)
    loop.producer.errors[call] = [ABORTABLE]
    loop.clock.now = 3
    loop.txn.step()
    assert loop.producer.calls[-1] == "abort"
    assert loop.producer.visible == ["out-0-0", "out-0-1", "out-1-7"]  # nothing of the aborted one
    assert loop.producer.offsets == {("in", 0): 2, ("in", 1): 8}
    assert sorted(loop.consumer.seeks) == [("in", 0, 2), ("in", 1, 8)]
    # Fresh offset state: the old one is revoked, so a straggler of the aborted transaction is dropped.
    assert all(old[p].revoked for p in old)
    new = {p.partition: p for p in loop.tracker.partitions()}
    assert all(new[p] is not old[p] and not new[p].revoked for p in new)
    new[0].track(2)  # the rewound record is taken again, not refused as a re-fetch
    assert loop.txn.state == "idle" and loop.outcomes[-1][0] == "aborted" and loop.txn.aborted == 1


def test_an_abort_before_any_commit_rewinds_to_where_the_assignment_started() -> None:
    loop = Loop(partitions=1)
    loop.consume(0, 40, 41)
    loop.finish(0, 40)
    loop.finish(0, 41)
    loop.producer.errors["send_offsets"] = [ABORTABLE]
    interval_up(loop.txn)
    assert loop.consumer.seeks == [("in", 0, 40)] and loop.producer.visible == []


def test_a_fenced_member_trips_the_latch_and_writes_nothing_more() -> None:
    loop = Loop()
    loop.consume(0, 1)
    loop.finish(0, 1)
    loop.producer.errors["send_offsets"] = [FENCED]
    interval_up(loop.txn)
    assert isinstance(loop.latch.error, TransactionFencedError) and "fenced" in str(loop.latch.error)
    assert loop.producer.visible == [] and loop.producer.offsets == {}
    calls = list(loop.producer.calls)
    interval_up(loop.txn)
    loop.txn.finish(drained_waiter(lambda: 0, lambda s: None), 1.0)  # shutdown: a zombie does not abort
    assert loop.producer.calls == calls and loop.producer.visible == []


def test_after_another_fatal_error_shutdown_aborts_the_open_transaction() -> None:
    loop = Loop()
    loop.consume(0, 1)
    loop.latch.trip(WorkerError("the backend broke"))
    loop.txn.finish(lambda timeout_s: True, 1.0)
    assert loop.producer.calls[-1] == "abort" and loop.txn.aborted == 1


def test_a_revoke_commits_the_open_transaction_when_it_drains_in_time() -> None:
    loop = Loop()
    loop.consume(0, 1)
    loop.consume(1, 1)

    def drain(timeout_s: float) -> bool:
        for key in list(loop.in_flight):
            loop.finish(*key)
        return True

    assert loop.txn.on_revoke(drain, 5.0)
    assert loop.producer.offsets == {("in", 0): 2, ("in", 1): 2} and loop.txn.state == "idle"


def test_a_revoke_that_cannot_wait_aborts_and_drops_what_finishes_later() -> None:
    loop = Loop()
    loop.consume(0, 1, 2)
    loop.finish(0, 1)
    waits: list[float] = []

    def drain(timeout_s: float) -> bool:
        waits.append(timeout_s)
        if len(waits) == 1:
            return False  # the revoke's time ran out with record 2 in flight
        loop.finish(0, 2)  # finishes after the revoke: its partition state is revoked, so dropped
        return True

    assert not loop.txn.on_revoke(drain, 0.5)
    assert loop.producer.calls[-1] == "abort" and loop.producer.visible == []
    assert "out-0-2" not in loop.producer.open and loop.consumer.seeks == [("in", 0, 1)]
    assert not loop.latch.is_set()


def test_records_stuck_in_flight_at_an_abort_stop_the_member_which_aborts_on_the_way_out() -> None:
    loop = Loop()
    loop.consume(0, 1)
    assert not loop.txn.on_revoke(lambda timeout_s: False, 0.1)
    # Not fenced (finding 4): the member stops, and its shutdown still aborts the transaction,
    # so read_committed readers are not held back until transaction_timeout_ms.
    assert isinstance(loop.latch.error, TransactionError) and "in flight" in str(loop.latch.error)
    assert not isinstance(loop.latch.error, TransactionFencedError)
    assert "abort" not in loop.producer.calls  # a late produce could otherwise land in the next one
    stopped: list[bool] = []
    loop.txn.finish(lambda timeout_s: False, 0.0, stop_writes=lambda: stopped.append(True))
    assert stopped == [True] and loop.producer.calls[-1] == "abort" and loop.txn.state == "idle"


def test_an_abort_that_fails_without_fencing_is_not_reported_as_fenced() -> None:
    loop = Loop()
    loop.consume(0, 1)
    loop.finish(0, 1)
    loop.producer.errors["abort"] = [ABORTABLE] * 5
    loop.txn.abort_and_rewind("test")
    assert isinstance(loop.latch.error, TransactionError) and "could not be aborted" in str(loop.latch.error)


def test_a_revoke_served_during_the_final_drain_closes_the_transaction_and_finish_leaves_it() -> None:
    """Finding 2: the shutdown's drain serves the group; a revoke inside it commits the
    transaction; finish must not commit again (commit_transaction with none open is a state error)."""
    loop = Loop()
    loop.consume(0, 1)
    loop.finish(0, 1)

    def drain_with_a_revoke(timeout_s: float) -> bool:
        assert loop.txn.on_revoke(lambda t: True, 1.0)  # the nested rebalance callback
        return True

    loop.txn.finish(drain_with_a_revoke, 1.0)
    assert loop.producer.calls.count("commit") == 1 and loop.producer.visible == ["out-0-1"]
    assert not loop.latch.is_set() and loop.txn.state == "idle"


def test_lost_partitions_abort_a_young_transaction_at_once_without_waiting_for_the_drain() -> None:
    """Issue 57: the abort after lost partitions waited for the records in flight, which may stay
    there up to message.timeout.ms (60 s by default), so an abort checked young at 40 s went out
    at 50 s, past the 44 s bound, and could land after the broker's own timeout (then its epoch
    bump fences the successor). It goes at the next step now: abort_transaction purges them."""
    loop = Loop()
    loop.consume(0, 1)
    # An outage that outlived the 30 s session: the partitions go about a session after the last
    # heartbeat, with a transaction about that old (CI, 2026-12-05: 32.9 s), which the 60 s
    # transaction timeout leaves the broker nowhere near timing out: abort, and go on.
    loop.clock.now = 40.0
    loop.txn.lost()
    assert loop.txn.closing and not loop.latch.is_set()
    loop.txn.step()
    assert loop.producer.calls[-1] == "abort", "the abort waited for a record still in flight"
    assert loop.txn.state == "idle" and loop.consumer.seeks == [("in", 0, 1)]
    loop.clock.now = 50.0  # the record's write comes back (purged, or late): of the aborted transaction
    loop.finish(0, 1)
    loop.txn.step()
    assert loop.producer.calls.count("abort") == 1 and loop.producer.visible == [] and not loop.latch.is_set()
    loop.consume(0, 1)  # consumed again, into the next transaction, and committed
    loop.finish(0, 1)
    loop.clock.now = 52.0
    loop.txn.step()
    assert loop.producer.visible == ["out-0-1"] and loop.producer.offsets == {("in", 0): 2}


def test_a_lost_transactions_age_is_checked_again_as_its_abort_goes() -> None:
    """Young when the partitions were lost (40 s), 45 s by the time the abort could go (the output
    thread held the write gate): past the 44 s bound, so no abort; the member stops as a zombie."""
    loop = Loop()

    class SlowGate:
        def __enter__(self) -> None:
            loop.clock.now = 45.0

        def __exit__(self, *exc: object) -> None:
            pass

    loop.txn.write_gate = SlowGate()
    loop.consume(0, 1)
    loop.finish(0, 1)
    loop.clock.now = 40.0
    loop.txn.lost()
    assert not loop.latch.is_set()
    loop.txn.step()
    assert isinstance(loop.latch.error, TransactionFencedError) and "45 s" in str(loop.latch.error)
    loop.txn.finish(lambda timeout_s: True, 1.0)
    assert "abort" not in loop.producer.calls and loop.producer.visible == []


def test_a_lost_transaction_too_old_by_shutdown_is_not_aborted_on_the_way_out() -> None:
    loop = Loop()
    loop.consume(0, 1)
    loop.clock.now = 40.0
    loop.txn.lost()
    loop.clock.now = 46.0  # a stop before the next step
    loop.txn.stop.start(5.0)
    loop.txn.finish(lambda timeout_s: True, 1.0)
    assert isinstance(loop.latch.error, TransactionFencedError) and "abort" not in loop.producer.calls


def test_lost_partitions_with_an_old_transaction_stop_the_member_without_aborting() -> None:
    loop = Loop()
    loop.consume(0, 1)
    loop.clock.now = 45.0  # an abort bounded by 10 + 5 s could land after the broker's 60 s timeout
    loop.txn.lost()
    assert isinstance(loop.latch.error, TransactionFencedError) and "lost" in str(loop.latch.error)
    loop.finish(0, 1)
    loop.txn.step()
    loop.txn.finish(lambda timeout_s: True, 1.0)
    # An abort would bump the epoch of a timed-out transaction and fence the successor.
    assert "abort" not in loop.producer.calls and loop.producer.visible == []


@pytest.mark.parametrize(("transaction_timeout_s", "abortable_s"), [(60.0, 44.0), (120.0, 104.0), (5.0, 2.5)])
def test_a_lost_transaction_is_abortable_while_its_abort_lands_before_the_broker_timeout(
        transaction_timeout_s: float, abortable_s: float) -> None:
    """The call bound (timeout_s 10 s + HANG_MARGIN_S 5 s) and the clock slack (1 s) before the
    broker's timeout; half the timeout where that is less (a 5 s timeout, as tests use)."""
    loop = Loop()
    loop.txn.transaction_timeout_s = transaction_timeout_s
    assert loop.txn.abortable_after_loss_s() == pytest.approx(abortable_s)


def test_the_defaults_leave_an_outage_past_the_session_room_to_abort() -> None:
    """A member that loses its partitions to an outage just past its session, with a transaction
    begun an interval before the last heartbeat, aborts and goes on; it does not stop."""
    settings = Settings(processing_guarantee="exactly-once")
    loop = Loop()
    loop.txn.transaction_timeout_s = settings.transaction_timeout_ms / 1000
    worst_age_s = (SESSION_TIMEOUT_MS + settings.transaction_interval_ms) / 1000
    assert worst_age_s + 5 < loop.txn.abortable_after_loss_s()
    assert check_session(settings) is None


def test_lost_partitions_without_an_open_transaction_change_nothing() -> None:
    loop = Loop()
    loop.txn.lost()
    assert not loop.latch.is_set() and not loop.txn.closing


def test_an_abort_requested_waits_for_the_pipeline_to_drain() -> None:
    loop = Loop()
    loop.consume(0, 1)
    loop.txn.request_abort("test")
    assert loop.txn.closing
    loop.txn.step()
    assert "abort" not in loop.producer.calls
    loop.finish(0, 1)
    loop.txn.step()
    assert loop.producer.calls[-1] == "abort" and loop.producer.visible == []


def test_shutdown_commits_a_drained_transaction_and_aborts_an_undrained_one() -> None:
    loop = Loop()
    loop.consume(0, 1)
    loop.finish(0, 1)
    loop.txn.finish(drained_waiter(lambda: len(loop.in_flight), lambda s: None), 1.0)
    assert loop.producer.visible == ["out-0-1"]
    loop.consume(0, 2)
    loop.txn.finish(lambda timeout_s: False, 0.0)
    assert loop.producer.calls[-1] == "abort" and loop.txn.state == "idle"


def test_init_retries_a_retriable_error_and_stops_on_a_fatal_one() -> None:
    loop = Loop()
    loop.producer.errors["init"] = [RETRIABLE]
    loop.txn.init()
    assert loop.producer.calls.count("init") == 3
    loop.producer.errors["init"] = [FENCED]
    with pytest.raises(TransactionFencedError) as info:
        loop.txn.init()
    assert isinstance(info.value, WorkerError)


def test_errors_are_classified_as_librdkafka_marks_them() -> None:
    assert kind_of(KafkaException(FENCED)) == "fatal"
    assert kind_of(KafkaException(ABORTABLE)) == "abort"
    assert kind_of(KafkaException(RETRIABLE)) == "retry"
    assert kind_of(KafkaException(KafkaError(KafkaError.ILLEGAL_GENERATION, "stale"))) == "abort"


def test_the_transactional_config() -> None:
    def producer(**kw: Any) -> dict[str, Any]:
        return worker_configs(Settings(processing_guarantee="exactly-once", group_id="g", member_id="pod-1",
                                       **kw)).producer

    config = producer(transaction_timeout_ms=20_000)
    assert config["transactional.id"] == transactional_id("g", "pod-1") == "keyword-embedder-g-pod-1"
    # The message timeout is cut to the transaction's, the worker's own and a --kafka-config one alike.
    assert config["transaction.timeout.ms"] == 20_000 and config["message.timeout.ms"] == 20_000
    assert producer(transaction_timeout_ms=90_000, kafka_config=("message.timeout.ms=120000",))[
        "message.timeout.ms"] == 90_000
    assert producer(transaction_timeout_ms=90_000, kafka_config=("message.timeout.ms=80000",))[
        "message.timeout.ms"] == 80_000
    assert "transactional.id" not in worker_configs(Settings(group_id="g")).producer


def test_a_transactional_call_that_hangs_stops_the_member() -> None:
    import threading

    loop = Loop()
    loop.txn.timeout_s = 0.05
    release = threading.Event()
    real = loop.producer.send_offsets_to_transaction

    def hang(positions: Any, metadata: Any, timeout: float) -> None:
        release.wait(10)  # blocks past its own timeout, as librdkafka's did after a broker restart
        real(positions, metadata, timeout)

    loop.producer.send_offsets_to_transaction = hang  # type: ignore[method-assign]
    import worker.ledger.exactly_once.bounded_calls as calls
    old_margin, calls.HANG_MARGIN_S = calls.HANG_MARGIN_S, 0.1
    try:
        loop.consume(0, 1)
        loop.finish(0, 1)
        interval_up(loop.txn)
    finally:
        calls.HANG_MARGIN_S = old_margin
        release.set()
    assert isinstance(loop.latch.error, TransactionHungError)
    assert "send_offsets_to_transaction" in str(loop.latch.error)
    assert "commit" not in loop.producer.calls and loop.producer.visible == []


def test_records_purged_by_an_abort_are_not_delivery_errors() -> None:
    """Finding 3: abort_transaction purges the producer's queue; the delivery reports of the purged
    records (_PURGE_QUEUE, _PURGE_INFLIGHT) must not stop the worker as failed writes, and after
    the shutdown's abort nothing more is written."""
    from worker.ledger.exactly_once.producer import ExactlyOnceProducer
    from worker.ledger.inflight import InFlightTable
    from worker.kafka.producer import OutputProducer

    class Client:
        def __init__(self, config: dict[str, Any]) -> None:
            self.reports: list[Any] = []

        def produce(self, topic: str, value: Any, key: Any, partition: int, on_delivery: Any, _alias: Any,
                    timestamp: int, headers: Any) -> None:
            self.reports.append(on_delivery)

    latch = FatalLatch()
    producer = ExactlyOnceProducer(OutputProducer({}, latch, producer_factory=Client), InFlightTable())
    acked: list[int] = []
    for i in range(3):
        assert producer.produce("out", b"k", b"v", [], lambda i=i: acked.append(i))
    client = producer.client
    client.reports[0](KafkaError(KafkaError._PURGE_QUEUE), None)
    client.reports[1](KafkaError(KafkaError._PURGE_INFLIGHT), None)
    assert not latch.is_set() and acked == [] and producer.purged == 2
    producer.interrupt()
    assert not producer.produce("out", b"k", b"v", [], lambda: acked.append(9))
    assert len(client.reports) == 3
    client.reports[2](KafkaError(KafkaError._MSG_TIMED_OUT), None)  # a real failure still stops it
    assert latch.is_set() and "could not write" in str(latch.error)


# ------------------------------------------------- a failed write (exactly-once)
class Gate:
    """The producer's write gate, recording what the transaction loop did while holding it."""

    def __init__(self, producer: FakeTxnProducer) -> None:
        self.producer = producer
        self.held_for: list[list[str]] = []

    def __enter__(self) -> None:
        self._start = len(self.producer.calls)

    def __exit__(self, *exc: Any) -> None:
        self.held_for.append(self.producer.calls[self._start:])


def _failing_loop() -> tuple[Loop, Gate]:
    loop = Loop()
    gate = Gate(loop.producer)
    loop.txn.write_gate = gate
    return loop, gate


def test_a_failed_write_aborts_at_once_without_waiting_for_the_records_librdkafka_holds() -> None:
    loop, gate = _failing_loop()
    loop.consume(0, 0, 1)
    loop.consume(1, 5)
    loop.finish(0, 0)
    old = {p.partition: p for p in loop.tracker.partitions()}
    loop.txn.write_failed("could not write to topic 'out': Broker: Message size too large")
    assert loop.txn.closing  # intake pauses at once
    loop.txn.step()  # records (0, 1) and (1, 5) are still in flight
    assert loop.producer.calls[-1] == "abort" and gate.held_for == [["abort"]]
    assert loop.producer.visible == [] and loop.txn.aborted == 1
    assert sorted(loop.consumer.seeks) == [("in", 0, 0), ("in", 1, 5)]
    assert all(p.revoked for p in old.values())  # the stragglers are dropped by the output stage
    # Intake waits before the retry, then the next transaction commits and the count starts again.
    assert loop.txn.closing
    loop.clock.now += WRITE_RETRY_BACKOFF_S
    assert not loop.txn.closing
    loop.in_flight.clear()
    loop.consume(0, 0, 1)
    for key in list(loop.in_flight):
        loop.finish(*key)
    loop.clock.now += 2
    loop.txn.step()
    assert loop.producer.visible == ["out-0-0", "out-0-1"] and loop.producer.offsets == {("in", 0): 2}
    assert loop.txn._writes.in_row == 0


def test_writes_failing_transaction_after_transaction_stop_the_member_with_backoff_between() -> None:
    loop, _ = _failing_loop()
    waits = []
    for attempt in range(WRITE_FAILURES):
        loop.in_flight.clear()
        loop.consume(0, 0)
        loop.txn.write_failed(f"could not write to topic 'out': attempt {attempt}")
        before = loop.clock.now
        loop.txn.step()
        if loop.latch.is_set():
            break
        while loop.txn.closing:
            loop.clock.now += 0.25
        waits.append(loop.clock.now - before)
    assert waits == [0.5, 1.0, 2.0, 4.0]
    assert isinstance(loop.latch.error, TransactionError)
    assert "5 transactions in a row" in str(loop.latch.error) and "attempt 4" in str(loop.latch.error)
    assert loop.producer.visible == []


def test_a_failure_reported_as_the_last_record_leaves_makes_the_commit_abort() -> None:
    loop, _ = _failing_loop()
    loop.consume(0, 0, 1)
    loop.finish(0, 0)
    loop.clock.now = 1
    loop.txn.step()  # closing: waits for (0, 1)
    assert loop.txn.state == "closing"
    loop.txn.write_failed("could not write to topic 'out': Local: Erroneous state")
    loop.in_flight.clear()  # the failed record was given up: nothing in flight any more
    assert loop.txn.commit() is False
    assert loop.producer.calls[-1] == "abort" and loop.producer.visible == [] and loop.producer.offsets == {}


def test_a_failure_reported_with_no_transaction_open_fails_nothing() -> None:
    loop, _ = _failing_loop()
    loop.txn.write_failed("a straggler of an aborted transaction")
    loop.txn.step()
    assert not loop.txn.closing and "abort" not in loop.producer.calls
    loop.consume(0, 0)
    loop.finish(0, 0)
    loop.clock.now = 1
    loop.txn.step()
    assert loop.producer.visible == ["out-0-0"]


def test_a_revoke_with_a_failed_write_aborts_instead_of_stopping_the_member() -> None:
    loop, _ = _failing_loop()
    loop.consume(0, 0, 1)
    loop.txn.write_failed("could not write to topic 'out': Broker: Out of order sequence number")
    waited: list[float] = []

    def never_drains(seconds: float) -> bool:  # librdkafka holds the failed transaction's records
        waited.append(seconds)
        return False

    assert loop.txn.on_revoke(never_drains, 10.0) is False
    assert not loop.latch.is_set() and loop.producer.calls[-1] == "abort" and loop.txn.state == "idle"


def test_a_refused_write_fails_its_transaction_before_its_record_leaves_the_in_flight_table() -> None:
    """Issue 32, finding 4. A write refused by the client (MSG_SIZE_TOO_LARGE against the producer's
    message.max.bytes) does not make librdkafka's transaction abortable, so only the worker's own
    report stops it from committing. The poll thread commits once nothing is in flight: if the record
    left the in-flight table before the failure was reported, a poll turn in between (the barrier
    here) commits the transaction, the failure then finds no transaction and is dropped, and the
    record's offset never completes."""
    import threading

    from worker.ledger.acks import Acknowledger
    from worker.ledger.exactly_once.producer import ExactlyOnceProducer
    from worker.ledger.inflight import InFlight, InFlightTable
    from worker.ledger.inflight import InFlightTable
    from worker.formats.headers import InputHeaders
    from worker.kafka.producer import OutputProducer
    from worker.operations.metrics import Metrics

    class Client(FakeTxnProducer):
        """The transactional fake, producing like librdkafka: refused at once when too large."""

        def __init__(self, config: dict[str, Any]) -> None:
            super().__init__()
            self.reports: list[Any] = []

        def produce(self, topic: str, value: Any = None, key: Any = None, partition: int = -1,  # type: ignore[override]
                    on_delivery: Any = None, _alias: Any = None, timestamp: int = 0, headers: Any = None) -> None:
            if value == b"too large":
                raise KafkaException(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE, "Message size too large"))
            super().produce(value.decode())
            self.reports.append(on_delivery)

    latch = FatalLatch()
    inflight = InFlightTable()
    acks = Acknowledger(inflight, Metrics())
    wrapper = ExactlyOnceProducer(OutputProducer({}, latch, producer_factory=Client), inflight)
    client = wrapper.client
    tracker = OffsetTracker()
    part = tracker.assign("in", 0)
    clock = Clock()
    consumer = FakeConsumer()
    txn = Transactions(client, consumer, tracker, latch, inflight.__len__, interval_s=1.0, clock=clock,
                       sleep=lambda s: None, write_gate=wrapper.write_gate)
    turns: list[int] = []

    def failed(reason: str) -> None:
        # The barrier: the poll thread takes a turn between the write's failure and its report.
        poll = threading.Thread(target=lambda: (turns.append(inflight.__len__()), interval_up(txn)))
        poll.start()
        poll.join()
        txn.write_failed(reason)

    wrapper.fail_writes_into(failed)
    txn.init()
    txn.ensure_open()
    for off in (0, 1):
        part.track(off)
        inflight.add(off, InFlight(part, off, f"q{off}", 3, False, None, 1, None, InputHeaders()))
    assert wrapper.produce("out", b"q0", b"q0", [], acks.embedded(0), wrapper.release(0))
    client.reports[0](None, None)  # the delivery thread acknowledges q0
    acks.flush()  # and finishes it after its poll
    clock.now = 1.5
    txn.step()
    assert txn.state == "closing"  # waits for q1
    assert wrapper.produce("out", b"q1", b"too large", [], acks.embedded(1), wrapper.release(1))
    txn.step()
    assert not latch.is_set(), latch.error
    assert "commit" not in client.calls and client.calls[-1] == "abort" and client.offsets == {}
    assert turns == [1]  # the poll turn in between saw the failed record still in flight
    assert consumer.seeks == [("in", 0, 0)] and txn.aborted == 1  # q0 and q1 are consumed again


# ------------------------------------------------- a hung call: a new producer takes over
class Stuck:
    """Makes one call of a fake producer block (as librdkafka's did after a coordinator's node was
    SIGKILLed, past its own timeout) until released; `after` runs the real call first (a commit
    that reached the coordinator although the call never returned)."""

    def __init__(self, producer: FakeTxnProducer, name: str, *, after: bool = False) -> None:
        import threading

        self.release = threading.Event()
        real = getattr(producer, name)

        def blocked(*args: Any) -> None:
            if after:
                real(*args)
            self.release.wait(10)
            if not after:
                real(*args)

        setattr(producer, name, blocked)

    def __enter__(self) -> "Stuck":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()


@pytest.fixture
def short_hang(monkeypatch: pytest.MonkeyPatch) -> None:
    import worker.ledger.exactly_once.bounded_calls as calls

    monkeypatch.setattr(calls, "HANG_MARGIN_S", 0.1)


class TakeOverLoop(Loop):
    """A Loop whose transaction loop can replace its producer: each replacement is a new fake
    producer; the group coordinator's committed offsets are what any of them committed."""

    def __init__(self) -> None:
        super().__init__()
        self.producers = [self.producer]
        self.stuck: list[Any] = []
        self.forgotten: list[int] = []
        self.consumer.group_offsets = lambda: {k: v for p in self.producers for k, v in p.offsets.items()}
        self.txn.timeout_s = 0.05
        self.txn.replace_producer = self.replace
        self.txn.forget_revoked = self.forget

    def commit_one(self, offset: int = 5) -> None:
        """One record of partition 0 consumed, finished, and its transaction closed."""
        self.consume(0, offset)
        self.finish(0, offset)
        interval_up(self.txn)

    def intake(self, partition: int, *offsets: int) -> None:
        """Records the member fetched, as the pipeline takes them: a transaction is opened for them
        (before_intake), then each is tracked by its partition's offset state, or dropped when the
        partition has none (worker/intake/stage.py)."""
        self.txn.ensure_open()
        part = self.tracker.get("in", partition)
        if part is None:
            return
        for off in offsets:
            part.track(off)
            self.in_flight[(partition, off)] = part

    def replace(self, stuck: Any) -> FakeTxnProducer:
        self.stuck.append(stuck)
        self.producer = FakeTxnProducer()
        self.producers.append(self.producer)
        return self.producer

    def forget(self) -> int:
        gone = [k for k, part in self.in_flight.items() if part.revoked]
        for k in gone:
            del self.in_flight[k]
        self.forgotten.append(len(gone))
        return len(gone)


def test_a_hung_send_offsets_is_taken_over_by_a_new_producer_and_the_records_are_consumed_again(
        short_hang: None) -> None:
    """Issue 21: a coordinator's node SIGKILLed, send_offsets_to_transaction never returns. The
    member does not exit: a new producer takes over (init_transactions fences the old one and
    aborts its transaction), and the partitions go back to the group's committed offsets."""
    loop = TakeOverLoop()
    old = loop.producer
    stuck = Stuck(old, "send_offsets_to_transaction")
    try:
        loop.consume(0, 5, 6)
        loop.finish(0, 5)
        loop.finish(0, 6)
        interval_up(loop.txn)
        assert not loop.latch.is_set(), loop.latch.error
        assert len(loop.producers) == 2 and loop.stuck[0].is_alive()  # still blocked in the old one
        new = loop.producer
        assert new.calls == ["init"] and loop.txn.producer is new
        assert loop.consumer.seeks == [("in", 0, 5)]  # nothing committed: back to where it began
        assert loop.outcomes[-1][0] == "taken_over" and loop.txn.taken_over == 1 and loop.txn.state == "idle"
        # The records are consumed again and committed once, through the new producer.
        loop.consume(0, 5, 6)
        loop.finish(0, 5)
        loop.finish(0, 6)
        interval_up(loop.txn)
        assert new.visible == ["out-0-5", "out-0-6"] and new.offsets == {("in", 0): 7}
        assert old.visible == [] and loop.txn.committed == 1
    finally:
        stuck.release.set()


def test_a_hung_commit_that_landed_is_not_redone(short_hang: None) -> None:
    """The commit reached the coordinator but the call never returned: the group's committed offset
    (read after the new producer's init, which waits for the old transaction to complete) is past
    the records, so the rewind goes there and nothing is produced twice."""
    loop = TakeOverLoop()
    old = loop.producer
    stuck = Stuck(old, "commit_transaction", after=True)
    try:
        loop.consume(0, 5, 6)
        loop.consume(1, 9)
        for p, off in [(0, 5), (0, 6), (1, 9)]:
            loop.finish(p, off)
        interval_up(loop.txn)
        assert not loop.latch.is_set(), loop.latch.error
        assert old.visible == ["out-0-5", "out-0-6", "out-1-9"]
        assert sorted(loop.consumer.seeks) == [("in", 0, 7), ("in", 1, 10)]
        assert loop.txn.committed == 0 and loop.txn.taken_over == 1
    finally:
        stuck.release.set()


def test_a_hung_abort_with_records_in_flight_forgets_them_and_rewinds(short_hang: None) -> None:
    """A failed write aborts at once, with records still in flight; if that abort hangs, the records
    handed to the old producer will never be reported: they are forgotten (their offset state is
    revoked) and consumed again from where the transaction began."""
    loop = TakeOverLoop()
    stuck = Stuck(loop.producer, "abort_transaction")
    try:
        loop.consume(0, 5, 6, 7)
        loop.finish(0, 5)
        loop.txn.write_failed("cannot write to topic 'out': Broker: Message size too large")
        loop.txn.step()
        assert not loop.latch.is_set(), loop.latch.error
        assert loop.forgotten == [2] and loop.in_flight == {}
        assert loop.consumer.seeks == [("in", 0, 5)]
        assert loop.outcomes[-1][0] == "taken_over"
    finally:
        stuck.release.set()


def test_while_earlier_hung_calls_still_block_the_member_stops(short_hang: None,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Each take-over leaves a librdkafka client blocked in its call: past STUCK_CALLS of them the
    member stops (its restart frees them) instead of piling up clients."""
    import worker.ledger.exactly_once.take_over as take_over

    monkeypatch.setattr(take_over, "STUCK_CALLS", 1)
    loop = TakeOverLoop()
    with Stuck(loop.producer, "send_offsets_to_transaction"):
        loop.commit_one()
        assert not loop.latch.is_set() and loop.txn.taken_over == 1
        with Stuck(loop.producer, "send_offsets_to_transaction"):
            loop.commit_one()
    assert isinstance(loop.latch.error, TransactionHungError)
    assert "send_offsets_to_transaction did not return" in str(loop.latch.error)
    assert "restarted member aborts" in str(loop.latch.error) and len(loop.producers) == 2


def test_the_committed_offsets_are_read_again_while_the_group_coordinator_moves(short_hang: None) -> None:
    loop = TakeOverLoop()
    loop.consumer.committed_errors = [KafkaError(KafkaError._TIMED_OUT, "Timed out"),
                                      KafkaError(KafkaError.NOT_COORDINATOR, "Not coordinator")]
    with Stuck(loop.producer, "send_offsets_to_transaction"):
        loop.commit_one()
    assert not loop.latch.is_set(), loop.latch.error
    assert loop.consumer.committed_errors == [] and loop.consumer.seeks == [("in", 0, 5)]


def test_a_new_producer_that_cannot_fence_the_old_one_stops_the_member(short_hang: None) -> None:
    loop = TakeOverLoop()
    real_replace = loop.replace

    def replace(call: Any) -> FakeTxnProducer:
        new = real_replace(call)
        new.errors["init"] = [FENCED]  # another incarnation with this transactional id took over
        return new

    loop.txn.replace_producer = replace
    with Stuck(loop.producer, "send_offsets_to_transaction"):
        loop.commit_one()
    assert isinstance(loop.latch.error, TransactionHungError)
    assert "could not take over" in str(loop.latch.error) and loop.consumer.seeks == []


def _committed_without_output(loop: TakeOverLoop, partition: int = 0, since: int = 5) -> list[int]:
    """Offsets the group has committed (through any of the producers) whose output no producer
    made visible: records lost for a read_committed reader."""
    committed = max((p.offsets.get(("in", partition), since) for p in loop.producers), default=since)
    visible = {r for p in loop.producers for r in p.visible}
    return [off for off in range(since, committed) if f"out-{partition}-{off}" not in visible]


def test_a_stop_while_the_committed_offsets_are_read_commits_nothing_past_the_hung_transaction(
        short_hang: None) -> None:
    """Issue 32, finding 1. A SIGTERM while the take-over reads the group's committed offsets (the
    group coordinator does not answer): the partitions were given fresh offset state but not rewound,
    so what the member still fetches comes from past the hung transaction's records, whose outputs
    the new producer's init aborted. Nothing of it may be committed: the drain's finish would
    commit offsets past records that have no output."""
    loop = TakeOverLoop()

    def committed(partitions: Any, timeout: float) -> Any:
        loop.txn.stop.start(5.0)  # the SIGTERM, while the coordinator does not answer
        raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "Timed out"))

    loop.consumer.committed = committed  # type: ignore[method-assign]
    with Stuck(loop.producer, "send_offsets_to_transaction"):
        loop.consume(0, 5, 6)
        loop.finish(0, 5)
        loop.finish(0, 6)
        interval_up(loop.txn)
        assert not loop.latch.is_set(), loop.latch.error
        loop.intake(0, 7, 8)  # the fetch position is past the hung transaction's records
        for key in list(loop.in_flight):
            loop.finish(*key)
        loop.txn.finish(drained_waiter(lambda: len(loop.in_flight), lambda s: None), 1.0)
    assert not loop.latch.is_set(), loop.latch.error
    assert _committed_without_output(loop) == []
    assert all(p.offsets == {} for p in loop.producers)  # nothing committed: the successor starts at 5
    assert loop.txn.closing  # intake stays paused until the member exits


def test_a_stop_while_the_new_producer_initialises_begins_nothing(short_hang: None) -> None:
    """Issue 32, finding 1: a SIGTERM during the new producer's init_transactions. No transaction
    may be begun on the uninitialised producer (librdkafka refuses it with _STATE, which stopped the
    member with exit 1), and nothing is committed."""
    loop = TakeOverLoop()
    real_replace = loop.replace

    def replace(call: Any) -> FakeTxnProducer:
        new = real_replace(call)

        def init(timeout: float) -> None:
            new.calls.append("init")
            loop.txn.stop.start(5.0)  # the SIGTERM, while the coordinator moves
            raise KafkaException(RETRIABLE)

        new.init_transactions = init  # type: ignore[method-assign]
        return new

    loop.txn.replace_producer = replace
    with Stuck(loop.producer, "send_offsets_to_transaction"):
        loop.commit_one()
        loop.intake(0, 6, 7)
        for key in list(loop.in_flight):
            loop.finish(*key)
        loop.txn.finish(drained_waiter(lambda: len(loop.in_flight), lambda s: None), 1.0)
    assert not loop.latch.is_set(), loop.latch.error
    assert loop.producer.calls == ["init"] and len(loop.producers) == 2
    assert _committed_without_output(loop) == [] and all(p.offsets == {} for p in loop.producers)


def test_a_commit_that_never_completes_is_taken_over_after_the_transaction_timeout(short_hang: None) -> None:
    """Resumed for as long as the coordinator could still complete it (transaction_timeout_s), never
    aborted (_CONFLICT); then a new producer takes over, as for a call that hung: its init ends the
    transaction, and the partitions go back to the group's committed offsets."""
    loop = TakeOverLoop()
    old = loop.producer
    loop.txn.sleep = lambda s: setattr(loop.clock, "now", loop.clock.now + 1.0)
    old.errors["commit"] = [RETRIABLE] * 1000
    loop.consume(0, 5)
    loop.finish(0, 5)
    loop.clock.now = t0 = 2.0
    loop.txn.step()
    assert not loop.latch.is_set(), loop.latch.error
    assert "abort" not in old.calls and old.calls.count("commit") > 5
    assert loop.clock.now - t0 >= loop.txn.transaction_timeout_s
    assert loop.txn.taken_over == 1 and loop.consumer.seeks == [("in", 0, 5)]
    loop.commit_one()  # consumed again, committed once through the new producer
    assert loop.producer.visible == ["out-0-5"] and old.visible == []


def test_an_abort_that_keeps_timing_out_is_resumed_then_taken_over(short_hang: None) -> None:
    """Found by the cluster test of a SIGTERM during a take-over: the group coordinator's node frozen,
    the partitions lost, and the abort of the open transaction timed out (retriable: librdkafka
    keeps it under way, "retry call to resume") 5 times in a row; the member exited 1 with "the
    transaction could not be aborted". abort_transaction is resumable like commit_transaction
    (rdkafka.h); resumed for up to transaction_timeout_s, then a new producer takes over (its init
    ends the transaction) instead of the member exiting."""
    loop = TakeOverLoop()
    old = loop.producer
    loop.txn.sleep = lambda s: setattr(loop.clock, "now", loop.clock.now + 1.0)
    old.errors["abort"] = [RETRIABLE] * 1000
    loop.consume(0, 5, 6)
    loop.txn.lost()  # young: aborted at the next step
    loop.finish(0, 5)
    loop.finish(0, 6)
    loop.txn.step()
    assert not loop.latch.is_set(), loop.latch.error
    assert old.calls.count("abort") > 5 and old.resuming == "abort"
    assert loop.txn.taken_over == 1 and loop.producer is not old and loop.consumer.seeks == [("in", 0, 5)]


def test_a_hung_call_while_stopping_is_not_taken_over(short_hang: None) -> None:
    """During shutdown no new producer is made: the deadline is short, and the restarted member's
    init aborts what was left open."""
    loop = TakeOverLoop()
    stuck = Stuck(loop.producer, "send_offsets_to_transaction")
    try:
        loop.consume(0, 5)
        loop.finish(0, 5)
        loop.txn.stop.start(5.0)
        interval_up(loop.txn)
    finally:
        stuck.release.set()
    assert isinstance(loop.latch.error, TransactionHungError) and loop.stuck == []


# --------------------- fenced by the broker's transaction timeout: a new producer takes over
def _fenced_abort(loop: TakeOverLoop, *, age_s: float = 61.0, at: int = 5,
                  error: KafkaError = FENCED) -> FakeTxnProducer:
    """Records `at` and the next consumed into a transaction that outlived transaction_timeout_ms while the
    coordinator was frozen: a write timed out (abortable, "requires epoch bump"), and the abort is
    answered PRODUCER_FENCED (the coordinator aborted the transaction on its timeout and bumped the
    epoch), which librdkafka raises as fatal _FENCED (or `error`). Returns the fenced producer."""
    fenced = loop.producer
    loop.consume(0, at, at + 1)
    loop.finish(0, at)  # produced into the open transaction, never visible
    loop.clock.now += age_s
    fenced.errors["abort"] = [error]
    loop.txn.write_failed("could not write to topic 'out': Local: Message timed out (_MSG_TIMED_OUT)")
    loop.txn.step()
    return fenced


def test_a_producer_fenced_by_the_brokers_transaction_timeout_is_taken_over_and_the_stream_goes_on(
        short_hang: None) -> None:
    """CI, tests/system/test_cluster_kafka.py (the group's coordinator node frozen): the other member's
    transaction outlived transaction_timeout_ms, its abort was fenced (fatal _FENCED), and it exited 1,
    though transactional ids are unique per member: no zombie, the broker timed the transaction out.
    A coordinator outage longer than the transaction timeout crash-looped every member. Failed before
    the fix (the latch tripped with TransactionFencedError)."""
    loop = TakeOverLoop()
    takes: list[str] = []
    loop.txn.on_take_over = takes.append
    fenced = _fenced_abort(loop)
    assert not loop.latch.is_set(), loop.latch.error
    # The group's verdict comes first: intake stays paused and nothing is made for FENCE_SETTLE_S.
    assert loop.txn.closing and len(loop.producers) == 1
    loop.finish(0, 6)  # a straggler of the fenced transaction
    loop.clock.now += txmod.FENCE_SETTLE_S
    loop.txn.step()
    assert not loop.latch.is_set(), loop.latch.error
    new = loop.producer
    assert new is not fenced and loop.txn.producer is new and new.calls == ["init"]
    assert loop.consumer.seeks == [("in", 0, 5)]  # back to the group's committed offset
    assert loop.outcomes[-1][0] == "taken_over" and loop.txn.taken_over == loop.txn.taken_over_fenced == 1
    assert takes == ["fenced"] and not loop.txn.closing
    # The stream goes on: consumed again, committed once, through the new producer.
    loop.consume(0, 5, 6, 7)
    for off in (5, 6, 7):
        loop.finish(0, off)
    interval_up(loop.txn)
    assert new.visible == ["out-0-5", "out-0-6", "out-0-7"] and new.offsets == {("in", 0): 8}
    assert fenced.visible == [] and fenced.offsets == {}
    assert _committed_without_output(loop) == [] and not loop.latch.is_set()


@pytest.mark.parametrize("age_s", [61.0, 3.0])
def test_an_abort_answered_invalid_txn_state_is_taken_over_at_any_age_and_the_stream_goes_on(
        short_hang: None, age_s: float) -> None:
    """CI, tests/system/test_cluster_kafka.py (the group's coordinator node frozen, 2026-12-04): a member's abort,
    resumed for transaction_timeout_ms, was answered INVALID_TXN_STATE, which librdkafka raises as fatal,
    and the member exited 1. The coordinator held a state the abort could not end (it had ended the
    transaction, or a coordinator that took over held another): no second process, which would be
    answered PRODUCER_FENCED, so a new producer takes over whatever the transaction's age. Failed
    before the fix (the latch tripped with TransactionFencedError)."""
    loop = TakeOverLoop()
    takes: list[str] = []
    loop.txn.on_take_over = takes.append
    old = _fenced_abort(loop, age_s=age_s, error=INVALID_TXN_STATE)
    assert not loop.latch.is_set(), loop.latch.error
    assert loop.txn.closing and len(loop.producers) == 1  # the group's verdict first, as for a fence
    loop.clock.now += txmod.FENCE_SETTLE_S
    loop.txn.step()
    assert not loop.latch.is_set(), loop.latch.error
    new = loop.producer
    assert new is not old and new.calls == ["init"] and takes == ["fenced"]
    assert loop.consumer.seeks == [("in", 0, 5)]
    loop.consume(0, 5, 6)
    for off in (5, 6):
        loop.finish(0, off)
    interval_up(loop.txn)
    assert new.visible == ["out-0-5", "out-0-6"] and new.offsets == {("in", 0): 7}
    assert old.visible == [] and old.offsets == {}
    assert _committed_without_output(loop) == [] and not loop.latch.is_set()


def test_a_fatal_error_the_coordinator_cannot_explain_still_stops_the_member() -> None:
    """Only the errors of TAKEN_OVER_FATAL are taken over: another fatal error of the abort stops the
    member, as before."""
    loop = TakeOverLoop()
    other = KafkaError(KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED, "not authorised", fatal=True)
    _fenced_abort(loop, error=other)
    assert isinstance(loop.latch.error, TransactionFencedError) and len(loop.producers) == 1


def test_a_fence_the_brokers_timeout_cannot_explain_stops_the_member_naming_a_second_process() -> None:
    """A transaction younger than transaction_timeout_ms cannot have been timed out by the broker:
    another process took over this member's transactional id. It stops, as before, and says so."""
    loop = TakeOverLoop()
    _fenced_abort(loop, age_s=20.0)
    assert isinstance(loop.latch.error, TransactionFencedError)
    assert "same member id" in str(loop.latch.error) and len(loop.producers) == 1
    assert all(p.offsets == {} for p in loop.producers)


def test_partitions_lost_while_a_fenced_take_over_waits_stop_the_member_as_a_zombie(short_hang: None) -> None:
    """The stronger signal: a SIGSTOPped member resumed after its successor (the same identity) took
    over is fenced and finds its session expired; the group's verdict wins, nobody else is fenced."""
    loop = TakeOverLoop()
    _fenced_abort(loop)
    loop.txn.lost()
    assert isinstance(loop.latch.error, TransactionFencedError) and "zombie" in str(loop.latch.error)
    loop.clock.now += txmod.FENCE_SETTLE_S
    loop.txn.step()
    loop.txn.finish(drained_waiter(lambda: 0, lambda s: None), 1.0)
    assert len(loop.producers) == 1 and loop.txn.taken_over == 0
    assert "abort" not in loop.producer.calls[loop.producer.calls.index("abort") + 1:]


@pytest.mark.parametrize(("error", "age_s", "cause"), [
    (FENCED, 61.0, "second process may be using the same member id"),
    (INVALID_TXN_STATE, 2.0, "no longer holds it in a state this call can end"),
], ids=["fenced", "invalid-txn-state"])
def test_fenced_take_overs_are_bounded_then_the_member_stops_committing_nothing_past(
        short_hang: None, error: KafkaError, age_s: float, cause: str) -> None:
    """Two processes with one member id fence each other for ever, each fence after a take-over:
    after FENCED_TAKE_OVERS in FENCED_WINDOW_S the member stops, naming that cause. A coordinator
    that keeps answering INVALID_TXN_STATE is no outage that passes either: the same bound."""
    loop = TakeOverLoop()
    at = 5
    for _ in range(FENCED_TAKE_OVERS):
        loop.commit_one(at)  # a transaction that commits: the stream moves
        _fenced_abort(loop, at=at + 1, age_s=age_s, error=error)
        loop.clock.now += txmod.FENCE_SETTLE_S
        loop.txn.step()
        assert not loop.latch.is_set(), loop.latch.error
        assert loop.consumer.seeks[-1] == ("in", 0, at + 1)
        loop.in_flight.clear()
        at += 1
    assert loop.txn.taken_over_fenced == FENCED_TAKE_OVERS
    loop.commit_one(at)
    _fenced_abort(loop, at=at + 1, age_s=age_s, error=error)
    assert isinstance(loop.latch.error, TransactionFencedError)
    assert cause in str(loop.latch.error)
    if error is INVALID_TXN_STATE:  # no second process answers so: the message does not blame one
        assert "second process" not in str(loop.latch.error) and "keeps refusing" in str(loop.latch.error)
    assert len(loop.producers) == FENCED_TAKE_OVERS + 1
    loop.txn.step()
    loop.finish(0, at + 2)  # a straggler of the fenced transaction
    loop.txn.finish(drained_waiter(lambda: len(loop.in_flight), lambda s: None), 1.0)
    # Nothing committed past the fenced transactions: every committed offset has its output.
    assert _committed_without_output(loop) == []
    assert max(p.offsets.get(("in", 0), 0) for p in loop.producers) == at + 1


def test_a_stop_while_a_fenced_take_over_waits_commits_nothing(short_hang: None) -> None:
    loop = TakeOverLoop()
    _fenced_abort(loop)
    loop.txn.stop.start(5.0)
    loop.finish(0, 6)
    loop.txn.finish(drained_waiter(lambda: len(loop.in_flight), lambda s: None), 1.0)
    assert not loop.latch.is_set(), loop.latch.error  # exits 0, as a SIGTERM does
    assert len(loop.producers) == 1 and all(p.offsets == {} for p in loop.producers)
    assert loop.txn.closing and loop.tracker.partitions() == []


def test_a_revoke_while_a_fenced_take_over_waits_commits_nothing(short_hang: None) -> None:
    loop = TakeOverLoop()
    _fenced_abort(loop)
    calls = list(loop.producer.calls)
    assert not loop.txn.on_revoke(lambda timeout_s: True, 1.0)
    assert loop.producer.calls == calls and not loop.latch.is_set()


def test_fenced_on_begin_with_no_transaction_open_stops_the_member() -> None:
    loop = Loop()
    loop.producer.fatal = FENCED
    loop.txn.ensure_open()
    assert isinstance(loop.latch.error, TransactionFencedError) and "same member id" in str(loop.latch.error)
    assert loop.txn.state == "idle"
