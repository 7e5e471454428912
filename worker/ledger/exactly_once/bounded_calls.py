"""Bounded calls: a blocking librdkafka call run on a helper thread, waited for until a `Deadline`.

librdkafka's own timeout does not always hold: after a hard broker restart,
send_offsets_to_transaction blocked for minutes (measured), and when a coordinator's node dies
it can keep waiting on it long after the call's timeout (librdkafka issues 5456 and 5511). A call
that blocks the poll thread blocks the whole member, so the transaction loop
(worker/ledger/exactly_once/transactions.py) runs each transactional call here instead: past its limit the call
is reported hung (`TransactionHungError`) with the thread still blocked in it, which the take-over
(worker/ledger/exactly_once/take_over.py) hands on with the abandoned client.

The helper thread and the wait are the one bounded call of the worker (worker/kafka/bounded_calls.py,
`BoundedCall`, which the committer and the group member's close use too); what is the transaction
loop's own is here: the hang margin, the error that names the call, and a fresh helper for each
call, so that a call left hung in a client the take-over replaced never holds the next one.

Threads: `run` is called from the poll thread; the helper thread ("kwe-txn-call", a daemon: a
hung call must not keep the process alive) only runs the call (worker/kafka/bounded_calls.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from worker.deadline import Deadline
from worker.kafka.bounded_calls import BoundedCall
from worker.ledger.exactly_once.errors import TransactionHungError

# How much longer than its own timeout a call may block before it counts as hung.
HANG_MARGIN_S = 5.0


class BoundedCalls:
    """Runs calls on helper threads; remembers the last helper (a take-over after a resumed call
    that never completed hands it on as the thread still inside the old client)."""

    def __init__(self) -> None:
        self.last: threading.Thread | None = None

    def run(self, what: str, fn: Callable[[], None], limit: Deadline, stop: Deadline, limit_s: float) -> None:
        """Runs fn on a helper thread and waits until it returns or `limit` passes (re-read while
        waiting). Raises what fn raised, or TransactionHungError past the limit, saying whether the
        stop deadline (`stop`) or the call's own limit (limit_s, for the message) ended the wait."""
        call = BoundedCall("kwe-txn-call")
        answer = call.run(fn, limit)
        self.last = call.last
        if answer is None and stop.expired():
            raise TransactionHungError(f"{what} did not return before the shutdown deadline", self.last)
        if answer is None:
            raise TransactionHungError(f"{what} did not return within {limit_s:.0f} s (the transaction coordinator "
                                       "does not answer)", self.last)
        if answer.error is not None:
            raise answer.error
