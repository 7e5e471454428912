"""The fault-tolerant core with fake clients: latch, producer wrapper, committer, flow control,
failure isolation and liveness. Fakes behave like confluent-kafka's clients where it matters:
callbacks run inside poll(), produce() raises BufferError on a full queue and KafkaException
when librdkafka refuses a record outright."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from tests.fakes.transactions import FENCED, INVALID_TXN_STATE
from worker.backends.base import PartialBatchError
from worker.backends.isolating import IsolatingContext
from worker.deadline import Deadline
from worker.ledger.exactly_once.producer import ExactlyOnceProducer
from worker.ledger.inflight import InFlightTable
from worker.errors import BackendBrokenError, DeliveryError, ThreadDiedError, WorkerError
from worker.intake.flow import FlowControl
from worker.ledger.committer import Committer
from worker.kafka.producer import OutputProducer
from worker.latch import FatalLatch, guarded
from worker.operations.health import Liveness


# ---------------------------------------------------------------------------- latch
def test_the_first_fatal_error_wins() -> None:
    latch = FatalLatch()
    assert latch.trip(WorkerError("first"))
    assert not latch.trip(WorkerError("second"))
    assert str(latch.error) == "first" and latch.is_set()


def test_a_thread_that_dies_trips_the_latch() -> None:
    latch = FatalLatch()

    def body() -> None:
        raise KeyError("bug")

    t = threading.Thread(target=guarded(latch, "kwe-test", body))
    t.start()
    t.join()
    assert isinstance(latch.error, ThreadDiedError) and "kwe-test" in str(latch.error)


# ---------------------------------------------------------------------------- producer
class FakeProducer:
    """Queues records; poll() delivers them (or fails them with `fail_with`) on the calling thread."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.produced: list[tuple[str, bytes | None]] = []
        self.pending: list[tuple[Any, Any]] = []
        self.buffer_full = 0  # produce() raises BufferError this many times first
        self.refuse: KafkaError | None = None
        self.fail_with: KafkaError | None = None
        self.poll_threads: set[str] = set()
        self.lock = threading.Lock()

    def produce(self, topic: str, value: bytes | None = None, key: bytes | None = None, partition: int = -1,
                on_delivery: Any = None, _alias: Any = None, timestamp: int = 0, headers: Any = None) -> None:
        with self.lock:
            if self.buffer_full:
                self.buffer_full -= 1
                raise BufferError("Local: Queue full")
            if self.refuse is not None:
                raise KafkaException(self.refuse)
            self.produced.append((topic, key))
            self.pending.append((on_delivery, topic))

    def poll(self, timeout: float) -> int:
        self.poll_threads.add(threading.current_thread().name)
        with self.lock:
            due, self.pending = self.pending, []
        for cb, topic in due:
            cb(self.fail_with, FakeMsg(topic))
        if not due:
            time.sleep(min(timeout, 0.005))
        return len(due)

    def __len__(self) -> int:
        return len(self.pending)


class FakeMsg:
    def __init__(self, topic: str) -> None:
        self._topic = topic

    def topic(self) -> str:
        return self._topic


def _producer(latch: FatalLatch) -> tuple[OutputProducer, FakeProducer]:
    made: list[FakeProducer] = []

    def factory(config: dict[str, Any]) -> FakeProducer:
        made.append(FakeProducer(config))
        return made[0]

    return OutputProducer({}, latch, producer_factory=factory, poll_interval_s=0.01), made[0]


def test_deliveries_are_acknowledged_on_the_delivery_thread_only() -> None:
    latch = FatalLatch()
    wrapper, fake = _producer(latch)
    acked: list[str] = []
    wrapper.start()
    for i in range(20):
        assert wrapper.produce("out", b"k", b"v", [], lambda i=i: acked.append(threading.current_thread().name))
    assert wrapper.flush(Deadline.after(5.0)) == 0
    wrapper.stop(2.0)
    assert len(acked) == 20 and set(acked) == {"kwe-delivery"} == fake.poll_threads
    assert not latch.is_set()


def test_a_full_queue_makes_the_caller_wait_not_fail() -> None:
    latch = FatalLatch()
    wrapper, fake = _producer(latch)
    fake.buffer_full = 5
    assert wrapper.produce("out", None, b"v", [], lambda: None)
    assert fake.produced == [("out", None)] and not latch.is_set()


def test_an_interrupt_ends_the_wait_for_room() -> None:
    latch = FatalLatch()
    wrapper, fake = _producer(latch)
    fake.buffer_full = 10**9
    threading.Timer(0.05, wrapper.interrupt).start()
    assert not wrapper.produce("out", None, b"v", [], lambda: None)


