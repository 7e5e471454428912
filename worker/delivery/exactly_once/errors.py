"""The exactly-once errors that stop a member, shared by the transaction loop
(worker/delivery/exactly_once/transactions.py), its bounded calls and its producer take-over."""

from __future__ import annotations

import threading

from worker.errors import WorkerError


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
