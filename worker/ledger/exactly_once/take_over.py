"""Producer take-over: a new librdkafka producer replaces one whose transactional call hung, or
that the broker's transaction timeout fenced (worker/ledger/exactly_once/transactions.py decides when).

Hung (a call did not return within its timeout + HANG_MARGIN_S, worker/ledger/exactly_once/bounded_calls.py):
a new producer with the same transactional.id looks the coordinators up afresh, and its
init_transactions fences the old one and completes the old transaction (commits it if its commit
had reached the coordinator, else aborts it). Whether the hung commit landed is then read from the
group's committed offsets, and every partition with work in the transaction is rewound there with
fresh offset state: a commit that landed is not redone, one that did not is consumed again. While
STUCK_CALLS earlier hung calls still block (each holds an abandoned librdkafka client), the member
stops instead.

Fenced (a fatal _FENCED on a transaction open for at least transaction_timeout_s, or a fatal
INVALID_TXN_STATE: errors.py `TAKEN_OVER_FATAL`): after FENCE_SETTLE_S, so the group's verdict
comes first, the same take-over, at most FENCED_TAKE_OVERS times in FENCED_WINDOW_S.

A stop during the take-over, before the rewind, halts the member (Transactions._halt).

Threads: the poll thread only, like the transaction loop it is part of. The replacement itself
runs under the write gate (the exactly-once producer's), so no record is produced into the
client being replaced.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import structlog
from confluent_kafka import KafkaException, TopicPartition

from worker.deadline import Deadline
from worker.ledger.exactly_once.bounded_calls import BoundedCalls
from worker.ledger.exactly_once.errors import TransactionFencedError, TransactionHungError
from worker.ledger.exactly_once.rewind import GroupConsumer, committed_offsets, fresh_state, seek
from worker.errors import WorkerError
from worker.ledger.offsets import OffsetTracker
from worker.latch import FatalLatch

log = structlog.get_logger(__name__)

TakeOverReason = Literal["hung", "fenced"]
# Take-overs while this many replaced producers still block in a hung call: the member stops instead.
STUCK_CALLS = 3
# How long the replacing producer may take to fence the old one (the coordinator may be moving).
TAKE_OVER_INIT_S = 30.0
# A fence on a transaction the broker timed out: how long intake waits before a new producer takes
# over, so the group's verdict comes first (a resumed zombie's consumer finds its session expired
# within a second or a heartbeat, 3 s, and `lost` stops it); and at most how many such take-overs
# in how long (two processes with one member id would fence each other for ever).
FENCE_SETTLE_S = 5.0
FENCED_TAKE_OVERS = 3
FENCED_WINDOW_S = 600.0


@dataclass(frozen=True)
class Fence:
    """A fatal error the coordinator explains (`TAKEN_OVER_FATAL`), waiting for its take-over."""
    call: str
    error: str
    age_s: float
    take_over_at: float
    # Where each partition with work in the transaction began, if its state was replaced already.
    starts: dict[tuple[str, int], int] | None = None


class Loop(Protocol):
    """What the take-over reads and changes of the transaction loop (worker/ledger/exactly_once/transactions.py
    `Transactions`), on the poll thread."""
    producer: Any
    consumer: GroupConsumer
    tracker: OffsetTracker
    latch: FatalLatch
    clock: Callable[[], float]
    sleep: Callable[[float], None]
    stop: Deadline
    timeout_s: float
    state: Literal["idle", "open", "closing"]
    write_gate: AbstractContextManager[Any]
    replace_producer: Callable[[threading.Thread], Any] | None
    forget_revoked: Callable[[], int]
    on_take_over: Callable[[TakeOverReason], None]
    taken_over_fenced: int
    _hung: TransactionHungError | None
    _stuck: list[threading.Thread]
    _fence: Fence | None
    _fenced_at: list[float]
    _calls: BoundedCalls

    def init(self, timeout_s: float = 30.0) -> bool: ...
    def _give_up(self, hung: TransactionHungError, why: str) -> None: ...
    def _halt(self, during: str) -> None: ...
    def _finish(self, outcome: Literal["committed", "aborted", "taken_over"]) -> None: ...


def take_over(txn: Loop, starts: dict[tuple[str, int], int] | None, reason: TakeOverReason) -> None:
    """A transactional call hung, or the producer was fenced by the broker's transaction timeout:
    a new producer takes over (see the module docstring). The member stops (the latch trips)
    when it cannot: no replacement available, too many calls still stuck, or the new producer
    cannot fence the old one or read the committed offsets."""
    give_up: Callable[[str], None]
    if reason == "hung":
        hung = txn._hung or TransactionHungError("a transactional call hung")
        txn._hung = None
        txn._stuck = [t for t in txn._stuck if t.is_alive()]
        if txn.replace_producer is None or hung.call is None or len(txn._stuck) >= STUCK_CALLS:
            txn._give_up(hung, "stopping so that a restarted member aborts the open transaction")
            return
        txn._stuck.append(hung.call)
        old_call = hung.call
        log.warning("transactional call hung; a new producer takes over", error=str(hung),
                    stuck_calls=len(txn._stuck))

        def give_up(why: str) -> None:
            txn._give_up(hung, why)
    else:
        fence, txn._fence = txn._fence, None
        assert fence is not None and txn.replace_producer is not None
        txn._fenced_at.append(txn.clock())
        txn.taken_over_fenced += 1
        # Its last call has returned (fenced): the old client is destroyed at once.
        old_call = txn._calls.last or threading.Thread(target=lambda: None)
        log.warning("producer fenced, or its transaction ended, by the coordinator; a new producer takes over",
                    call=fence.call, error=fence.error, transaction_age_s=round(fence.age_s, 1),
                    fenced_take_overs_in_window=len(txn._fenced_at), bound=FENCED_TAKE_OVERS)

        def give_up(why: str) -> None:
            txn.latch.trip(TransactionFencedError(f"{fence.call} failed: {fence.error} (fenced after "
                                                  f"transaction_timeout_ms); {why}"))
    txn.on_take_over(reason)
    with txn.write_gate:
        if starts is None:  # (an abort that hung has replaced the state already)
            starts = fresh_state(txn.tracker)
        txn.producer = txn.replace_producer(old_call)
        forgotten = txn.forget_revoked()
    txn.state = "idle"  # the old transaction is the new producer's to end, at its init
    try:
        if not txn.init(TAKE_OVER_INIT_S):
            txn._halt("the new producer was initialising")
            return
    except WorkerError as exc:
        give_up(f"the new producer could not take over: {exc}")
        return
    # The old transaction is complete now (init_transactions waits for that): the group's
    # committed offsets say whether the hung commit landed.
    try:
        answer = committed_offsets(txn.consumer, list(starts), limit=Deadline.after(TAKE_OVER_INIT_S, txn.clock),
                                   stop=txn.stop, timeout_s=txn.timeout_s, sleep=txn.sleep)
    except KafkaException as exc:
        give_up(f"the committed offsets could not be read after it: {exc.args[0]}")
        return
    if answer is None:
        txn._halt("the group's committed offsets were being read")
        return
    # No committed offset: the hung commit did not land, and none came before it.
    rewind = [TopicPartition(tp.topic, tp.partition, tp.offset if tp.offset >= 0 else starts[(tp.topic, tp.partition)])
              for tp in answer]
    seek(txn.consumer, txn.tracker, rewind)
    landed = [f"{tp.topic}[{tp.partition}]" for tp in rewind if tp.offset != starts[(tp.topic, tp.partition)]]
    log.warning("a new producer took over; partitions rewound to their committed offsets",
                partitions=[f"{tp.topic}[{tp.partition}]@{tp.offset}" for tp in rewind],
                reason=reason, hung_commit_landed_for=landed, in_flight_forgotten=forgotten)
    txn._finish("taken_over")
