"""A fake cluster for the backfill's range without a broker: the admin client's side (partitions, log
starts and ends, time indexes) and the groups' committed offsets behind fake consumers that never
join, with a coordinator that can be loading, moving, or hold a killed run's member, on a fake clock.

The admin client's group calls (ListConsumerGroupOffsets, AlterConsumerGroupOffsets) answer as the
consumers' do, so a test can run the code from before issue 57 against the same cluster.
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import KafkaError, KafkaException, TopicPartition

TOPIC = "keywords"


@dataclass
class FakeClock:
    """Stands in for the `time` module of worker/backfill/cluster_calls.py: sleeping moves it on."""

    now: float = 0.0
    sleeps: list[float] = field(default_factory=list)

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def _future(value: Any = None, error: KafkaError | None = None) -> Future[Any]:
    f: Future[Any] = Future()
    if error is not None:
        f.set_exception(KafkaException(error))
    else:
        f.set_result(value)
    return f


@dataclass
class _Offset:
    offset: int


@dataclass
class _GroupAnswer:
    topic_partitions: list[TopicPartition]


@dataclass
class FakeCluster:
    """One topic's offsets and the groups' committed offsets.

    - `loading_until`: the coordinator answers COORDINATOR_LOAD_IN_PROGRESS before this time;
    - `not_coordinator`: then NOT_COORDINATOR this many times (it moved);
    - `members_until`: a group keeps a (killed) member until this time: a commit to it is refused;
    - `errors`: further errors for the next group calls, in order.
    """

    earliest: dict[int, int]
    latest: dict[int, int]
    by_time: dict[int, int] = field(default_factory=dict)
    clock: FakeClock = field(default_factory=FakeClock)
    groups: dict[str, dict[int, tuple[int, str | None]]] = field(default_factory=dict)
    loading_until: float = 0.0
    not_coordinator: int = 0
    members_until: dict[str, float] = field(default_factory=dict)
    errors: list[KafkaError] = field(default_factory=list)
    isolation: list[Any] = field(default_factory=list)
    calls: Counter[str] = field(default_factory=Counter)
    consumers: list[FakeGroupConsumer] = field(default_factory=list)

    # -------------------------------------------------------------- the coordinator

    def coordinator_error(self) -> KafkaError | None:
        if self.clock.now < self.loading_until:
            return KafkaError(KafkaError.COORDINATOR_LOAD_IN_PROGRESS, "Broker: Coordinator load in progress")
        if self.not_coordinator:
            self.not_coordinator -= 1
            return KafkaError(KafkaError.NOT_COORDINATOR, "Broker: Not coordinator")
        if self.errors:
            return self.errors.pop(0)
        return None

    def fetch(self, group: str, partitions: list[int]) -> list[TopicPartition]:
        kept = self.groups.get(group, {})
        out = []
        for p in partitions:
            off, meta = kept.get(p, (-1001, None))
            out.append(TopicPartition(TOPIC, p, off, metadata=meta) if meta else TopicPartition(TOPIC, p, off))
        return out

    def store(self, group: str, tps: list[TopicPartition]) -> KafkaError | None:
        err = self.coordinator_error()
        if err is not None:
            return err
        if self.clock.now < self.members_until.get(group, 0.0):
            return KafkaError(KafkaError.UNKNOWN_MEMBER_ID, "Broker: Unknown member")
        kept = self.groups.setdefault(group, {})
        for tp in tps:
            kept[tp.partition] = (tp.offset, tp.metadata)
        return None

    # -------------------------------------------------------------- the clients

    def admin(self, config: dict[str, Any] | None = None) -> FakeAdmin:
        return FakeAdmin(self)

    def consumer(self, config: dict[str, Any]) -> FakeGroupConsumer:
        c = FakeGroupConsumer(self, config)
        self.consumers.append(c)
        return c


@dataclass
class FakeAdmin:
    cluster: FakeCluster

    def list_topics(self, topic: str, timeout: float) -> Any:
        parts = {p: object() for p in self.cluster.latest}
        meta = type("T", (), {"partitions": parts, "error": None})()
        return type("M", (), {"topics": {TOPIC: meta}})()

    def list_offsets(self, request: dict[TopicPartition, Any], isolation_level: Any, request_timeout: float) -> Any:
        self.cluster.isolation.append(isolation_level)
        out = {}
        for tp, spec in request.items():
            name = repr(spec)
            if "Earliest" in name or spec._value == -2:
                value = self.cluster.earliest[tp.partition]
            elif "Latest" in name or spec._value == -1:
                value = self.cluster.latest[tp.partition]
            else:
                value = self.cluster.by_time.get(tp.partition, -1)
            out[tp] = _future(_Offset(value))
        return out

    # The admin client's group calls (the code before issue 57 used them).

    def list_consumer_group_offsets(self, requests: list[Any], request_timeout: float) -> Any:
        [req] = requests
        self.cluster.calls["admin ListConsumerGroupOffsets"] += 1
        err = self.cluster.coordinator_error()
        if err is not None:
            return {req.group_id: _future(error=err)}
        tps = self.cluster.fetch(req.group_id, [tp.partition for tp in req.topic_partitions])
        return {req.group_id: _future(_GroupAnswer(tps))}

    def alter_consumer_group_offsets(self, requests: list[Any], request_timeout: float) -> Any:
        [req] = requests
        self.cluster.calls["admin AlterConsumerGroupOffsets"] += 1
        err = self.cluster.store(req.group_id, list(req.topic_partitions))
        if err is not None:
            return {req.group_id: _future(error=err)}
        return {req.group_id: _future(_GroupAnswer(list(req.topic_partitions)))}


class FakeGroupConsumer:
    """A consumer with a group id that never subscribes: committed(), commit(asynchronous=True), poll()."""

    def __init__(self, cluster: FakeCluster, config: dict[str, Any]) -> None:
        self.cluster, self.config = cluster, config
        self.group = config["group.id"]
        self.pending: list[tuple[KafkaError | None, list[TopicPartition]]] = []
        self.closed = False

    def committed(self, partitions: list[TopicPartition], timeout: float) -> list[TopicPartition]:
        self.cluster.calls["consumer OffsetFetch"] += 1
        err = self.cluster.coordinator_error()
        if err is not None:
            raise KafkaException(err)
        return self.cluster.fetch(self.group, [tp.partition for tp in partitions])

    def commit(self, offsets: list[TopicPartition], asynchronous: bool) -> None:
        assert asynchronous, "a synchronous commit cannot be bounded"
        self.cluster.calls["consumer OffsetCommit"] += 1
        err = self.cluster.store(self.group, offsets)
        self.pending.append((err, [TopicPartition(tp.topic, tp.partition, tp.offset) for tp in offsets]))

    def poll(self, timeout: float) -> None:
        while self.pending:
            self.config["on_commit"](*self.pending.pop(0))

    def subscribe(self, topics: list[str]) -> None:
        raise AssertionError("the range's consumers never join their group")

    def close(self) -> None:
        self.closed = True
