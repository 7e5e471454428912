"""The backfill's pieces without a broker: `--from`, the range captured at start and kept, where a
restart resumes, the gate that bounds the poll loop to the range, and `--max-rate`'s token bucket.
Fakes stand in for the cluster (tests/backfill_fakes.py) and the consumer; the broker runs in
tests/broker/test_backfill_kafka.py; the retries of a cluster that is not ready in tests/unit/worker/backfill/test_cluster_calls.py.
Under a second.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pytest
from confluent_kafka import TopicPartition

from tests.backfill_fakes import TOPIC, FakeCluster
from worker.backfill import range as rng_mod
from worker.backfill.gate import RangeGate
from worker.backfill.group_offsets import GroupOffsets
from worker.backfill.range import (FromSpec, Kafka, PartitionRange, Plan, Range, load_range, open_range, plan,
                                   range_group)
from worker.backfill.rate import TokenBucket
from worker.ledger.offsets import OffsetTracker
from worker.settings.schema import SettingsError


# ------------------------------------------------------------------ --from


@pytest.mark.parametrize(("raw", "kind", "value", "text"), [
    ("beginning", "beginning", 0, "beginning"),
    ("earliest", "beginning", 0, "beginning"),
    ("1200", "offset", 1200, "offset:1200"),
    ("1717171717000ms", "timestamp", 1717171717000, "timestamp:1717171717000"),
    ("2026-05-01T00:00:00Z", "timestamp", 1777593600000, "timestamp:1777593600000"),
    ("2026-05-01T02:00:00+02:00", "timestamp", 1777593600000, "timestamp:1777593600000"),
    ("2026-05-01T00:00:00", "timestamp", 1777593600000, "timestamp:1777593600000"),  # no zone: UTC
])
def test_from_is_a_beginning_an_offset_or_a_timestamp(raw: str, kind: str, value: int, text: str) -> None:
    assert FromSpec.parse(raw) == FromSpec(kind, value, text)  # type: ignore[arg-type]


def test_a_bad_from_is_a_setting_error() -> None:
    with pytest.raises(SettingsError, match="--from 'yesterday'"):
        FromSpec.parse("yesterday")


# ------------------------------------------------------------------ the range captured at start


def _cluster() -> FakeCluster:
    return FakeCluster(earliest={0: 0, 1: 10, 2: 0}, latest={0: 100, 1: 50, 2: 0}, by_time={0: 60, 1: -1, 2: -1})


def _kafka(cluster: FakeCluster) -> Kafka:
    return Kafka(cluster.admin(), GroupOffsets({}, consumer=cluster.consumer), empty_wait_s=40.0)


def test_the_range_runs_from_the_log_start_to_the_ends_at_capture_read_committed() -> None:
    cluster = _cluster()
    r = rng_mod.capture(_kafka(cluster), TOPIC, FromSpec.parse("beginning"), now_ms=5)
    assert r.parts == (PartitionRange(0, 0, 100), PartitionRange(1, 10, 50), PartitionRange(2, 0, 0))
    assert r.total == 140 and r.captured_ms == 5 and r.end_of(1) == 50 and r.end_of(7) is None
    from confluent_kafka import IsolationLevel

    assert set(cluster.isolation) == {IsolationLevel.READ_COMMITTED}  # the ends are last stable offsets


def test_an_offset_is_kept_within_each_partitions_log_and_a_timestamp_finds_its_first_record() -> None:
    by_offset = rng_mod.capture(_kafka(_cluster()), TOPIC, FromSpec.parse("30"))
    assert [(p.start, p.end) for p in by_offset.parts] == [(30, 100), (30, 50), (0, 0)]
    past = rng_mod.capture(_kafka(_cluster()), TOPIC, FromSpec.parse("5000"))
    assert past.total == 0  # past every end: nothing
    below = rng_mod.capture(_kafka(_cluster()), TOPIC, FromSpec.parse("3"))
    assert below.parts[1].start == 10  # below the log start: from the log start
    by_time = rng_mod.capture(_kafka(_cluster()), TOPIC, FromSpec.parse("1000ms"))
    # Partition 1 has no record at or after it: nothing to do there.
    assert [(p.start, p.end) for p in by_time.parts] == [(60, 100), (50, 50), (0, 0)]


def test_the_range_is_kept_in_a_group_of_its_own_and_read_back_on_a_restart() -> None:
    cluster = _cluster()
    first, kept = open_range(_kafka(cluster), "g", TOPIC, FromSpec.parse("beginning"))
    assert not kept
    meta = json.loads(cluster.groups[range_group("g")][0][1] or "")
    assert cluster.groups[range_group("g")][0][0] == 100 and meta["start"] == 0 and meta["from"] == "beginning"
    # The topic grew since: a restart keeps the range captured first.
    cluster.latest = {0: 900, 1: 700, 2: 300}
    again, kept = open_range(_kafka(cluster), "g", TOPIC, FromSpec.parse("beginning"))
    assert kept and again == first
    # Another --from is another range: refused, not mixed.
    with pytest.raises(SettingsError, match="already holds a range of keywords from beginning"):
        open_range(_kafka(cluster), "g", TOPIC, FromSpec.parse("10"))


def test_the_new_live_group_takes_over_where_the_range_ends() -> None:
    cluster = _cluster()
    # A new live group without offsets: it starts at the ends, which stay the range's.
    r, _ = open_range(_kafka(cluster), "g", TOPIC, FromSpec.parse("beginning"), live_group="v2")
    assert [p.end for p in r.parts] == [100, 50, 0]
    assert {p: off for p, (off, _) in cluster.groups["v2"].items()} == {0: 100, 1: 50, 2: 0}
    # A live group that already committed (it ran first): the range ends where it stands instead.
    cluster = _cluster()
    cluster.groups["v2"] = {0: (80, None)}
    r, _ = open_range(_kafka(cluster), "g", TOPIC, FromSpec.parse("beginning"), live_group="v2")
    assert [(p.start, p.end) for p in r.parts] == [(0, 80), (10, 50), (0, 0)]
    assert cluster.groups["v2"][0][0] == 80 and cluster.groups["v2"][1][0] == 50
    assert cluster.groups[range_group("g")][0][0] == 80  # kept as such: a restart ends there too
    # A live group that runs already without offsets cannot be given a start: said at once.
    cluster = _cluster()
    cluster.members_until["v2"] = float("inf")
    with pytest.raises(rng_mod.BackfillError, match="--live-group 'v2' runs already"):
        open_range(_kafka(cluster), "g", TOPIC, FromSpec.parse("beginning"), live_group="v2")


def test_a_group_that_holds_something_else_is_refused() -> None:
    cluster = _cluster()
    cluster.groups[range_group("g")] = {0: (5, "not json")}
    with pytest.raises(rng_mod.BackfillError, match="not a backfill range"):
        load_range(_kafka(cluster), "g", TOPIC, [0, 1, 2])


# ------------------------------------------------------------------ where a restart resumes


RANGE = Range(TOPIC, "beginning", 0, (PartitionRange(0, 0, 100), PartitionRange(1, 10, 50), PartitionRange(2, 5, 5)))


def test_a_first_start_begins_at_the_range_and_commits_it_there() -> None:
    p = plan(RANGE, {})
    assert p.resume == {0: 0, 1: 10, 2: 5} and p.to_commit == {0: 0, 1: 10, 2: 5}
    assert p.left == {0: 100, 1: 40} and p.done_before == 0 and not p.complete


def test_a_restart_resumes_at_the_committed_offsets_and_does_not_redo_the_finished_part() -> None:
    p = plan(RANGE, {0: 70, 1: 50, 2: 5})
    assert p.resume == {0: 70, 1: 50, 2: 5} and p.to_commit == {}
    assert p.left == {0: 30} and p.done_before == 70 + 40
    # Committed past the end (the end itself, or a live group's offsets): done, never past it.
    assert plan(RANGE, {0: 400, 1: 50, 2: 9}).complete
    # Below the start (the group used for something else before): from the range's start.
    below = plan(RANGE, {0: 0, 1: 3, 2: None})
    assert below.resume[1] == 10 and below.to_commit == {1: 10, 2: 5}


# ------------------------------------------------------------------ the gate


@dataclass
class FakeMessage:
    p: int
    off: int
    t: str = TOPIC

    def topic(self) -> str:
        return self.t

    def partition(self) -> int:
        return self.p

    def offset(self) -> int:
        return self.off


@dataclass
class FakeConsumer:
    positions: dict[int, int] = field(default_factory=dict)
    paused: list[int] = field(default_factory=list)
    commits: list[tuple[int, int]] = field(default_factory=list)
    group: dict[int, int] = field(default_factory=dict)

    def pause(self, tps: list[TopicPartition]) -> None:
        self.paused += [tp.partition for tp in tps]

    def position(self, tps: list[TopicPartition]) -> list[TopicPartition]:
        return [TopicPartition(tp.topic, tp.partition, self.positions.get(tp.partition, -1001)) for tp in tps]

    def commit(self, offsets: list[TopicPartition], asynchronous: bool) -> None:
        self.commits += [(tp.partition, tp.offset) for tp in offsets]

    def committed(self, tps: list[TopicPartition], timeout: float) -> list[TopicPartition]:
        return [TopicPartition(tp.topic, tp.partition, self.group.get(tp.partition, -1001)) for tp in tps]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0  # every look is a new check
        return self.now


def _gate(plan_: Plan) -> tuple[RangeGate, FakeConsumer, OffsetTracker]:
    consumer, tracker = FakeConsumer(), OffsetTracker()
    return RangeGate(plan_, consumer, tracker, clock=Clock()), consumer, tracker


def test_records_past_the_end_stay_out_and_pause_their_partition() -> None:
    gate, consumer, _ = _gate(plan(RANGE, {}))
    kept = gate.admit([FakeMessage(0, 98), FakeMessage(0, 99), FakeMessage(0, 100), FakeMessage(1, 49),
                       FakeMessage(1, 77), FakeMessage(3, 0)])
    assert [(m.p, m.off) for m in kept] == [(0, 98), (0, 99), (1, 49)]
    # Past the end, and a partition made after the capture: the live group's.
    assert gate.dropped == 3 and sorted(set(consumer.paused)) == [0, 1, 3]


def _finish(tracker: OffsetTracker, partition: int, offsets: range) -> None:
    part = tracker.assign(TOPIC, partition)
    for off in offsets:
        part.track(off)
        part.done(off)
    part.request_commit(offsets.stop)
    part.confirm_commit(offsets.stop)


def test_the_run_finishes_when_every_partition_reached_its_end_and_is_committed() -> None:
    gate, consumer, tracker = _gate(plan(RANGE, {}))
    assert not gate.finished()  # nothing assigned yet
    _finish(tracker, 0, range(0, 100))
    part1 = tracker.assign(TOPIC, 1)
    for off in range(10, 49):  # offset 49 is a transaction marker: never delivered
        part1.track(off)
        part1.done(off)
    consumer.positions = {0: 100, 1: 45}
    assert not gate.finished() and gate.left() == {1: 1}  # the marker's offset
    part1.request_commit(49)
    part1.confirm_commit(49)
    assert not gate.finished()  # committed to the last record, but the position is short of the end
    consumer.positions[1] = 50  # librdkafka moved past the marker
    assert gate.finished() and gate.complete
    # The end is committed for the group, past the marker: a restart sees the partition done.
    assert (1, 50) in consumer.commits and (0, 100) not in consumer.commits
    assert gate.progress() == 140 and gate.left() == {}


def test_a_partition_with_records_in_flight_is_not_done() -> None:
    gate, consumer, tracker = _gate(plan(RANGE, {1: 50}))
    part = tracker.assign(TOPIC, 0)
    for off in range(0, 100):
        part.track(off)
    for off in range(1, 100):
        part.done(off)
    consumer.positions = {0: 100}
    assert not gate.finished() and gate.left() == {0: 100}
    part.done(0)
    assert not gate.finished()  # finished, not yet committed
    part.request_commit(100)
    part.confirm_commit(100)
    assert gate.finished()


def test_partitions_of_other_members_are_done_by_the_groups_offsets() -> None:
    gate, consumer, tracker = _gate(plan(RANGE, {}))
    _finish(tracker, 0, range(0, 100))
    consumer.positions = {0: 100}
    assert not gate.finished()
    tracker.revoke(TOPIC, 0)
    consumer.group = {1: 50}  # partition 1 finished by another member
    assert any(gate.finished() for _ in range(3))  # the group's offsets are read every 2 s


# ------------------------------------------------------------------ --max-rate


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept = 0.0

    def clock(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s
        self.slept += s


def test_the_token_bucket_holds_the_rate_over_a_run() -> None:
    t = FakeTime()
    bucket = TokenBucket(200.0, clock=t.clock, sleep=t.sleep)
    taken = 0
    while t.now < 10.0:
        n = bucket.allow(500)  # the poll loop would take up to 500
        bucket.take(n)
        taken += n
        t.now += 0.003  # the poll turn itself
    assert abs(taken / t.now - 200.0) / 200.0 < 0.02, taken / t.now


def test_the_bucket_waits_briefly_for_a_token_and_never_bursts_past_its_bound() -> None:
    t = FakeTime()
    bucket = TokenBucket(10.0, clock=t.clock, sleep=t.sleep)
    assert bucket.allow(5) == 1  # the first record at once
    bucket.take(1)
    assert bucket.allow(5) == 0 and 0 < t.slept <= 0.05  # waits at most 50 ms, then gives the turn back
    t.now += 100.0  # idle for long: the bucket holds at most its burst (a tenth of a second, >= 1)
    assert bucket.allow(500) == 1
    fast = TokenBucket(1000.0, clock=t.clock, sleep=t.sleep)
    t.now += 5.0
    assert fast.allow(10_000) == 100
    with pytest.raises(ValueError):
        TokenBucket(0.0)
