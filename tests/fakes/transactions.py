"""confluent-kafka's transactional producer, as far as the transaction loop can tell: a state
machine (ready -> in transaction -> ready), records visible only once their transaction commits,
errors raised as KafkaException carrying a KafkaError whose fatal(), retriable() and
txn_requires_abort() say what librdkafka would, and librdkafka's resumable calls: after a retriable
error of commit_transaction (or abort_transaction) the call stays under way in the background, only
that call may be made again (it resumes), and any other transactional call is refused with
_CONFLICT (rdkafka_txnmgr.c, rd_kafka_txn_curr_api_begin and rd_kafka_txn_curr_api_return)."""

from __future__ import annotations

from typing import Any

from confluent_kafka import KafkaError, KafkaException, TopicPartition

FENCED = KafkaError(KafkaError._FENCED, "Producer fenced by newer instance", fatal=True)
# What librdkafka raises when EndTxn is answered INVALID_TXN_STATE (rd_kafka_txn_handle_EndTxn: fatal).
INVALID_TXN_STATE = KafkaError(KafkaError.INVALID_TXN_STATE, "Failed to end transaction: Broker: Producer attempted "
                               "a transactional operation in an invalid state", fatal=True)
ABORTABLE = KafkaError(KafkaError._STATE, "Transaction error requires abort", txn_requires_abort=True)
RETRIABLE = KafkaError(KafkaError._TIMED_OUT, "Timed out", retriable=True)
# Resumable calls: a retriable error leaves the call under way in librdkafka.
RESUMABLE = ("commit", "abort")


class FakeTxnProducer:
    """librdkafka's transactional producer, as far as the loop can tell."""

    def __init__(self) -> None:
        self.state = "uninit"
        self.calls: list[str] = []
        self.open: list[str] = []  # records of the open transaction
        self.visible: list[str] = []  # records of committed transactions
        self.offsets: dict[tuple[str, int], int] = {}  # committed through transactions
        self.pending_offsets: dict[tuple[str, int], int] = {}
        self.errors: dict[str, list[KafkaError]] = {}
        # A fatal error, once raised, is raised by every later call (librdkafka's fatal state).
        self.fatal: KafkaError | None = None
        # The resumable call left under way by a retriable error (None: no call under way).
        self.resuming: str | None = None

    def _enter(self, call: str) -> None:
        self.calls.append(call)
        if self.fatal is not None:
            raise KafkaException(self.fatal)
        if self.resuming is not None and self.resuming != call:
            raise KafkaException(KafkaError(KafkaError._CONFLICT, f"Conflicting {self.resuming}_transaction API "
                                            "call is already in progress", retriable=True))
        queued = self.errors.get(call)
        if queued:
            err = queued.pop(0)
            if err.fatal():
                self.fatal = err
            elif err.retriable() and call in RESUMABLE:
                self.resuming = call
            raise KafkaException(err)
        self.resuming = None

    def init_transactions(self, timeout: float) -> None:
        self._enter("init")
        self.state = "ready"

    def begin_transaction(self) -> None:
        if self.state != "ready":  # rd_kafka_txn_require_state: e.g. an uninitialised producer
            raise KafkaException(KafkaError(KafkaError._STATE, f"Operation not valid in state {self.state}"))
        self._enter("begin")
        self.state = "in_txn"

    def produce(self, record: str) -> None:
        if self.state != "in_txn":
            raise KafkaException(KafkaError(KafkaError._STATE, "no transaction in progress"))
        self.open.append(record)

    def send_offsets_to_transaction(self, positions: list[TopicPartition], group_metadata: Any,
                                    timeout: float) -> None:
        assert self.state == "in_txn" and group_metadata == "group-metadata"
        self._enter("send_offsets")
        self.pending_offsets.update({(tp.topic, tp.partition): tp.offset for tp in positions})

    def commit_transaction(self, timeout: float) -> None:
        assert self.state == "in_txn"
        self._enter("commit")
        self.visible += self.open
        self.offsets.update(self.pending_offsets)
        self.open, self.pending_offsets, self.state = [], {}, "ready"

    def abort_transaction(self, timeout: float) -> None:
        self._enter("abort")
        self.open, self.pending_offsets, self.state = [], {}, "ready"


def interval_up(txn: Any) -> None:
    """One poll-loop turn of `txn` (a Transactions) as if its interval were up: the open transaction
    starts closing, and commits if nothing is in flight."""
    txn.began_at -= txn.interval_s
    txn.step()