def test_a_refused_record_is_fatal_with_the_topic_and_the_reason() -> None:
    latch = FatalLatch()
    wrapper, fake = _producer(latch)
    fake.refuse = KafkaError(KafkaError.MSG_SIZE_TOO_LARGE)
    assert not wrapper.produce("dlq", None, b"x" * 10, [], lambda: None)
    assert isinstance(latch.error, DeliveryError)
    assert "'dlq'" in str(latch.error) and "MSG_SIZE_TOO_LARGE" in str(latch.error)


def test_a_failed_delivery_is_fatal_and_never_produced_again() -> None:
    latch = FatalLatch()
    wrapper, fake = _producer(latch)
    fake.fail_with = KafkaError(KafkaError._MSG_TIMED_OUT)  # the outage outlasted message.timeout.ms
    acked: list[int] = []
    wrapper.start()
    assert wrapper.produce("out", b"k", b"v", [], lambda: acked.append(1))
    assert latch.wait(5.0)
    wrapper.stop(2.0)
    assert acked == [] and len(fake.produced) == 1
    assert isinstance(latch.error, DeliveryError)
    assert "'out'" in str(latch.error) and "_MSG_TIMED_OUT" in str(latch.error)


def test_a_missing_write_acl_says_so() -> None:
    latch = FatalLatch()
    wrapper, fake = _producer(latch)
    fake.fail_with = KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED)
    wrapper.start()
    wrapper.produce("out", b"k", b"v", [], lambda: None)
    assert latch.wait(5.0)
    wrapper.stop(2.0)
    assert str(latch.error).startswith("not authorised to write topic 'out'")


def test_a_bug_in_acknowledging_stops_the_worker_instead_of_killing_the_delivery_thread() -> None:
    latch = FatalLatch()
    wrapper, fake = _producer(latch)
    wrapper.start()

    def broken() -> None:
        raise ZeroDivisionError

    wrapper.produce("out", None, b"v", [], broken)
    assert latch.wait(5.0)
    assert wrapper.thread.is_alive()  # still serving: the error went to the latch, not up the thread
    wrapper.stop(2.0)
    assert isinstance(latch.error, ThreadDiedError)


# ------------------------------------------------- exactly-once: a failed write fails the transaction
def _transactional(latch: FatalLatch) -> tuple[ExactlyOnceProducer, FakeProducer, list[str]]:
    plain, fake = _producer(latch)
    wrapper = ExactlyOnceProducer(plain, InFlightTable())
    failed: list[str] = []
    wrapper.fail_writes_into(failed.append)
    return wrapper, fake, failed


def live(released: list[int], mark: int = 1) -> Any:
    """An on_given_up for a record of the open transaction: reports the failure, then releases."""
    def release(fail: Any) -> bool:
        fail()
        released.append(mark)
        return True
    return release


def test_exactly_once_a_failed_delivery_fails_the_transaction_not_the_worker() -> None:
    latch = FatalLatch()
    wrapper, fake, failed = _transactional(latch)
    fake.fail_with = KafkaError(KafkaError.MSG_SIZE_TOO_LARGE)
    given_up: list[int] = []
    wrapper.start()
    assert wrapper.produce("out", b"k", b"v", [], lambda: None, live(given_up))
    deadline = time.monotonic() + 5
    while not failed and time.monotonic() < deadline:
        time.sleep(0.01)
    wrapper.stop(2.0)
    assert not latch.is_set() and given_up == [1] and wrapper.given_up == 1
    assert len(failed) == 1 and "'out'" in failed[0] and "MSG_SIZE_TOO_LARGE" in failed[0]


def test_exactly_once_a_produce_refused_by_an_abortable_transaction_is_given_up_and_the_batch_goes_on() -> None:
    latch = FatalLatch()
    wrapper, fake, failed = _transactional(latch)
    fake.refuse = KafkaError(KafkaError._STATE, "Operation not valid in state AbortableError")
    released: list[int] = []
    for i in range(3):
        assert wrapper.produce("out", b"k", b"v", [], lambda: None, live(released, i))
    assert released == [0, 1, 2] and len(failed) == 3 and not latch.is_set()


def test_exactly_once_a_failed_write_of_an_already_aborted_transaction_fails_nothing() -> None:
    latch = FatalLatch()
    wrapper, fake, failed = _transactional(latch)
    fake.refuse = KafkaError(KafkaError._STATE)
    assert wrapper.produce("out", b"k", b"v", [], lambda: None, lambda fail: False)  # its state was replaced
    assert failed == [] and not latch.is_set() and wrapper.given_up == 1


