"""Failed writes of the open transaction: the one piece of the exactly-once loop that another
thread touches.

The exactly-once producer (worker/ledger/exactly_once/producer.py) reports a failed write (a
delivery error, or a produce refused once librdkafka made the transaction abortable) from the
thread that saw it; the transaction loop (worker/ledger/exactly_once/transactions.py) takes it on the poll
thread, aborts and rewinds, and waits WRITE_RETRY_BACKOFF_S, doubled each time, before intake
resumes; the WRITE_FAILURES-th failed transaction in a row stops the member.

Threads: `report` from any thread (the output or a delivery thread); everything else on the poll
thread. The reported reason sits behind one lock; the counters are the poll thread's alone.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

# Transactions failed by a write, in a row, before the member stops; the wait before the first retry.
WRITE_FAILURES = 5
WRITE_RETRY_BACKOFF_S = 0.5


@dataclass
class WriteFailures:
    in_row: int = 0  # transactions failed by a write since the last commit
    resume_at: float = 0.0  # when intake may resume (the loop's clock)
    _reason: str | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def report(self, reason: str) -> None:
        """Any thread: a write of the open transaction failed (the first reason is kept)."""
        with self._lock:
            if self._reason is None:
                self._reason = reason

    def pending(self) -> bool:
        with self._lock:
            return self._reason is not None

    def take(self) -> str | None:
        """The reported failure, if any, cleared."""
        with self._lock:
            reason, self._reason = self._reason, None
        return reason

    def count(self) -> bool:
        """One more transaction failed by a write: False when that makes WRITE_FAILURES in a row."""
        self.in_row += 1
        return self.in_row < WRITE_FAILURES

    def back_off(self, now: float) -> None:
        """After the abort: intake waits before the retry, twice as long as after the previous one."""
        self.resume_at = now + WRITE_RETRY_BACKOFF_S * 2 ** (self.in_row - 1)

    def committed(self) -> None:
        self.in_row = 0
