"""A group's committed offsets (and their metadata), read and committed without joining the group.

Not through the admin client. librdkafka's ListConsumerGroupOffsets, answered NOT_COORDINATOR (a
coordinator still loading after a broker start or restart, or one that moved), calls
`rd_kafka_cgrp_op` on the admin client's consumer group, which is NULL, and the process dies of
SIGSEGV with nothing logged (librdkafka #5040, confluent-kafka-python #1982; librdkafka 2.16). Its
other coordinator-bound calls, AlterConsumerGroupOffsets among them, do not take that path
(`rd_kafka_handle_OffsetCommit` is told to ignore the group and checks it for NULL), but they share
the admin coordinator request whose failure path aborted the process on a coordinator that did
not answer (benchmarks/coordinator_outage.py; librdkafka #5397), and after a NOT_COORDINATOR the
admin client keeps asking the coordinator it cached. So neither is used.

Instead, per group, a consumer with that group's id that never subscribes, so it never joins:
- `committed()` sends OffsetFetch through the consumer's own group handle, which re-finds the
  coordinator after NOT_COORDINATOR and retries a load in progress itself;
- `commit()` sends OffsetCommit with no member id and generation -1, as AlterConsumerGroupOffsets
  does: the broker accepts it while the group is empty and answers UNKNOWN_MEMBER_ID while it has
  members (checked against the broker: tests/broker/test_backfill_kafka.py). It is sent asynchronously
  and its answer awaited by polling, so each attempt has a bound of its own; a commit that is
  retried sends the same offsets again.
Every call runs within `Retry` (worker/backfill/cluster_calls.py).

Threads: the caller's (the command's main thread); librdkafka serves the commit callback inside
`poll()`, on that thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import confluent_kafka
from confluent_kafka import KafkaError, TopicPartition

from worker.backfill.cluster_calls import BackfillError, Retriable, Retry, classify
from worker.kafka.client_config import SESSION_TIMEOUT_MS
from worker.settings.kafka_overrides import librdkafka_int

# A commit that needs the group empty waits for the member of a killed run to time out: its
# session (the effective session.timeout.ms of the group's members), then this much for the broker
# to expire it and settle the group.
EMPTY_GROUP_MARGIN_S = 10.0
BUSY_HINT = " (another backfill with this group runs, or one was killed less than its session timeout ago)"


def empty_group_wait_s(member_config: Mapping[str, Any]) -> float:
    """The wait for the group to empty, from the config its members run with (the worker's
    consumer_config, so a session.timeout.ms given through kafka_config counts)."""
    ms = librdkafka_int(str(member_config.get("session.timeout.ms", SESSION_TIMEOUT_MS)))
    return (ms if ms is not None and ms > 0 else SESSION_TIMEOUT_MS) / 1000 + EMPTY_GROUP_MARGIN_S


def _per_partition(answer: Sequence[TopicPartition]) -> None:
    """Raises the first partition's error, sorted as Retry acts on it."""
    for tp in answer:
        if tp.error is not None:
            failure = classify(tp.error)
            if isinstance(failure, BackfillError):
                raise BackfillError(f"{tp.topic}[{tp.partition}]: {tp.error.str()}")
            raise type(failure)(f"{tp.topic}[{tp.partition}]: {failure}")


class GroupOffsets:
    """Reads and commits the offsets of groups it never joins: one consumer per group id, made on
    first use and closed by `close()`."""

    def __init__(self, config: Mapping[str, Any], retry: Retry | None = None, *,
                 consumer: Callable[[dict[str, Any]], Any] | None = None) -> None:
        # The cluster's address and security (admin_config); the group id is added per group.
        self._config = {k: v for k, v in config.items() if k != "group.id"}
        self._retry = retry if retry is not None else Retry()
        self._make = consumer or confluent_kafka.Consumer  # looked up now: a test's fake cluster replaces it
        self._consumers: dict[str, Any] = {}
        # Each group's commit answers, as its consumer's poll() serves them.
        self._answers: dict[str, list[tuple[KafkaError | None, list[TopicPartition]]]] = {}

    def _consumer(self, group: str) -> Any:
        c = self._consumers.get(group)
        if c is None:
            answers = self._answers.setdefault(group, [])
            c = self._make({**self._config, "group.id": group, "enable.auto.commit": False,
                            "enable.auto.offset.store": False,
                            "on_commit": lambda err, partitions: answers.append((err, partitions))})
            self._consumers[group] = c
        return c

    def committed(self, group: str, topic: str, partitions: Sequence[int]) -> dict[int, tuple[int | None, str | None]]:
        """The group's committed offset and metadata per partition (None: none committed)."""
        consumer = self._consumer(group)

        def attempt(timeout_s: float) -> list[TopicPartition]:
            answer = consumer.committed([TopicPartition(topic, p) for p in partitions], timeout=timeout_s)
            _per_partition(answer)
            return list(answer)

        answer = self._retry.run(f"cannot read the committed offsets of group {group!r}", attempt)
        return {tp.partition: (tp.offset if tp.offset >= 0 else None, tp.metadata or None) for tp in answer}

    def commit(self, group: str, topic: str, offsets: Mapping[int, int], metadata: Mapping[int, str] | None = None,
               *, wait_empty_s: float, busy_hint: str = BUSY_HINT) -> None:
        """Commits offsets (and metadata) for a group nobody is in, waiting up to wait_empty_s for the
        members of a killed run to time out (`busy_hint`: what the error adds when they do not)."""
        if not offsets:
            return
        consumer = self._consumer(group)
        answers = self._answers[group]
        meta = metadata or {}
        tps = [TopicPartition(topic, p, off, metadata=meta[p]) if p in meta else TopicPartition(topic, p, off)
               for p, off in sorted(offsets.items())]

        def attempt(timeout_s: float) -> None:
            # An answer to an earlier attempt that timed out may still come: it is for the same offsets.
            answers.clear()
            consumer.commit(offsets=tps, asynchronous=True)
            end = time.monotonic() + timeout_s
            while not answers:
                if time.monotonic() >= end:
                    raise Retriable(f"no answer to the commit within {timeout_s:.3g} s")
                consumer.poll(min(0.1, max(0.0, end - time.monotonic())))
            err, answer = answers[-1]
            if err is not None:
                raise classify(err)
            _per_partition(answer)

        self._retry.run(f"cannot commit the range's offsets for group {group!r}", attempt, busy_s=wait_empty_s,
                        busy_hint=busy_hint)

    def close(self) -> None:
        """Closes each consumer (none joined its group: nothing to leave)."""
        consumers, self._consumers = list(self._consumers.values()), {}
        for c in consumers:
            c.close()
