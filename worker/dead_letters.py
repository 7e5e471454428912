"""Dead letters: a record that cannot be embedded goes to the dead-letter topic with its reason.

Called from the poll thread (rejected input) and the output thread (inference errors). The
record's offset is finished only when the broker acknowledged the dead letter, exactly like
an embedding, so a rejected record is never committed without a trace.
"""

from __future__ import annotations

import structlog
from confluent_kafka import Message

from worker.acks import Acknowledger
from worker.kafka.messages import Rejection, dead_letter
from worker.kafka.producer import OutputProducer

log = structlog.get_logger(__name__)

# The dead letter is keyed like its input, unless that key is itself absurdly large: the key
# is also kept (cut to the dead-letter size bound) inside the record.
MAX_KEY_BYTES = 1024


class DeadLetters:
    def __init__(self, topic: str, producer: OutputProducer, acks: Acknowledger) -> None:
        self._topic = topic
        self._producer = producer
        self._acks = acks

    def send(self, seq: int, msg: Message, rejection: Rejection) -> bool:
        ts_type, ts = msg.timestamp()
        try:
            headers = msg.headers()
        except Exception as exc:  # noqa: BLE001 - a header name that is not UTF-8 makes the client raise
            headers = None
            rejection = Rejection(rejection.reason, f"{rejection.detail}; headers dropped ({exc})")
        key = msg.key()
        value, out_headers = dead_letter(rejection, topic=msg.topic(), partition=msg.partition(),
                                         offset=msg.offset(), timestamp_ms=ts if ts_type else None, key=key,
                                         value=msg.value(), headers=headers)
        log.debug("dead-lettering", reason=rejection.reason, topic=msg.topic(), partition=msg.partition(),
                  offset=msg.offset())
        dlq_key = key if key is not None and len(key) <= MAX_KEY_BYTES else None
        return self._producer.produce(self._topic, dlq_key, value, out_headers,
                                      self._acks.dead_lettered(seq, rejection.reason))