@pytest.mark.parametrize("err", [KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED),
                                 KafkaError(KafkaError._FENCED, "fenced", fatal=True)])
def test_exactly_once_a_missing_acl_or_a_fatal_error_still_stops_the_worker(err: KafkaError) -> None:
    latch = FatalLatch()
    wrapper, fake, failed = _transactional(latch)
    fake.refuse = err
    assert not wrapper.produce("out", b"k", b"v", [], lambda: None, live([]))
    assert latch.is_set() and failed == []


def test_a_record_purged_by_an_abort_leaves_the_in_flight_table() -> None:
    latch = FatalLatch()
    wrapper, fake, _ = _transactional(latch)
    fake.fail_with = KafkaError(KafkaError._PURGE_QUEUE)
    released: list[int] = []
    wrapper.start()
    wrapper.produce("out", b"k", b"v", [], lambda: None, live(released))
    deadline = time.monotonic() + 5
    while not released and time.monotonic() < deadline:
        time.sleep(0.01)
    wrapper.stop(2.0)
    assert released == [1] and wrapper.purged == 1 and not latch.is_set()


# ---------------------------------------------------------------------------- committer
class FakeConsumer:
    def __init__(self) -> None:
        self.commits: list[tuple[list[tuple[int, int]], bool]] = []
        self.sync_errors: list[KafkaException] = []
        self.hang = threading.Event()
        self.hanging = False

    def commit(self, offsets: list[TopicPartition], asynchronous: bool) -> list[TopicPartition] | None:
        self.commits.append(([(tp.partition, tp.offset) for tp in offsets], asynchronous))
        if asynchronous:
            return None
        if self.hanging:
            self.hang.wait(10)
        if self.sync_errors:
            raise self.sync_errors.pop(0)
        return [TopicPartition(tp.topic, tp.partition, tp.offset) for tp in offsets]


def _committer() -> tuple[Committer, FakeConsumer]:
    fake = FakeConsumer()
    return Committer(fake, interval_s=0.0), fake


def test_commits_stop_at_the_lowest_unfinished_offset_and_confirm_on_answer() -> None:
    c, fake = _committer()
    c.assign([TopicPartition("t", 0)])
    part = c.tracker.get("t", 0)
    assert part is not None
    for off in range(10):
        part.track(off)
    for off in (0, 1, 2, 4, 5):
        part.done(off)
    c.maybe_commit()
    assert fake.commits == [([(0, 3)], True)]
    c.on_commit(None, [TopicPartition("t", 0, 3)])
    assert part.committed == 3 and c.uncommitted() == 7


def test_a_late_commit_answer_from_an_earlier_assignment_is_not_applied() -> None:
    c, _ = _committer()
    c.assign([TopicPartition("t", 0)])
    old = c.tracker.get("t", 0)
    assert old is not None
    old.track(0)
    old.done(0)
    c.maybe_commit()  # asks for offset 1
    c.forget([TopicPartition("t", 0)])
    c.assign([TopicPartition("t", 0)])  # the partition comes back before the answer
    new = c.tracker.get("t", 0)
    assert new is not None and new is not old
    new.track(0)  # the group offset went nowhere: it is read again
    c.on_commit(None, [TopicPartition("t", 0, 1)])
    assert new.committed is None and new.uncommitted() == 1


def test_a_synchronous_commit_that_never_answers_is_bounded() -> None:
    c, fake = _committer()
    c.assign([TopicPartition("t", 0)])
    part = c.tracker.get("t", 0)
    assert part is not None
    part.track(0)
    part.done(0)
    fake.hanging = True
    start = time.monotonic()
    assert not c.commit_sync(c.tracker.partitions(), timeout_s=0.3)
    assert time.monotonic() - start < 2.0
    fake.hang.set()


def test_commit_until_retries_a_commit_refused_during_a_rebalance() -> None:
    c, fake = _committer()
    c.assign([TopicPartition("t", 0)])
    part = c.tracker.get("t", 0)
    assert part is not None
    part.track(0)
    part.done(0)
    fake.sync_errors = [KafkaException(KafkaError(KafkaError.ILLEGAL_GENERATION)),
                        KafkaException(KafkaError(KafkaError.REBALANCE_IN_PROGRESS))]
    served: list[float] = []
    assert c.commit_until(Deadline.after(5.0), served.append)
    assert len(served) == 2 and part.committed == 1


