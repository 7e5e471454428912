"""At the in-flight bound, intake holds instead of pausing: the whole pipeline with fake clients.

A pause throws away what librdkafka prefetched and, measured against the real broker, fetching
starts again only at its broker thread's next wake-up: a backlog moved 4,096 records (max_in_flight)
a second, the worker idle in between. A hold consumes nothing while room comes back (acknowledgements,
and the synchronous commit of the finished work at the bound) and keeps the partitions fetching; held
for HOLD_S, a slow or stuck stage, the partitions pause as before.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition

import worker.pipeline as pipeline_module
from tests.fakes.consumer import FakeGroupConsumer
from tests.fakes.pipeline import AckingProducer, HalvesBackend, ThreeTokens
from worker.app import wire_pipeline
from worker.formats.messages import OutputCodec
from worker.core.profiles import Bucket, Profile
from worker.ledger.committer import RELIEVE_GAP_S, Committer
from worker.settings.schema import Settings

WAIT_S = 20.0  # only a guard against a hang


class _Consumer(FakeGroupConsumer):
    """Both partitions assigned at once; pauses and commits recorded, commits answered as librdkafka would."""

    def __init__(self, config: dict[str, Any], records: int) -> None:
        super().__init__(config, partitions=2, records=records)
        self.commits: list[tuple[int, int, bool]] = []
        self.sync_while_paused = 0  # synchronous commits made while partitions were paused
        self.pauses = 0
        self.before_stop: tuple[int, set[int]] = (0, set())

    def subscribe(self, topics: list[str], on_assign: Any = None, on_revoke: Any = None, on_lost: Any = None) -> None:
        super().subscribe(topics, on_assign, on_revoke, on_lost)
        self.queue.append(self.assign_op([0, 1]))

    def pause(self, partitions: list[TopicPartition]) -> None:
        self.pauses += 1
        super().pause(partitions)

    def commit(self, offsets: list[TopicPartition], asynchronous: bool = True) -> list[TopicPartition] | None:
        answer = [TopicPartition(tp.topic, tp.partition, tp.offset) for tp in offsets]
        self.commits += [(tp.partition, tp.offset, asynchronous) for tp in offsets]
        self.sync_while_paused += not asynchronous and bool(self.paused)
        if asynchronous:
            self.config["on_commit"](None, answer)
            return None
        return answer


def _run(records: int, max_in_flight: int, *, stuck_after: int | None = None, hold_s: float | None = None,
         commit_interval_ms: int = 60_000,
         monkeypatch: pytest.MonkeyPatch) -> tuple[Any, _Consumer, AckingProducer, float]:
    if hold_s is not None:
        monkeypatch.setattr(pipeline_module, "HOLD_S", hold_s)
    made: dict[str, Any] = {}
    profile = Profile("test", (Bucket(8, 16, 16),), token_budget=256, pad_to="bucket")
    # By default a commit interval longer than the run: only the commits at the bound free room.
    s = Settings(input_format="raw", pad_to="bucket", shutdown_timeout_s=5.0, commit_interval_ms=commit_interval_ms,
                 max_queue_delay_ms=1, dispatchers=1, max_in_flight=max_in_flight)
    pipeline = wire_pipeline(s, tokenizer=ThreeTokens(), backend=HalvesBackend(), profile=profile, model_name="m",
                             codec=OutputCodec(model="m", dim=4, encoding="float-list"),
                             consumer_factory=lambda c: made.setdefault("consumer", _Consumer(c, records)),
                             producer_factory=lambda c: made.setdefault("producer", AckingProducer(c)))
    runner = threading.Thread(target=pipeline.run, daemon=True)
    start = time.monotonic()
    runner.start()
    deadline = start + WAIT_S
    while "producer" not in made and time.monotonic() < deadline:
        time.sleep(0.01)
    producer: AckingProducer = made["producer"]
    if stuck_after is not None:
        while len(producer.acked) < stuck_after and time.monotonic() < deadline:
            time.sleep(0.001)
        producer.stuck.set()
        while made["consumer"].pauses == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        producer.stuck.clear()
    while len(set(producer.acked)) < 2 * records and time.monotonic() < deadline:
        time.sleep(0.01)
    took = time.monotonic() - start
    consumer: _Consumer = made["consumer"]
    while consumer.paused and time.monotonic() < deadline:  # the last commit's room resumes them
        time.sleep(0.01)
    # What the run did, before the drain pauses everything.
    consumer.before_stop = (consumer.pauses, set(consumer.paused))
    pipeline.request_stop()
    runner.join(WAIT_S)
    assert not runner.is_alive()
    return pipeline, made["consumer"], producer, took


def _holds(pipeline: Any) -> float:
    return pipeline.metrics.intake_holds._value.get()  # noqa: SLF001


def test_a_backlog_holds_at_the_bound_and_never_pauses(monkeypatch: pytest.MonkeyPatch) -> None:
    pipeline, consumer, producer, _ = _run(400, 64, monkeypatch=monkeypatch)
    assert set(producer.acked) == {f"{p}-{o}".encode() for p in (0, 1) for o in range(400)}
    assert consumer.before_stop == (0, set())  # before: paused at every 64 records, and resumed
    assert _holds(pipeline) >= 400 * 2 // 64 // 2  # the bound was reached over and over
    sync = [(p, o) for p, o, asynchronous in consumer.commits if not asynchronous]
    assert sync, "room came back only through the commit at the bound (the interval is a minute)"
    # The bound held: no synchronous commit left more than max_in_flight behind the records consumed.
    assert max(o for p, o in sync if p == 0) == 400 and max(o for p, o in sync if p == 1) == 400


def test_a_stuck_output_holds_then_pauses_and_resumes_once_it_moves(monkeypatch: pytest.MonkeyPatch) -> None:
    # The default commit interval: paused, the regular asynchronous commits free the room.
    pipeline, consumer, producer, _ = _run(300, 32, stuck_after=50, hold_s=0.3, commit_interval_ms=100,
                                           monkeypatch=monkeypatch)
    pauses, paused = consumer.before_stop
    assert pauses >= 1  # held for HOLD_S, then paused: a paused member serves the group
    assert not paused  # and resumed once the output moved again
    # No synchronous commit while paused: each would block the poll thread (a second during a
    # coordinator outage, a kwe-commit thread left blocked per try). Before: one every turn.
    assert consumer.sync_while_paused == 0
    assert set(producer.acked) == {f"{p}-{o}".encode() for p in (0, 1) for o in range(300)}
    assert _holds(pipeline) >= 1


class _CommitConsumer:
    def __init__(self) -> None:
        self.calls: list[list[tuple[int, int]]] = []
        self.fail = False

    def commit(self, offsets: list[TopicPartition], asynchronous: bool = True) -> list[TopicPartition]:
        self.calls.append([(tp.partition, tp.offset) for tp in offsets])
        if self.fail:
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT))
        return [TopicPartition(tp.topic, tp.partition, tp.offset) for tp in offsets]


def test_the_commit_at_the_bound_waits_for_its_target_and_backs_off_after_a_failure() -> None:
    now = [0.0]
    fake = _CommitConsumer()
    c = Committer(fake, interval_s=0.5, clock=lambda: now[0])
    part = c.tracker.assign("t", 0)
    for off in range(100):
        part.track(off)
    for off in range(40):
        part.done(off)
    assert c.uncommitted() == 100
    # Committing offset 40 would leave 60 uncommitted: not at a target of 50 yet.
    assert not c.commit_to_relieve(50, timeout_s=1.0) and fake.calls == []
    for off in range(40, 60):
        part.done(off)
    assert c.commit_to_relieve(50, timeout_s=1.0) and fake.calls == [[(0, 60)]]
    assert c.uncommitted() == 40
    for off in range(100, 120):
        part.track(off)
    for off in range(60, 100):
        part.done(off)
    now[0] += RELIEVE_GAP_S  # after a success, none for RELIEVE_GAP_S
    fake.fail = True
    assert not c.commit_to_relieve(50, timeout_s=1.0) and len(fake.calls) == 2
    now[0] += 0.4
    assert not c.commit_to_relieve(50, timeout_s=1.0) and len(fake.calls) == 2  # backing off
    fake.fail = False
    now[0] += 0.2
    assert c.commit_to_relieve(50, timeout_s=1.0) and fake.calls[-1] == [(0, 100)]
    assert c.uncommitted() == 20


def _tracked(c: Committer, records: int, done: int) -> None:
    part = c.tracker.assign("t", 0)
    for off in range(records):
        part.track(off)
    for off in range(done):
        part.done(off)


def test_the_commit_at_the_bound_commits_nothing_that_frees_nothing_and_not_every_turn() -> None:
    now = [0.0]
    fake = _CommitConsumer()
    c = Committer(fake, interval_s=0.5, clock=lambda: now[0])
    _tracked(c, 40, 30)
    # 40 uncommitted, under a target of 50 already: the byte bound is what holds, and only
    # acknowledgements free bytes. Before: a commit every turn of the hold (200 a second).
    for _ in range(20):
        assert not c.commit_to_relieve(50, timeout_s=1.0)
    assert fake.calls == []
    part = c.tracker.get("t", 0)
    assert part is not None
    for off in range(40, 100):
        part.track(off)
    for off in range(30, 60):
        part.done(off)
    assert c.commit_to_relieve(50, timeout_s=1.0) and fake.calls == [[(0, 60)]]
    for off in range(60, 100):
        part.track(off + 40)
        part.done(off)
    now[0] += RELIEVE_GAP_S / 2
    assert not c.commit_to_relieve(50, timeout_s=1.0) and len(fake.calls) == 1  # too soon after a success
    now[0] += RELIEVE_GAP_S / 2
    assert c.commit_to_relieve(50, timeout_s=1.0) and fake.calls[-1] == [(0, 100)]


class _SilentCoordinator(_CommitConsumer):
    """A synchronous commit that gets no answer until `answer` is set (a coordinator outage)."""

    def __init__(self) -> None:
        super().__init__()
        self.answer = threading.Event()

    def commit(self, offsets: list[TopicPartition], asynchronous: bool = True) -> list[TopicPartition]:
        self.calls.append([(tp.partition, tp.offset) for tp in offsets])
        self.answer.wait(WAIT_S)
        return [TopicPartition(tp.topic, tp.partition, tp.offset) for tp in offsets]


def _commit_threads() -> int:
    return sum(t.name == "kwe-commit" and t.is_alive() for t in threading.enumerate())


def test_a_commit_at_the_bound_without_an_answer_is_the_only_one_outstanding() -> None:
    now = [0.0]
    fake = _SilentCoordinator()
    c = Committer(fake, interval_s=0.1, clock=lambda: now[0])
    _tracked(c, 100, 80)
    threads = _commit_threads()
    try:
        assert not c.commit_to_relieve(50, timeout_s=0.2)  # the poll thread waits once, 0.2 s here
        for _ in range(5):  # a turn after each retry interval, the coordinator still silent
            now[0] += 1.0
            start = time.monotonic()
            assert not c.commit_to_relieve(50, timeout_s=0.2)
            assert time.monotonic() - start < 0.1  # not waited for again
        # Before: a try each interval, each blocking 0.2 s and leaving one more thread blocked.
        assert len(fake.calls) == 1 and _commit_threads() - threads == 1
    finally:
        fake.answer.set()
    deadline = time.monotonic() + WAIT_S
    while _commit_threads() > threads and time.monotonic() < deadline:
        time.sleep(0.01)
    now[0] += 1.0
    assert c.commit_to_relieve(50, timeout_s=1.0) and len(fake.calls) == 2  # answered: the next one goes
