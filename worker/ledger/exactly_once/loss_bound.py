"""How old a transaction may be when its partitions are lost and still be aborted, and the session
and transaction timeout pair that leaves an outage past the session room for that abort.

The bound (`abortable_after_loss_s`): an abort sent after partitions are lost (worker/ledger/exactly_once/
transactions.py `lost`) must reach the coordinator before the broker's transaction timeout, or it
bumps the producer epoch of a transaction the broker already timed out (KIP-588) and fences the
successor with the same transactional id. So the transaction may be at most transaction_timeout_ms
less the abort's bound (the call's timeout, HANG_MARGIN_S, and TIMEOUT_CLOCK_SLACK_S for a
coordinator clock ahead of ours) old; at least half the timeout, the rule for timeouts too short for
that bound. Older: the member stops instead (exit 1), its successor or the broker aborts.

The pair (`check_session`): an outage that outlives the session loses the partitions about a session
after the last heartbeat, with a transaction up to a session, an interval and LOSS_NOTICE_S old. If
that is past the bound, every such outage stops the member instead of aborting and going on (with a
30 s session and the bound at half of 60 s it did: CI, 2026-12-05). The bound follows from the
effective session.timeout.ms (the worker's SESSION_TIMEOUT_MS, or --kafka-config /
kafka_config_file) and transaction_timeout_ms:
- a session raised above the worker's own past what the transaction timeout allows is refused at
  start (`SessionTooLongError`, with the numbers and what would fit): nothing asks for it, and
  librdkafka's and Kafka's 45 s default is what an operator is likely to copy;
- a transaction timeout lowered below what the worker's own session needs is the trade docs/delivery.md
  states (a shorter stall of read_committed readers behind a dead member, for a stop after such an
  outage): allowed, and said at start (`check_session` returns the warning).

Plain numbers and pure functions; no clients.
"""

from __future__ import annotations

import math
from typing import Any

from worker.ledger.exactly_once import bounded_calls
from worker.ledger.exactly_once.transactional_calls import TIMEOUT_CLOCK_SLACK_S
from worker.kafka.client_config import SESSION_TIMEOUT_MS, client_config
from worker.settings.kafka_overrides import librdkafka_int
from worker.settings.schema import Settings, SettingsError

# A transactional call's own timeout (Transactions.timeout_s).
CALL_TIMEOUT_S = 10.0
# From the session's end to the abort being sent: the heartbeat that finds the session over
# (HEARTBEAT_INTERVAL_MS, 1 s), the consume that serves the lost callback, the step that aborts.
LOSS_NOTICE_S = 5.0


class SessionTooLongError(SettingsError):
    """session.timeout.ms leaves an outage past the session no room to abort the open transaction."""


def abortable_after_loss_s(transaction_timeout_s: float, call_timeout_s: float = CALL_TIMEOUT_S) -> float:
    """How old a transaction may be when its partitions are lost and its abort still be sent."""
    call_bound_s = call_timeout_s + bounded_calls.HANG_MARGIN_S + TIMEOUT_CLOCK_SLACK_S
    return max(transaction_timeout_s / 2, transaction_timeout_s - call_bound_s)


def oldest_at_loss_s(session_s: float, interval_s: float) -> float:
    """The oldest a transaction is when an outage just past the session loses the partitions."""
    return session_s + interval_s + LOSS_NOTICE_S


def effective_session_ms(settings: Settings) -> int | None:
    """The consumer's session.timeout.ms: the worker's, or the --kafka-config / kafka_config_file
    override (None for a value librdkafka will refuse anyway)."""
    raw: Any = client_config(settings).get("session.timeout.ms", SESSION_TIMEOUT_MS)
    return raw if isinstance(raw, int) else librdkafka_int(str(raw))


def check_session(settings: Settings, session_ms: int | None = None) -> str | None:
    """Exactly-once's session and transaction timeout, checked at start (see the module docstring):
    raises SessionTooLongError for a raised session that leaves no room; returns a warning for a
    lowered transaction timeout that leaves none (None: the pair fits, or at-least-once)."""
    if settings.processing_guarantee != "exactly-once":
        return None
    timeout_ms, interval_ms = settings.transaction_timeout_ms, settings.transaction_interval_ms
    bound_s = abortable_after_loss_s(timeout_ms / 1000)
    session_ms = effective_session_ms(settings) if session_ms is None else session_ms
    if session_ms is None:
        return None
    oldest_s = oldest_at_loss_s(session_ms / 1000, interval_ms / 1000)
    if oldest_s <= bound_s:
        return None
    # The longest session, and the shortest transaction timeout, that fit (whole milliseconds).
    fits_session_ms = math.floor((bound_s - interval_ms / 1000 - LOSS_NOTICE_S) * 1000)
    call_bound_s = CALL_TIMEOUT_S + bounded_calls.HANG_MARGIN_S + TIMEOUT_CLOCK_SLACK_S
    fits_timeout_ms = math.ceil(min(oldest_s + call_bound_s, 2 * oldest_s) * 1000)
    why = (f"session.timeout.ms {session_ms} and transaction_timeout_ms {timeout_ms} "
           f"(transaction_interval_ms {interval_ms}): partitions lost to an outage just past the session come "
           f"with a transaction up to {oldest_s:g} s old, and one older than {bound_s:g} s cannot be aborted "
           "before the broker's own timeout, so every such outage would stop the member")
    if session_ms > SESSION_TIMEOUT_MS:
        fits = (f"session.timeout.ms at most {fits_session_ms}" if fits_session_ms >= SESSION_TIMEOUT_MS else
                f"session.timeout.ms at most {SESSION_TIMEOUT_MS} (the worker's own)")
        raise SessionTooLongError(f"{why}; keep {fits}, or raise transaction_timeout_ms to at least "
                                  f"{fits_timeout_ms} (docs/delivery.md, Lost partitions)")
    return f"{why} (transaction_timeout_ms {fits_timeout_ms} or more would abort and go on)"