def test_the_stall_clock_runs_only_while_work_waits() -> None:
    now = [0.0]
    c = Committer(FakeConsumer(), interval_s=0.0, clock=lambda: now[0])
    c.assign([TopicPartition("t", 0)])
    now[0] = 50.0
    assert c.uncommitted() == 0 and c.stalled_for() == 0.0  # idle: nothing waits
    part = c.tracker.get("t", 0)
    assert part is not None
    part.track(0)
    now[0] = 80.0
    assert c.uncommitted() == 1 and c.stalled_for() == 30.0
    part.done(0)
    c.maybe_commit()
    c.on_commit(None, [TopicPartition("t", 0, 1)])
    assert c.stalled_for() == 0.0


# ---------------------------------------------------------------------------- flow control
def test_flow_control_pauses_on_bytes_as_well_as_records() -> None:
    flow = FlowControl(max_records=100, max_bytes=1000)
    assert not flow.update(10, 999)
    assert flow.update(10, 1000)  # the byte bound alone pauses
    assert flow.update(10, 800)  # hysteresis: not yet under 3/4
    assert not flow.update(10, 750)
    assert flow.update(100, 0)
    assert flow.room(100) == 1 and not flow.update(75, 0) and flow.room(75) == 25


def test_a_worker_at_its_bound_keeps_measuring_through_the_gaps_between_fetches() -> None:
    # At the floor, everything in flight finishes and commits before the next fetch returns:
    # pending is 0 for a moment every cycle. Those gaps must not reset the measurement.
    flow = FlowControl(max_records=4096, max_bytes=10**9, drain_target_s=8.0, min_records=256)
    done, t = 0, 0.0
    while t < 3.0:
        flow.observe(t, done, busy=True)
        t += 0.4
        done += 256
        flow.observe(t, done, busy=False)  # a gap of 0.1 s between cycles
        t += 0.1
    assert flow.limit > 256 * 8  # 512/s measured: the bound grew


def test_the_record_bound_follows_throughput_so_a_drain_fits_the_deadline() -> None:
    flow = FlowControl(max_records=4096, max_bytes=10**9, drain_target_s=8.0, min_records=256)
    assert flow.limit == 256  # nothing measured yet: start small
    for t in range(12):
        flow.observe(float(t), t * 100)  # 100 records/s: 8 s of work is 800
    assert flow.limit == 800
    assert flow.update(800, 0) and flow.room(800) == 1
    for t in range(12, 30):
        flow.observe(float(t), 1100 + (t - 12) * 2000)  # fast now: capped by the setting
    assert flow.limit == 4096
    for t in range(30, 35):
        flow.observe(float(t), 40000, busy=False)  # idle: says nothing about capacity
    assert flow.limit == 4096
    assert not flow.update(0, 0)
    for t in range(35, 55):
        flow.observe(float(t), 40000)  # work waits and nothing finishes: never below the floor
    assert flow.limit == 256


