"""One transactional call of the exactly-once loop (worker/ledger/exactly_once/transactions.py): run on a helper
thread (worker/ledger/exactly_once/bounded_calls.py) with librdkafka's timeout inside the stop deadline,
retried or resumed by its error's class (`kind_of`), and, on a fatal error the coordinator explains
(errors.py `TAKEN_OVER_FATAL`), the decision
whether a new producer takes over (worker/ledger/exactly_once/take_over.py) or the member stops.

Errors of the transactional calls, as librdkafka classifies them, and what the loop does:
- retriable: the call is repeated (send_offsets_to_transaction RETRIES times; commit_transaction
  and abort_transaction are resumed, as librdkafka expects after their retriable timeout, for up
  to transaction_timeout_s: librdkafka refuses any other call meanwhile with _CONFLICT; still
  under way then, they are taken over like a hung call);
- txn_requires_abort: abort, then rewind every owned partition to where this transaction began
  (the last committed offset) with fresh offset state, so nothing consumed into the aborted
  transaction is produced into a later one;
- fatal: the latch trips, nothing more is written, the worker exits non-zero. Except
  INVALID_TXN_STATE (the coordinator holds a state the call cannot end; errors.py
  `TAKEN_OVER_FATAL` says why: taken over as below, whatever the transaction's age), and `_FENCED`
  on a transaction open for at least transaction_timeout_s, as after a coordinator outage: the
  coordinator aborted it on its timeout and bumped the epoch (Kafka's TransactionMetadata
  prepareFenceProducerEpoch), so librdkafka's EndTxn, or its KIP-360 InitProducerId of an abort
  that "requires epoch bump", is answered PRODUCER_FENCED, which it raises as fatal _FENCED
  (rdkafka_txnmgr.c rd_kafka_txn_handle_EndTxn, rdkafka_idempotence.c rd_kafka_idemp_check_error).
  Transactional ids are unique per member, so that is no zombie: after FENCE_SETTLE_S (for the
  stronger signal, the group's: partitions lost with that old transaction, in `lost`, still stop
  the member as a zombie) a new producer takes over as for a hung call (below), at most
  FENCED_TAKE_OVERS times in FENCED_WINDOW_S; then, and on a fence the broker's timeout cannot
  explain (a younger transaction), the member stops: a second process uses its member id;
- hung (the call did not return within its timeout + HANG_MARGIN_S; the calls run on helper
  threads, worker/ledger/exactly_once/bounded_calls.py): a new producer takes over in the process
  (worker/ledger/exactly_once/take_over.py), and every partition with work in the transaction is rewound to the
  group's committed offsets. A stop during the take-over, before the rewind (or while a commit or
  abort is still under way), halts the member (`Transactions._halt`): nothing more is consumed or committed,
  and it exits as usual.

Threads: the poll thread only, like the transaction loop whose state (`CallLoop`) it reads and
sets; the call itself runs on the bounded call's helper thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Literal, Protocol

import structlog
from confluent_kafka import KafkaError, KafkaException, TopicPartition

from worker.deadline import Deadline
from worker.ledger.exactly_once import bounded_calls
from worker.ledger.exactly_once.bounded_calls import BoundedCalls
from worker.ledger.exactly_once.errors import TAKEN_OVER_FATAL, TransactionFencedError, TransactionHungError
from worker.ledger.exactly_once.take_over import FENCE_SETTLE_S, FENCED_TAKE_OVERS, FENCED_WINDOW_S, Fence
from worker.latch import FatalLatch

log = structlog.get_logger(__name__)

# How often a retriable error of a transactional call is retried before the transaction is aborted.
RETRIES = 5
# How much sooner than our own clock says the coordinator may time a transaction out: it times from
# its first AddPartitionsToTxn (after our begin_transaction) on its wall clock, which may run ahead.
TIMEOUT_CLOCK_SLACK_S = 1.0

CallResult = Literal["ok", "abort", "fatal", "fenced", "hung", "unfinished"]


class TransactionalProducer(Protocol):
    def init_transactions(self, timeout: float) -> None: ...
    def begin_transaction(self) -> None: ...
    def send_offsets_to_transaction(self, positions: list[TopicPartition], group_metadata: Any,
                                    timeout: float) -> None: ...
    def commit_transaction(self, timeout: float) -> None: ...
    def abort_transaction(self, timeout: float) -> None: ...



class CallLoop(Protocol):
    """What a call reads and sets of the transaction loop (`Transactions`), on the poll thread."""
    latch: FatalLatch
    clock: Callable[[], float]
    sleep: Callable[[float], None]
    stop: Deadline
    timeout_s: float
    transaction_timeout_s: float
    state: Literal["idle", "open", "closing"]
    began_at: float
    replace_producer: Callable[[threading.Thread], Any] | None
    _hung: TransactionHungError | None
    _fence: Fence | None
    _fenced_at: list[float]
    _calls: BoundedCalls


def kind_of(exc: BaseException) -> Literal["retry", "abort", "fatal"]:
    err = exc.args[0] if isinstance(exc, KafkaException) and exc.args else None
    if not isinstance(err, KafkaError):
        return "fatal"
    if err.fatal():
        return "fatal"
    if err.txn_requires_abort():
        return "abort"
    if err.retriable():
        return "retry"
    # Not retriable and not marked abortable (a stale generation, a state error): the safe way
    # out of an unknown transaction state is to abort it.
    return "abort"



def call_timeout(txn: CallLoop) -> float:
    """librdkafka's timeout for the next call: its own, within the shutdown deadline."""
    return max(0.1, min(txn.timeout_s, txn.stop.left()))


