"""The exactly-once errors that stop a member, shared by the transaction loop
(worker/ledger/exactly_once/transactions.py), its bounded calls and its producer take-over."""

from __future__ import annotations

import threading

from confluent_kafka import KafkaError

from worker.errors import WorkerError

# Fatal errors of a transactional call that the coordinator can explain without a second process
# holding this member's transactional id, so a new producer may take over
# (worker/ledger/exactly_once/transactional_calls.py `fatal` decides):
# - _FENCED: PRODUCER_FENCED after the coordinator timed the transaction out and bumped the epoch,
#   which only explains a transaction at least transaction_timeout_ms old (younger: a zombie);
# - INVALID_TXN_STATE: the coordinator holds a state our call cannot end (EndTxn on a transaction it
#   completed or no longer has: it timed it out, or a coordinator that took over after an outage
#   holds another state; Kafka's TransactionCoordinator.endTransaction). A second process would
#   be answered PRODUCER_FENCED instead, so this one is taken over at any age. librdkafka raises it
#   as fatal (rdkafka_txnmgr.c, rd_kafka_txn_handle_EndTxn); seen in CI with the group's
#   coordinator node frozen (tests/system/test_cluster_kafka.py).
TAKEN_OVER_FATAL = frozenset({KafkaError._FENCED, KafkaError.INVALID_TXN_STATE})


class TransactionFencedError(WorkerError):
    """A newer member took over this member's transactional id, or its transaction timed out."""


class TransactionError(WorkerError):
    """A transaction could neither be completed nor aborted cleanly, and this member was not
    fenced: it stops, and aborts the open transaction on the way out (best effort), so
    read_committed readers are not held back until transaction_timeout_ms."""


class TransactionHungError(WorkerError):
    """A transactional call did not return in time; `call` is the thread still blocked in it."""

    def __init__(self, message: str, call: threading.Thread | None = None) -> None:
        super().__init__(message)
        self.call = call