# ---------------------------------------------------------------------------- failure isolation
class FlakyContext:
    def __init__(self, *, fail_times: int = 0, poison: int | None = None, broken: bool = False) -> None:
        self.fail_times = fail_times
        self.poison = poison
        self.broken = broken
        self.calls = 0

    def run(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        self.calls += 1
        if self.broken or self.fail_times > 0:
            self.fail_times -= 1
            raise RuntimeError("device error")
        if self.poison is not None and (ids[:, 0] == self.poison).any():
            raise RuntimeError("poison")
        return np.repeat(ids[:, :1].astype(np.float32), 4, axis=1)

    def close(self) -> None:
        pass


def _batch(n: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.arange(1, n + 1, dtype=np.int64).reshape(n, 1)
    return ids, np.ones_like(ids)


def test_a_transient_failure_is_retried_once_and_loses_nothing() -> None:
    ctx = IsolatingContext(FlakyContext(fail_times=1), 4, np.array([7]))
    rows = ctx.run(*_batch(8))
    assert rows[:, 0].tolist() == list(range(1, 9))


def test_a_poison_item_is_isolated_and_the_rest_of_its_batch_embedded() -> None:
    ctx = IsolatingContext(FlakyContext(poison=5), 4, np.array([7]))
    with pytest.raises(PartialBatchError) as info:
        ctx.run(*_batch(8))
    assert info.value.failed == [4]
    good = [i for i in range(8) if i != 4]
    assert info.value.rows[good, 0].tolist() == [i + 1 for i in good]


def test_a_broken_backend_is_fatal_not_dead_lettered() -> None:
    ctx = IsolatingContext(FlakyContext(broken=True), 4, np.array([7]))
    with pytest.raises(BackendBrokenError, match="known-good input"):
        ctx.run(*_batch(4))


# ---------------------------------------------------------------------------- liveness
def test_liveness_fails_on_a_fatal_error_a_dead_thread_or_a_stall() -> None:
    latch = FatalLatch()
    stalled = [0.0]
    done = threading.Thread(target=lambda: None, name="kwe-output")
    live = Liveness(latch, lambda: [done], lambda: stalled[0], stall_timeout_s=30.0)
    assert live() == (True, "ok")  # not started yet: not dead
    stalled[0] = 31.0
    ok, reason = live()
    assert not ok and "stalled" in reason
    stalled[0] = 0.0
    done.start()
    done.join()
    ok, reason = live()
    assert not ok and "kwe-output" in reason
    latch.trip(WorkerError("boom"))
    assert live() == (False, "fatal error: boom")


# ---------------------------------------------------------------------------- rebalances
class FakeGroupConsumer(FakeConsumer):
    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        self.config = config
        self.assigned: list[TopicPartition] = []
        self.paused: list[TopicPartition] = []

    def incremental_assign(self, partitions: list[TopicPartition]) -> None:
        self.assigned += partitions

    def pause(self, partitions: list[TopicPartition]) -> None:
        self.paused += partitions

    def resume(self, partitions: list[TopicPartition]) -> None:
        self.paused = [p for p in self.paused if p not in partitions]

    def assignment(self) -> list[TopicPartition]:
        return list(self.assigned)

    def subscribe(self, topics: list[str], **callbacks: Any) -> None:
        pass

    group_offsets: dict[int, int] = {}  # the group's committed offsets, as committed() answers them

    def committed(self, partitions: list[TopicPartition], timeout: float | None = None) -> list[TopicPartition]:
        return [TopicPartition(tp.topic, tp.partition, self.group_offsets.get(tp.partition, -1001))
                for tp in partitions]


def _member(wait_s: float) -> tuple[Any, Committer, FakeGroupConsumer, FatalLatch]:
    from worker.ledger.at_least_once import AtLeastOnce
    from worker.kafka.consumer import GroupMember
    from worker.operations.metrics import Metrics

    latch = FatalLatch()
    committer = Committer(None, interval_s=0.0)
    made: list[FakeGroupConsumer] = []
    member = GroupMember({}, committer, latch, Metrics(), revoke_wait_s=lambda: wait_s,
                         consumer_factory=lambda cfg: made.append(FakeGroupConsumer(cfg)) or made[0])
    member.subscribe("t", AtLeastOnce(committer, OutputProducer({}, latch, producer_factory=lambda config: object())))
    return member, committer, made[0], latch


def test_a_revoke_waits_for_work_in_flight_then_commits_it_before_the_partition_goes() -> None:
    member, committer, fake, _ = _member(wait_s=5.0)
    tps = [TopicPartition("t", 0)]
    member._on_assign(fake, tps)
    part = committer.tracker.get("t", 0)
    assert part is not None and fake.paused == []  # assigned and explicitly resumed
    for off in range(4):
        part.track(off)
    part.done(0)
    threading.Timer(0.2, lambda: [part.done(o) for o in (1, 2, 3)]).start()  # the delivery thread finishes
    start = time.monotonic()
    member._on_revoke(fake, tps)
    assert 0.15 < time.monotonic() - start < 4.0
    assert fake.commits[-1] == ([(0, 4)], False)  # synchronous, everything finished
    assert committer.tracker.get("t", 0) is None and part.revoked


def test_a_revoke_after_a_fatal_error_neither_waits_nor_commits() -> None:
    member, committer, fake, latch = _member(wait_s=30.0)
    tps = [TopicPartition("t", 0)]
    member._on_assign(fake, tps)
    part = committer.tracker.get("t", 0)
    assert part is not None
    part.track(0)
    part.track(1)
    part.done(0)
    latch.trip(WorkerError("delivery failed"))
    start = time.monotonic()
    member._on_revoke(fake, tps)
    assert time.monotonic() - start < 1.0 and fake.commits == []


def test_a_member_paused_by_flow_control_takes_new_partitions_paused() -> None:
    member, _, fake, _ = _member(wait_s=0.0)
    member._on_assign(fake, [TopicPartition("t", 0)])
    member.set_paused(True)
    member._on_assign(fake, [TopicPartition("t", 1)])
    assert {tp.partition for tp in fake.paused} == {0, 1}


def _lose_with_work(member: Any, committer: Committer, fake: FakeGroupConsumer) -> None:
    """Partitions 0 and 1 consumed from 100 and 200 (the group's offsets), 0 finished up to 150 (160-169
    too, out of order), 1 nothing beyond 200; then both lost (a session expired) with nothing committed."""
    tps = [TopicPartition("t", 0), TopicPartition("t", 1)]
    fake.group_offsets = {0: 100, 1: 200}
    member._on_assign(fake, tps)
    p0, p1 = committer.tracker.get("t", 0), committer.tracker.get("t", 1)
    assert p0 is not None and p1 is not None
    for off in range(100, 170):
        p0.track(off)
    for off in [*range(100, 150), *range(160, 170)]:
        p0.done(off)
    for off in range(200, 210):
        p1.track(off)
    member._on_lost(fake, tps)
    assert fake.commits == []  # lost: nothing committed then


def test_a_lost_partition_given_back_unmoved_resumes_from_what_the_member_had_finished() -> None:
    """Issue 46: a member whose session expired (a coordinator outage longer than it) lost its
    partitions and, given them back, redid its whole finished window from the group's offset. When
    nobody committed meanwhile, the finished offset is committed first, in the new generation."""
    member, committer, fake, _ = _member(wait_s=0.0)
    _lose_with_work(member, committer, fake)
    member._on_assign(fake, [TopicPartition("t", 0), TopicPartition("t", 1)])
    assert fake.commits == [([(0, 150)], False)]  # p1 had finished nothing beyond the group's offset
    assert [tp.partition for tp in fake.assigned[-2:]] == [0, 1]  # assigned after the commit, as usual
    fake.commits.clear()
    member._on_lost(fake, [TopicPartition("t", 0)])
    member._on_assign(fake, [TopicPartition("t", 0)])  # nothing new finished: nothing to resume
    assert fake.commits == []


def test_outputs_acknowledged_after_the_loss_count_as_finished_when_the_partition_comes_back() -> None:
    """A broker's loss holds acks=all writes until it is fenced: the session can end with outputs still in
    the producer. Acknowledged afterwards, they finish on the lost state, and resuming reads it then."""
    member, committer, fake, _ = _member(wait_s=0.0)
    _lose_with_work(member, committer, fake)
    lost = committer._lost[("t", 0)][1]  # noqa: SLF001 - the state the delivery thread still finishes
    for off in range(150, 160):
        lost.done(off)
    member._on_assign(fake, [TopicPartition("t", 0)])
    assert fake.commits == [([(0, 170)], False)]


def test_a_lost_partition_whose_group_offset_moved_past_the_finished_work_starts_from_the_group_offset() -> None:
    member, committer, fake, _ = _member(wait_s=0.0)
    _lose_with_work(member, committer, fake)
    fake.group_offsets = {0: 155}  # another member got further meanwhile
    member._on_assign(fake, [TopicPartition("t", 0)])
    assert fake.commits == []
    member, committer, fake, _ = _member(wait_s=0.0)
    _lose_with_work(member, committer, fake)
    fake.group_offsets = {0: 90}  # reset below where this member left it: the operator's word stands
    member._on_assign(fake, [TopicPartition("t", 0)])
    assert fake.commits == []


def test_a_late_commit_of_its_own_does_not_stop_a_member_resuming() -> None:
    """librdkafka sends commits deferred for want of a coordinator after the member rejoined: the group's
    offset moved, but not past what the member had finished."""
    member, committer, fake, _ = _member(wait_s=0.0)
    _lose_with_work(member, committer, fake)
    fake.group_offsets = {0: 120}
    member._on_assign(fake, [TopicPartition("t", 0)])
    assert fake.commits == [([(0, 150)], False)]


def test_lost_partitions_are_not_resumed_under_exactly_once_or_after_a_fatal_error() -> None:
    class _ExactlyOnce:
        def on_lost(self) -> bool:
            return False  # their finished work sat in a transaction that never commits

        def on_revoke(self, parts: Any, wait_s: float) -> bool:
            return True

    member, committer, fake, latch = _member(wait_s=0.0)
    member.subscribe("t", _ExactlyOnce())
    _lose_with_work(member, committer, fake)
    member._on_assign(fake, [TopicPartition("t", 0)])
    assert fake.commits == []
    member, committer, fake, latch = _member(wait_s=0.0)
    _lose_with_work(member, committer, fake)
    latch.trip(WorkerError("delivery failed"))
    member._on_assign(fake, [TopicPartition("t", 0)])
    assert fake.commits == []


class _Backend:
    """A 2-dimensional backend whose every call first runs `before` (to hang it, or not)."""

    name, dim, max_contexts = "fake", 2, None
    requires_serial_dispatch = False

    def __init__(self, before: Any) -> None:
        self._before = before

    def create_context(self, index: int) -> Any:
        return self

    def run(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        self._before()
        return np.zeros((len(ids), 2), dtype=np.float32)

    def close(self) -> None:
        pass


def test_a_bug_in_the_bucketer_former_trips_the_latch_and_liveness_names_the_thread() -> None:
    """Finding 6: the former and dispatchers run guarded; a bug there stops the worker visibly
    (the latch), and /healthz names the dead thread, instead of all work stopping silently."""
    from worker.core.profiles import Bucket, Profile
    from worker.batching.bucketer import Bucketer
    from worker.latch import guarded
    from worker.operations.health import Liveness

    latch = FatalLatch()
    b = Bucketer(Profile("t", (Bucket(8, 4, 4),), 10_000, "bucket"), _Backend(lambda: None), lambda *a: None,
                 on_error=lambda *a: None, max_queue_delay_ms=1.0,
                 guard=lambda name, body: guarded(latch, name, body))
    live = Liveness(latch, lambda: b.threads, lambda: 0.0, stall_timeout_s=30.0)

    def bug(bucket: Any, items: Any) -> Any:
        raise KeyError("a bug while padding")

    b._pad = bug  # type: ignore[method-assign]
    b.start()
    assert live() == (True, "ok")
    b.submit(0, np.arange(1, 5, dtype=np.int64))
    assert latch.wait(5.0), "the former's exception did not reach the latch"
    assert isinstance(latch.error, ThreadDiedError) and "kwe-bucket-former" in str(latch.error)
    ok, why = live()
    assert not ok
    b.stop(Deadline.after(0.5), drain=False)


def test_a_bucketer_stop_returns_by_its_timeout_while_a_backend_call_hangs() -> None:
    from worker.core.profiles import Bucket, Profile
    from worker.batching.bucketer import Bucketer

    release = threading.Event()
    entered = threading.Event()

    def hang() -> None:
        entered.set()
        release.wait(30)  # never returns in time

    b = Bucketer(Profile("t", (Bucket(8, 4, 4),), 10_000, "bucket"), _Backend(hang), lambda *a: None,
                 on_error=lambda *a: None, max_queue_delay_ms=1.0)
    b.start()
    try:
        b.submit(0, np.arange(1, 5, dtype=np.int64))
        assert entered.wait(5.0)
        start = time.monotonic()
        b.stop(Deadline.after(0.3), drain=True)
        assert time.monotonic() - start < 0.3 + 0.5 + 0.3
        assert all(t.daemon for t in b.threads)  # cannot hold the process at exit either
    finally:
        release.set()


def test_a_replaced_client_is_not_polled_its_errors_are_muted_and_it_is_retired_once_its_call_returns() -> None:
    """Exactly-once take-over (issue 21): a new librdkafka producer replaces one whose
    transactional call hung. The old one's fenced error must not stop the worker, its queued
    reports must not run, and it is dropped once the thread blocked in it is done."""
    latch = FatalLatch()
    made: list[FakeProducer] = []

    def factory(config: dict[str, Any]) -> FakeProducer:
        made.append(FakeProducer(config))
        return made[-1]

    wrapper = ExactlyOnceProducer(OutputProducer({"transactional.id": "t"}, latch, producer_factory=factory,
                                                 poll_interval_s=0.01), InFlightTable())
    old = made[0]
    assert wrapper.produce("out", b"k", b"old", [], lambda: None)  # never reported: the old one is not polled
    release = threading.Event()
    stuck = threading.Thread(target=release.wait, args=(10,))
    stuck.start()
    new = wrapper.replace_client(stuck)
    assert new is made[1] is wrapper.client and new.config["transactional.id"] == "t"
    wrapper.start()
    acked: list[str] = []
    assert wrapper.produce("out", b"k", b"new", [], lambda: acked.append("new"))
    assert wrapper.flush(Deadline.after(5.0)) == 0 and acked == ["new"]
    old.config["error_cb"](KafkaError(KafkaError._FENCED, "fenced by its successor", fatal=True))
    assert not latch.is_set() and len(old.pending) == 1 and old.poll_threads == set()
    assert wrapper.abandoned == 1 and wrapper.replaced == 1
    release.set()
    stuck.join(5)
    deadline = time.monotonic() + 5
    while wrapper.abandoned and time.monotonic() < deadline:
        time.sleep(0.01)
    assert wrapper.abandoned == 0
    new.config["error_cb"](KafkaError(KafkaError._FENCED, "fenced", fatal=True))  # the current one still counts
    assert latch.is_set() and "fenced" in str(latch.error)
    wrapper.stop(2.0)


def test_a_replaced_client_is_destroyed_on_a_thread_of_its_own_never_the_delivery_thread(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 32, finding 5. rd_kafka_destroy can block on a dead broker's connections; if the last
    reference to an abandoned client ended on the delivery thread, acknowledgements would stop
    there until the stall probe restarted the member. Here the retiring thread finishes before the
    delivery thread goes on (a legal interleaving, forced), so whatever the delivery thread still
    holds would be the last reference."""
    destroyed: list[str] = []

    class Client(FakeProducer):
        def __del__(self) -> None:  # where CPython runs it: the thread that drops the last reference
            destroyed.append(threading.current_thread().name)

    made: list[Client] = []

    def factory(config: dict[str, Any]) -> Client:
        made.append(Client(config))
        return made[-1]

    latch = FatalLatch()
    wrapper = ExactlyOnceProducer(OutputProducer({"transactional.id": "t"}, latch, producer_factory=factory,
                                                 poll_interval_s=0.01), InFlightTable())
    wrapper.start()
    release = threading.Event()
    stuck = threading.Thread(target=release.wait, args=(10,))
    stuck.start()
    wrapper.replace_client(stuck)
    made.pop(0)  # the test's own reference
    release.set()  # the call blocked in the old client returns
    deadline = time.monotonic() + 5
    while not destroyed and time.monotonic() < deadline:
        time.sleep(0.01)
    wrapper.stop(2.0)
    assert destroyed == ["kwe-retire-producer"] and wrapper.abandoned == 0


def test_the_isolating_backend_passes_on_typed_members_only() -> None:
    from worker.backends.isolating import IsolatingBackend

    class Serial:
        name, dim, max_contexts, requires_serial_dispatch = "tensorrt", 4, 2, True
        plan = "private to the backend"

    class Plain:
        name, dim, max_contexts, requires_serial_dispatch = "onnxruntime", 4, None, False

    canary = np.arange(1, 4, dtype=np.int64)
    serial, plain = IsolatingBackend(Serial(), canary), IsolatingBackend(Plain(), canary)  # type: ignore[arg-type]
    assert serial.requires_serial_dispatch and not plain.requires_serial_dispatch
    assert (serial.name, serial.dim, serial.max_contexts) == ("tensorrt", 4, 2)
    with pytest.raises(AttributeError):
        serial.plan  # noqa: B018 - no attribute is forwarded untyped


@pytest.mark.parametrize("fenced", [FENCED, INVALID_TXN_STATE], ids=["fenced", "invalid-txn-state"])
def test_a_fenced_poll_goes_to_the_transaction_loop_and_the_delivery_thread_serves_on(fenced: KafkaError) -> None:
    """Exactly-once: confluent-kafka raises a transactional producer's fatal _FENCED (or the fatal
    INVALID_TXN_STATE of an EndTxn) from poll. It may be the broker's transaction timeout after a
    coordinator outage, which a new producer takes over (worker/ledger/exactly_once/transactions.py), so the
    delivery thread reports it as a failed write and keeps serving, instead of stopping the worker
    (and itself) before the transaction loop can decide. Failed before the fix: the latch tripped and
    the delivery thread ended (INVALID_TXN_STATE: CI, 2026-12-04). Other guarantees: as before."""

    class Fenced(FakeProducer):
        raised = False

        def poll(self, timeout: float) -> int:
            if not self.raised:
                self.raised = True
                raise KafkaException(fenced)
            return super().poll(timeout)

    for exactly_once in (True, False):
        latch = FatalLatch()
        plain = OutputProducer({}, latch, producer_factory=Fenced, poll_interval_s=0.01)
        wrapper: OutputProducer | ExactlyOnceProducer = plain
        failed: list[str] = []
        if exactly_once:
            wrapper = ExactlyOnceProducer(plain, InFlightTable())
            wrapper.fail_writes_into(failed.append)
        wrapper.start()
        deadline = time.monotonic() + 5
        while not (failed or latch.is_set()) and time.monotonic() < deadline:
            time.sleep(0.01)
        if exactly_once:
            assert not latch.is_set(), latch.error
            assert failed and fenced.name() in failed[0] and wrapper.thread.is_alive()
            acked: list[bool] = []
            assert wrapper.produce("out", b"k", b"v", [], lambda: acked.append(True))
            assert wrapper.flush(Deadline.after(5.0)) == 0 and acked == [True]
        else:
            assert isinstance(latch.error, DeliveryError) and fenced.name() in str(latch.error)
        wrapper.stop(2.0)
