"""confluent-kafka's transactional producer, as far as the transaction loop can tell: a state
machine (ready -> in transaction -> ready), records visible only once their transaction commits,
errors raised as KafkaException carrying a KafkaError whose fatal(), retriable() and
txn_requires_abort() say what librdkafka would."""

from __future__ import annotations

from typing import Any

from confluent_kafka import KafkaError, KafkaException, TopicPartition

FENCED = KafkaError(KafkaError._FENCED, "Producer fenced by newer instance", fatal=True)
ABORTABLE = KafkaError(KafkaError._STATE, "Transaction error requires abort", txn_requires_abort=True)
RETRIABLE = KafkaError(KafkaError._TIMED_OUT, "Timed out", retriable=True)


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
        self.fenced = False

    def _enter(self, call: str) -> None:
        self.calls.append(call)
        if self.fenced:
            raise KafkaException(FENCED)
        queued = self.errors.get(call)
        if queued:
            err = queued.pop(0)
            if err.fatal():
                self.fenced = True
            raise KafkaException(err)

    def init_transactions(self, timeout: float) -> None:
        self._enter("init")
        self.state = "ready"

    def begin_transaction(self) -> None:
        assert self.state == "ready", f"begin in state {self.state}"
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