def bounded(txn: CallLoop, what: str, fn: Callable[[], None], grace_s: float = 0.2) -> None:
    """Runs a blocking transactional call on a helper thread (worker/ledger/exactly_once/bounded_calls.py), at
    most timeout_s + HANG_MARGIN_S, and at most grace_s past the shutdown deadline (re-read while
    waiting: a second signal shortens it). Past the bound: TransactionHungError."""
    limit_s = txn.timeout_s + bounded_calls.HANG_MARGIN_S
    txn._calls.run(what, fn, txn.stop.before(-grace_s).limited(limit_s), txn.stop, limit_s)


def call(txn: CallLoop, what: str, fn: Callable[[], None], *, resume_s: float = 0.0) -> CallResult:
    """Runs a transactional call, retrying its retriable errors RETRIES times. A resumable call
    (resume_s > 0: commit_transaction, abort_transaction) is resumed for resume_s instead:
    librdkafka keeps it under way after a retriable timeout, expects it to be called again, and
    refuses every other transactional call meanwhile with _CONFLICT (rdkafka_txnmgr.c,
    rd_kafka_txn_curr_api_begin; rdkafka.h: "This call is resumable when a retriable timeout
    error is returned"), so aborting a commit is no way out. Still under way at the end: "hung"
    (a new producer takes over, as for a call that never returned; its init ends the
    transaction), or "unfinished" when stopping."""
    attempt = 0
    resume = Deadline.after(resume_s, txn.clock)
    while True:
        attempt += 1
        try:
            bounded(txn, what, fn)
            return "ok"
        except TransactionHungError as exc:
            if txn.stop.started:
                txn.latch.trip(exc)
                return "fatal"
            txn._hung = exc  # the caller takes over (`take_over`)
            return "hung"
        except KafkaException as exc:
            kind = kind_of(exc)
            more = attempt < RETRIES or not resume.expired()
            if kind == "retry" and more and not txn.stop.expired():
                log.warning("transactional call failed; retrying" if attempt < RETRIES else
                            "transactional call still under way; resuming it", call=what,
                            error=str(exc.args[0]))
                txn.sleep(min(1.0, 0.1 * attempt))
                continue
            if kind == "retry" and resume_s > 0:
                if txn.stop.started:
                    return "unfinished"
                txn._hung = TransactionHungError(
                    f"{what} still under way after {resume_s:.0f} s of resumed calls (the coordinator does not "
                    "complete it)", txn._calls.last)
                return "hung"
            if kind == "fatal":
                return fatal(txn, what, exc)
            log.warning("transactional call failed; aborting the transaction", call=what,
                        error=str(exc.args[0]))
            return "abort"


def fatal(txn: CallLoop, what: str, exc: KafkaException) -> Literal["fatal", "fenced"]:
    """A fatal error of a transactional call: "fenced" when a new producer is to take over after
    FENCE_SETTLE_S (see worker/ledger/exactly_once/transactions.py's docstring), else the latch trips."""
    err = exc.args[0]
    age = txn.clock() - txn.began_at if txn.state != "idle" else 0.0
    if not (isinstance(err, KafkaError) and err.code() in TAKEN_OVER_FATAL):
        txn.latch.trip(TransactionFencedError(
            f"{what} failed: {err} (this member was fenced: a newer one took over its transactional id, or "
            "its transaction outlived transaction_timeout_ms)"))
        return "fatal"
    fenced = err.code() == KafkaError._FENCED
    if txn.state == "idle" or (fenced and age < txn.transaction_timeout_s - TIMEOUT_CLOCK_SLACK_S):
        txn.latch.trip(TransactionFencedError(
            f"{what} failed: {err} (this member was fenced {age:.0f} s into its transaction, before "
            f"transaction_timeout_ms ({txn.transaction_timeout_s:.0f} s) let the broker time it out: another "
            "process took over its transactional id; is a second process running with the same member id?)"))
        return "fatal"
    now = txn.clock()
    txn._fenced_at = [t for t in txn._fenced_at if now - t < FENCED_WINDOW_S]
    if txn.replace_producer is None or txn.stop.started or len(txn._fenced_at) >= FENCED_TAKE_OVERS:
        times = f"{len(txn._fenced_at) + 1} times in {FENCED_WINDOW_S:.0f} s, each taken over"
        why = ("no new producer may take over" if txn.replace_producer is None else "stopping"
               if txn.stop.started else
               f"fenced {times}; a second process may be using the same member id (its transactional id), "
               "each fencing the other" if fenced else
               f"answered so {times}: the coordinator keeps refusing this member's transactions")
        cause = (f"fenced {age:.0f} s into its transaction, past transaction_timeout_ms: the broker may have "
                 "timed it out") if fenced else (f"{age:.0f} s into its transaction, the coordinator no longer "
                                                 "holds it in a state this call can end")
        txn.latch.trip(TransactionFencedError(f"{what} failed: {err} ({cause}; {why})"))
        return "fatal"
    txn._fence = Fence(what, str(err), age, now + FENCE_SETTLE_S)
    log.warning("producer fenced after its transaction outlived transaction_timeout_ms (the coordinator "
                "timed it out)" if fenced else "the coordinator no longer holds the transaction in a state "
                "this call can end (it timed it out, or moved during an outage)",
                call=what, error=str(err), transaction_age_s=round(age, 1), take_over_in_s=FENCE_SETTLE_S,
                then="a new producer takes over unless the group says this member is a zombie")
    return "fenced"
