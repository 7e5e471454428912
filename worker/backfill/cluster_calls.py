"""One step of the backfill's start that asks the cluster, retried within one bound, or one clear error.

A broker that has just started, restarted or taken over a failed broker's partitions answers for a
while with errors that mean "ask again": a group coordinator still loading the offsets topic
(COORDINATOR_LOAD_IN_PROGRESS), one that moved or is not known yet (NOT_COORDINATOR,
COORDINATOR_NOT_AVAILABLE), a partition without a leader yet, a timeout, a dropped connection. Each
step (the topic's partitions, its offsets, a group's committed offsets, a commit) retries these
with backoff for at most `RETRY_BOUND_S`, logging each retry, then fails with `BackfillError`
naming the step, the last error and how long it was retried (the command exits 2). Anything else
(a missing topic, a missing ACL, a fatal client error) fails at once.

A commit to a group that still has members (the member of a killed run stays until its session
times out) is retried as long as the caller's `busy_s`, apart from this bound.

Threads: the caller's (the command's main thread); nothing here is shared.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import structlog
from confluent_kafka import KafkaError, KafkaException

from worker.errors import WorkerError
from worker.kafka.errors import fatal_reason

log = structlog.get_logger(__name__)

T = TypeVar("T")

# How long one step retries the cluster's retriable errors before the backfill gives up (exit 2). A
# broker started or restarted on this 2-core box loads its coordinators within seconds; a three-node
# cluster left groups without a coordinator 8.8-13.6 s after a node's SIGKILL
# (benchmarks/results/faults/coordinator_outage.json). A minute covers several such outages in a
# row and still says promptly that a cluster is really gone.
RETRY_BOUND_S = 60.0
# The first retry waits this long, each next one twice as long, up to BACKOFF_MAX_S.
BACKOFF_FIRST_S = 0.25
BACKOFF_MAX_S = 5.0
# One attempt's own wait for an answer (within what is left of the bound).
ATTEMPT_TIMEOUT_S = 15.0

# Broker and client errors that say "ask again", besides those librdkafka flags retriable itself.
RETRIABLE_CODES = frozenset({
    KafkaError.COORDINATOR_LOAD_IN_PROGRESS, KafkaError.COORDINATOR_NOT_AVAILABLE, KafkaError.NOT_COORDINATOR,
    KafkaError.REQUEST_TIMED_OUT, KafkaError.NETWORK_EXCEPTION, KafkaError.LEADER_NOT_AVAILABLE,
    KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.UNKNOWN_LEADER_EPOCH, KafkaError.FENCED_LEADER_EPOCH,
    KafkaError.OFFSET_NOT_AVAILABLE, KafkaError.UNSTABLE_OFFSET_COMMIT, KafkaError.THROTTLING_QUOTA_EXCEEDED,
    KafkaError.KAFKA_STORAGE_ERROR, KafkaError._TRANSPORT, KafkaError._TIMED_OUT, KafkaError._WAIT_COORD,
    KafkaError._ALL_BROKERS_DOWN, KafkaError._RESOLVE,
})
# What a commit to a group that still has members gets back (an OffsetCommit without a member is
# accepted only while the group is empty): the classic protocol's answers, the consumer protocol's,
# and the admin API's.
BUSY_CODES = frozenset({
    KafkaError.UNKNOWN_MEMBER_ID, KafkaError.REBALANCE_IN_PROGRESS, KafkaError.ILLEGAL_GENERATION,
    KafkaError.GROUP_SUBSCRIBED_TO_TOPIC, KafkaError.NON_EMPTY_GROUP, KafkaError.STALE_MEMBER_EPOCH,
})


class BackfillError(WorkerError):
    """The range cannot be captured, read or committed; the message says which and why."""


class GroupBusyError(BackfillError):
    """A commit's group kept members past the wait for it to empty."""


class Retriable(Exception):
    """This attempt failed in a way the next one may not; the message says how."""


class Busy(Exception):
    """The group has members: its offsets can be committed only once it is empty."""


def retriable(err: KafkaError) -> bool:
    """Whether asking again can help: never for a fatal error, an authentication or TLS failure, or a
    missing ACL (worker/kafka/errors.py); the codes above, and what librdkafka flags retriable."""
    if err.fatal() or fatal_reason(err) is not None:
        return False
    return err.code() in RETRIABLE_CODES or err.retriable()


def classify(err: KafkaError) -> Exception:
    """The exception `Retry.run` acts on for a Kafka error: Busy, Retriable or BackfillError."""
    if err.code() in BUSY_CODES:
        return Busy(err.str())
    if retriable(err):
        return Retriable(err.str())
    return BackfillError(fatal_reason(err) or err.str())


@dataclass
class Retry:
    """Runs one step until it succeeds, retrying its retriable failures within `bound_s`."""

    bound_s: float = RETRY_BOUND_S
    attempt_timeout_s: float = ATTEMPT_TIMEOUT_S
    backoff: tuple[float, float] = (BACKOFF_FIRST_S, BACKOFF_MAX_S)
    # None: this module's `time` at each call (a test replaces the module's `time` with a fake clock).
    clock: Callable[[], float] | None = None
    sleep: Callable[[float], None] | None = None

    def _now(self) -> float:
        return (self.clock or time.monotonic)()

    def run(self, what: str, attempt: Callable[[float], T], *, busy_s: float = 0.0, busy_hint: str = "") -> T:
        """`attempt(timeout_s)` until it returns. It raises Retriable, Busy, a KafkaException (sorted
        by `classify`) or a futures timeout to be retried; BackfillError ends the step (named), anything
        else propagates.
        Gives up with BackfillError("<what>: <last error> ...") once the bound (or `busy_s`, for Busy)
        is spent."""
        start = self._now()
        delay, tries = self.backoff[0], 0
        while True:
            tries += 1
            left = self.bound_s - (self._now() - start)
            try:
                return attempt(max(0.5, min(self.attempt_timeout_s, left)))
            except KafkaException as exc:
                err = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
                failure: Exception = classify(err) if err is not None else BackfillError(str(exc))
            except concurrent.futures.TimeoutError:
                failure = Retriable(f"no answer within {max(0.5, min(self.attempt_timeout_s, left)):.3g} s")
            except (Retriable, Busy, BackfillError) as exc:
                failure = exc
            if isinstance(failure, BackfillError):
                raise BackfillError(f"{what}: {failure}") from None
            spent = self._now() - start
            limit = busy_s if isinstance(failure, Busy) else self.bound_s
            if spent >= limit:
                if isinstance(failure, Busy):
                    raise GroupBusyError(f"{what}: {failure}{busy_hint} (tried {tries} times over {spent:.1f} s)") \
                        from None
                raise BackfillError(f"{what}: {failure} (tried {tries} times over {spent:.1f} s)") from None
            wait = min(delay, limit - spent)  # the last try falls at the bound, not before it
            log.warning("backfill: the cluster asked to try again", step=what, error=str(failure),
                        kind="group busy" if isinstance(failure, Busy) else "retriable", attempt=tries,
                        retry_in_s=round(wait, 2), gives_up_in_s=round(limit - spent, 1))
            (self.sleep or time.sleep)(wait)
            delay = min(delay * 2, self.backoff[1])
