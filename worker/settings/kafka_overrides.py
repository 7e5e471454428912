"""The librdkafka keys and values `kafka_config` refuses, and why.

A key with a setting of its own, a key the worker sets itself, or a value that would break the
delivery guarantees is refused at start (`Settings` checks each kafka_config item with
`kafka_override_error`; `worker/kafka/client_config.py` checks the properties file the same way).
docs/settings.md lists these rules below the settings table (worker/settings/docs.py).
Plain data and pure functions: no settings, no clients.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

# librdkafka keys that --kafka-config may not set: each either has a setting of its own (one
# source of truth, no silent "which one won?"), is set by the worker itself, or is what
# at-least-once delivery rests on. Aliases are listed too (librdkafka reads both spellings).
_AUTO_COMMIT = "the worker commits offsets itself, only after the output is acknowledged"
_CALLBACK = "the worker sets this callback itself"
RESERVED_KAFKA_KEYS: dict[str, str] = {
    "bootstrap.servers": "use the bootstrap_servers setting",
    "metadata.broker.list": "use the bootstrap_servers setting",
    "group.id": "use the group_id setting",
    "enable.auto.commit": _AUTO_COMMIT,
    "auto.commit.enable": _AUTO_COMMIT,
    "enable.auto.offset.store": "the worker stores offsets itself, only after the output is acknowledged",
    "offset.store.method": "offsets are committed to the consumer group on the broker",
    "isolation.level": "the worker sets it: it reads committed input only (read_committed), and manages it "
                       "for exactly-once",
    "transactional.id": "the worker decides whether it writes in transactions; a transactional producer "
                        "used outside them fails every write",
    "group.protocol": "the worker's rebalance handling is built for the classic protocol with "
                      "cooperative-sticky assignment, not KIP-848's consumer protocol",
    "group.remote.assignor": "it only applies to group.protocol=consumer, which the worker does not use",
    "retries": "librdkafka retries until message.timeout.ms; a retry limit turns a broker restart into a "
               "failed write (raise or lower message.timeout.ms instead)",
    "message.send.max.retries": "librdkafka retries until message.timeout.ms; a retry limit turns a broker "
                                "restart into a failed write (raise or lower message.timeout.ms instead)",
    **{key: _CALLBACK for key in ("error_cb", "stats_cb", "throttle_cb", "on_delivery", "on_commit", "logger")},
}

# A write may fail for good only after message.timeout.ms. Below a minute, a routine broker
# failover fails writes: KRaft notices a dead broker after broker.session.timeout.ms (9 s),
# then elects leaders and spreads metadata, and a rolling restart moves leaders for tens of
# seconds; the worker would stop (or, before, re-produce) for an event that heals itself.
MIN_MESSAGE_TIMEOUT_MS = 60_000

# What a Kafka size limit (the producer's message.max.bytes, a topic's max.message.bytes) must
# hold besides one record's key, value and headers: the record batch header (61 bytes) and the
# record's varint lengths, rounded up.
RECORD_FRAMING_BYTES = 512


def librdkafka_int(value: str) -> int | None:
    """A librdkafka integer value, or None when it is not one."""
    try:
        return int(value.strip())
    except ValueError:
        return None


def _true(value: str) -> bool:
    return value.strip().lower() in ("true", "t", "1")  # librdkafka's spellings of a true boolean


def _acks_all(value: str) -> bool:
    return value.strip().lower() in ("all", "-1")


def _in_flight_ok(value: str) -> bool:
    n = librdkafka_int(value)
    return n is not None and 1 <= n <= 5


def _message_timeout_ok(value: str) -> bool:
    n = librdkafka_int(value)
    return n is not None and (n == 0 or n >= MIN_MESSAGE_TIMEOUT_MS)


def _cooperative(value: str) -> bool:
    return [part.strip() for part in value.split(",")] == ["cooperative-sticky"]


@dataclass(frozen=True)
class KafkaValueRule:
    """The values a librdkafka key may take in kafka_config, in words, and why."""

    check: Callable[[str], bool]
    allowed: str
    why: str


_ACKS = KafkaValueRule(_acks_all, "all (or -1)", "with fewer acknowledgements a written embedding can be lost "
                       "when a leader fails, after its input offset was committed")
_IN_FLIGHT = KafkaValueRule(_in_flight_ok, "1 to 5", "the idempotent producer keeps order and avoids duplicates "
                            "only up to 5 requests in flight per connection")
_TIMEOUT = KafkaValueRule(_message_timeout_ok, f"at least {MIN_MESSAGE_TIMEOUT_MS} (or 0, no limit)",
                          "a shorter timeout fails writes during a routine broker failover")

# librdkafka keys that --kafka-config may set only to the values that keep the guarantees.
# enable.gapless.guarantee is allowed either way: commit-after-write does not rest on the
# order of output writes (each one is acknowledged on its own), and true only makes more
# errors fatal, which the worker stops on.
KAFKA_VALUE_RULES: dict[str, KafkaValueRule] = {
    "enable.idempotence": KafkaValueRule(_true, "true", "without it a retried write after a broker error can "
                                         "duplicate or reorder output records"),
    "acks": _ACKS,
    "request.required.acks": _ACKS,
    "partition.assignment.strategy": KafkaValueRule(
        _cooperative, "cooperative-sticky", "an eager strategy (range, roundrobin) revokes every partition of "
        "every member at each rebalance, so in-flight work is dropped and redone"),
    "max.in.flight.requests.per.connection": _IN_FLIGHT,
    "max.in.flight": _IN_FLIGHT,
    "message.timeout.ms": _TIMEOUT,
    "delivery.timeout.ms": _TIMEOUT,
    "queuing.strategy": KafkaValueRule(lambda v: v.strip().lower() == "fifo", "fifo", "lifo reorders output records"),
}


def kafka_override_error(key: str, value: str) -> str | None:
    """Why `key=value` may not be passed to librdkafka, or None when it may."""
    if key in RESERVED_KAFKA_KEYS:
        return f"{key!r} cannot be overridden ({RESERVED_KAFKA_KEYS[key]})"
    rule = KAFKA_VALUE_RULES.get(key)
    if rule is not None and not rule.check(value):
        return f"{key}={value.strip()!r} is refused: it must be {rule.allowed} ({rule.why})"
    return None
