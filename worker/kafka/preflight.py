"""Startup checks: the topics exist and the worker may read and write where it reads and writes.

Run once before the model loads, so a missing topic or permission stops the worker within
seconds with a message naming the topic, instead of after a model load and a silent stall.
The messages are stable ("topic 'X' does not exist", "not authorised to read topic 'X'",
"not authorised to write topic 'X'", "cannot reach the Kafka cluster at B within N s").
It also checks that a dead-letter record of dead_letter_max_bytes fits the dead-letter
topic's max.message.bytes, where the broker lets the worker read that config.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Collection, Mapping
from typing import Any, Literal

from confluent_kafka import KafkaError, KafkaException, TopicCollection
from confluent_kafka.admin import AclOperation, AdminClient, ConfigResource, ResourceType

from worker.kafka.errors import PreflightError, fatal_reason
from worker.settings.kafka_overrides import RECORD_FRAMING_BYTES
from worker.settings.schema import Settings

Access = Literal["read", "write"]
_NEEDS: dict[Access, AclOperation] = {"read": AclOperation.READ, "write": AclOperation.WRITE}
_UNREACHABLE = {KafkaError._TIMED_OUT, KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN,
                KafkaError._RESOLVE, KafkaError._AUTHENTICATION, KafkaError._SSL}


def required_access(settings: Settings) -> dict[str, set[Access]]:
    """Each topic the worker uses, with what it does there."""
    needs: dict[str, set[Access]] = {}
    for topic, access in ((settings.input_topic, "read"), (settings.output_topic, "write"),
                          (settings.dead_letter_topic, "write")):
        needs.setdefault(topic, set()).add(access)  # type: ignore[arg-type]
    return needs


def missing_access(topic: str, needs: Collection[Access], operations: list[AclOperation] | None) -> list[str]:
    """What the broker's authorized operations for `topic` (KIP-430) do not allow.

    None or an empty list means the broker did not say (an old broker, or one that reports
    nothing without an authorizer): nothing can be concluded, so nothing is reported. A
    broker without an authorizer reports every operation.
    """
    if not operations:
        return []
    allowed = set(operations)
    return [f"not authorised to {access} topic '{topic}'" for access in sorted(needs)
            if _NEEDS[access] not in allowed and AclOperation.ALL not in allowed]


# One attempt's share of the budget. A cluster with a broker just gone (killed, not yet fenced:
# KRaft takes broker.session.timeout.ms, 9 s) still names it in its metadata, and librdkafka sends
# DescribeTopics to the "controller" a broker reports, which may be that broker: the request then
# waits for it until its timeout. A fresh client asks again and is given a live one.
ATTEMPT_S = 2.5


# A cluster that answered (DescribeCluster) but not yet the topic checks gets this many times the
# budget: the ~9 s in which a killed broker is still named as the controller overlap all of it.
ANSWERED_BUDGET_FACTOR = 3.0


class _Unreachable(Exception):
    """This attempt got no answer (timeout, transport error); another may. `answered`: the cluster
    itself answered this attempt (only a later request went unanswered)."""

    def __init__(self, answered: bool = False) -> None:
        super().__init__()
        self.answered = answered


def check_topics(admin_config: Mapping[str, Any], settings: Settings, timeout_s: float = 10.0) -> None:
    """Raises PreflightError naming every missing topic or permission; returns within ~timeout_s.

    Attempts of at most ATTEMPT_S, each with a fresh client, until one is answered or the time is
    up (ANSWERED_BUDGET_FACTOR times longer once the cluster has answered at all): one broker of
    several being down must not stop a member from starting.
    """
    bootstrap = str(admin_config.get("bootstrap.servers", settings.bootstrap_servers))
    started = time.monotonic()
    deadline = started + timeout_s
    last_error: list[KafkaError] = []

    def on_error(err: KafkaError) -> None:
        # The root cause (refused, TLS, SASL) that a timed-out request hides; "all brokers are
        # down" follows every one of them and says less.
        if err.code() != KafkaError._ALL_BROKERS_DOWN or not last_error:
            last_error[:] = [err]

    # Connection failures are reported in the message; librdkafka's own per-retry lines
    # (20 a second against a closed port) are noise here. An explicit log_level wins.
    config = {"log_level": 2, **admin_config, "error_cb": on_error}
    while True:
        try:
            admin = AdminClient(config)
        except (KafkaException, ValueError, TypeError) as exc:
            raise PreflightError([f"invalid Kafka client configuration: {exc}"]) from None
        attempt_end = min(deadline, time.monotonic() + ATTEMPT_S)
        try:
            problems = _attempt(admin, settings, attempt_end, last_error)
        except _Unreachable as exc:
            admin.poll(0)  # error_cb runs only when the client is polled
            if exc.answered:
                deadline = max(deadline, started + ANSWERED_BUDGET_FACTOR * timeout_s)
            if time.monotonic() < deadline - 0.2:
                continue
            why = f" (last error: {last_error[0].str()})" if last_error else ""
            raise PreflightError([f"cannot reach the Kafka cluster at {bootstrap} within {deadline - started:.3g} s{why}"]) \
                from None
        if problems:
            raise PreflightError(problems)
        return


def _attempt(admin: AdminClient, settings: Settings, deadline: float, last_error: list[KafkaError]) -> list[str]:
    """One round of the checks with one client, by `deadline`; raises _Unreachable without an answer."""

    def left() -> float:
        return max(0.1, deadline - time.monotonic())

    cluster = admin.describe_cluster(request_timeout=left())
    while not cluster.done() and time.monotonic() < deadline:
        admin.poll(0.1)  # serves error_cb: a wrong password or an untrusted certificate ends the wait at once
        reason = fatal_reason(last_error[0]) if last_error else None
        if reason is not None:
            raise PreflightError([reason])
    try:
        cluster.result(timeout=left() + 1)
    except (KafkaException, concurrent.futures.TimeoutError):
        raise _Unreachable() from None

    needs = required_access(settings)
    futures = admin.describe_topics(TopicCollection(list(needs)), include_authorized_operations=True,
                                    request_timeout=left())
    problems: list[str] = []
    for topic, access in needs.items():
        try:
            description = futures[topic].result(timeout=left() + 1)
        except concurrent.futures.TimeoutError:
            raise _Unreachable(answered=True) from None
        except KafkaException as exc:
            err: KafkaError = exc.args[0]
            if err.code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
                problems.append(f"topic '{topic}' does not exist")
            elif err.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED:
                # Not even DESCRIBE, which READ and WRITE both imply.
                problems += [f"not authorised to {a} topic '{topic}'" for a in sorted(access)]
            elif err.code() in _UNREACHABLE:
                raise _Unreachable(answered=True) from None
            else:
                problems.append(f"cannot describe topic '{topic}': {err.str()}")
            continue
        problems += missing_access(topic, access, description.authorized_operations)
    if not problems:
        problems += _dead_letter_size_problems(admin, settings, left())
    return problems


def _dead_letter_size_problems(admin: AdminClient, settings: Settings, timeout_s: float) -> list[str]:
    """A dead-letter record may be as large as dead_letter_max_bytes: the topic must take it."""
    topic = settings.dead_letter_topic
    resource = ConfigResource(ResourceType.TOPIC, topic)
    try:
        entries = admin.describe_configs([resource], request_timeout=timeout_s)[resource].result(timeout=timeout_s + 1)
        limit = int(entries["max.message.bytes"].value)
    except (KafkaException, concurrent.futures.TimeoutError, KeyError, TypeError, ValueError):
        return []  # not allowed to read the topic's config (DESCRIBE_CONFIGS), or no answer: cannot tell
    if settings.dead_letter_max_bytes + RECORD_FRAMING_BYTES > limit:
        return [f"dead_letter_max_bytes={settings.dead_letter_max_bytes} does not fit topic '{topic}' "
                f"(max.message.bytes={limit}); set it to at most {limit - RECORD_FRAMING_BYTES}"]
    return []
