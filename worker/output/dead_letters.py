"""Dead letters: a record that cannot be embedded goes to the dead-letter topic with its reason.

Called from the poll thread (rejected input) and the output thread (inference errors). The
record's offset is finished only when the broker acknowledged the dead letter, exactly like
an embedding, so a rejected record is never committed without a trace.
"""

from __future__ import annotations

import structlog
from confluent_kafka import Message

from worker.ledger.acks import Acknowledger
from worker.formats.headers import InputHeaders
from worker.formats.messages import Rejection
from worker.kafka.producer import RecordWriter
from worker.output.dead_letter_record import dead_letter_record

log = structlog.get_logger(__name__)


class DeadLetters:
    def __init__(self, topic: str, max_bytes: int, writer: RecordWriter, acks: Acknowledger) -> None:
        self._topic = topic
        self._max_bytes = max_bytes
        self._writer = writer
        self._acks = acks

    @property
    def topic(self) -> str:
        return self._topic

    def send(self, seq: int, msg: Message, headers: InputHeaders, rejection: Rejection) -> bool:
        """Produces the (size-bounded) dead letter of `msg`; False if it could not be queued."""
        ts_type, ts = msg.timestamp()
        record = dead_letter_record(rejection, topic=msg.topic(), partition=msg.partition(), offset=msg.offset(),
                                    timestamp_ms=ts if ts_type else None, key=msg.key(), value=msg.value(),
                                    headers=headers, max_bytes=self._max_bytes)
        log.debug("dead-lettering", reason=rejection.reason, topic=msg.topic(), partition=msg.partition(),
                  offset=msg.offset())
        return self._writer.write(seq, self._topic, record.key, record.value, record.headers,
                                  self._acks.dead_lettered(seq, rejection.reason))
