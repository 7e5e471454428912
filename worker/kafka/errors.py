"""Which Kafka client errors must stop the worker, and the one message that says why.

librdkafka reports most misconfigurations as ordinary, non-fatal errors and retries them forever:
a wrong password or unknown user (`_AUTHENTICATION`, every ~0.3 s), a broker certificate the CA
does not vouch for (`_SSL`, or `_TRANSPORT` "certificate verify failed"), a missing ACL
(`TOPIC_AUTHORIZATION_FAILED` on a fetch or a delivery, `GROUP_AUTHORIZATION_FAILED`,
`CLUSTER_AUTHORIZATION_FAILED` for an idempotent producer without any Write ACL). None of them
fixes itself, so the worker stops with one clear message instead of logging the retries forever.

When a connection-level failure (authentication, TLS) is fatal (`FailurePolicy`):
- before the first successful connection (start-up): at the first report. Credentials and
  certificates do not change under a running process; exiting at once is what an operator sees
  (CrashLoopBackOff, a non-zero exit) and what Kubernetes backs off from.
- after it: only once the failures have lasted `later_grace_s` (60 s) and come `later_min_reports`
  (3) times without a success in between, because rotating a SCRAM credential or a broker
  certificate across a cluster can fail some connections for a short while.
Authorisation failures (ACLs) are fatal at once, always: an ACL is changed on purpose.

Also the errors that stop the worker at start (`KafkaSetupError`, `PreflightError`).

Pure logic, no Kafka I/O: `fatal_reason` maps one KafkaError to a message or None (transient),
and is unit-tested with real KafkaError objects.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from typing import Literal

from confluent_kafka import KafkaError

from worker.errors import WorkerError

Op = Literal["read", "write", "connect"]

_AUTH_CODES = frozenset({KafkaError._AUTHENTICATION, KafkaError.SASL_AUTHENTICATION_FAILED,
                         KafkaError.UNSUPPORTED_SASL_MECHANISM, KafkaError.ILLEGAL_SASL_STATE})
_CERT_FAILURE = re.compile(r"certificate verify failed|could not be verified|self[- ]signed certificate|"
                           r"unable to get (local )?issuer certificate|hostname mismatch|IP address mismatch|"
                           r"certificate has expired", re.IGNORECASE)


class KafkaSetupError(WorkerError):
    """The cluster is not set up for this worker (a topic or a permission is missing, or the
    cluster cannot be reached); retrying does not help, so the worker stops with this message."""


class PreflightError(KafkaSetupError):
    """A startup check failed; `problems` lists each finding, the message joins them with '; '."""

    def __init__(self, problems: list[str] | tuple[str, ...]) -> None:
        self.problems = tuple(problems)
        super().__init__("; ".join(self.problems))


def _kind(err: KafkaError) -> Literal["auth", "tls", "acl", "other"] | None:
    code = err.code()
    if code in _AUTH_CODES:
        return "auth"
    if code in (KafkaError._SSL, KafkaError._TRANSPORT) and _CERT_FAILURE.search(err.str() or ""):
        return "tls"
    if code in (KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.GROUP_AUTHORIZATION_FAILED,
                KafkaError.CLUSTER_AUTHORIZATION_FAILED, KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED):
        return "acl"
    if err.fatal():
        return "other"
    return None


def fatal_reason(err: KafkaError, *, topic: str | None = None, op: Op = "connect",
                 group: str | None = None) -> str | None:
    """The message for an error that must stop the worker; None for a transient one.

    `topic` and `op` say what the client was doing (a consume error on the input topic is a
    read, a failed delivery a write); `group` names the consumer group, if any.
    """
    kind = _kind(err)
    if kind is None:
        return None
    text = err.str()
    code = err.code()
    if kind == "auth":
        return (f"authentication failed: {text} (check sasl.username, sasl.password and sasl.mechanism; "
                "a wrong password and an unknown user look the same)")
    if kind == "tls":
        return (f"TLS verification failed: {text} (the broker's certificate is not signed by the CA in "
                "ssl.ca.location, or does not name the host)")
    if code == KafkaError.TOPIC_AUTHORIZATION_FAILED:
        action = op if op in ("read", "write") else "use"
        return f"not authorised to {action} topic '{topic or '?'}' (a missing ACL: {text})"
    if code == KafkaError.GROUP_AUTHORIZATION_FAILED:
        return f"not authorised to use consumer group '{group or '?'}' (a missing Read ACL on the group: {text})"
    if code == KafkaError.CLUSTER_AUTHORIZATION_FAILED:
        if op == "write" and topic:
            return (f"not authorised to write topic '{topic}' (the idempotent producer was refused "
                    f"IdempotentWrite on the cluster, which a Write ACL on any topic grants: {text})")
        return f"not authorised on the cluster (a missing ACL: {text})"
    if code == KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED:
        return f"not authorised to use the transactional id (a missing ACL: {text})"
    return f"fatal Kafka client error: {text}"


class FailurePolicy:
    """Applies the start-up vs running rule above to the errors of one worker's clients.

    Called from the poll thread (consumer errors, assignments) and the delivery thread (producer
    errors, deliveries); one lock guards the little state there is.
    """

    def __init__(self, *, later_grace_s: float = 60.0, later_min_reports: int = 3,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._grace = later_grace_s
        self._min_reports = later_min_reports
        self._clock = clock
        self._lock = threading.Lock()
        self._connected = False
        self._streak_start: float | None = None
        self._streak_reports = 0

    def connected(self) -> None:
        """A request succeeded (assignment, delivery, commit): the credentials and TLS work."""
        with self._lock:
            self._connected = True
            self._streak_start = None
            self._streak_reports = 0

    def decide(self, err: KafkaError, *, topic: str | None = None, op: Op = "connect",
               group: str | None = None) -> str | None:
        """The message if this error must stop the worker now, else None."""
        reason = fatal_reason(err, topic=topic, op=op, group=group)
        if reason is None or _kind(err) not in ("auth", "tls"):
            return reason
        with self._lock:
            if not self._connected:
                return reason
            now = self._clock()
            if self._streak_start is None:
                self._streak_start = now
            self._streak_reports += 1
            if now - self._streak_start >= self._grace and self._streak_reports >= self._min_reports:
                return reason
        return None

    def client_error(self, err: KafkaError, fatal: WorkerError, *, topic: str | None = None, op: Op = "connect",
                     group: str | None = None) -> WorkerError | None:
        """What a client's error callback does with `err`: the error the worker stops with (the
        rule above refused it, or librdkafka calls it fatal: then `fatal`), or None for a
        transient error, which the caller only logs. One decision for every client's error_cb."""
        reason = self.decide(err, topic=topic, op=op, group=group)
        if reason is not None:
            return KafkaSetupError(reason)
        if err.fatal():
            return fatal
        return None
