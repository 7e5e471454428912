"""The fatal latch: the first fatal error any thread reports is the one the worker stops with.

Every thread (poll, former, dispatchers, output, delivery, rebalance callbacks) reports fatal
errors here and nowhere else; the poll thread sees the latch set, stops consuming, commits
nothing past the failure and exits non-zero with the first error's message. Later errors are
usually consequences of the first, so they are logged but do not replace it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import structlog

from worker.core.os_threads import block_stop_signals, name_current_thread
from worker.errors import ThreadDiedError, WorkerError

log = structlog.get_logger(__name__)


class FatalLatch:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._error: WorkerError | None = None
        self._set = threading.Event()

    def trip(self, error: WorkerError) -> bool:
        """Records `error` unless one is recorded already; True if this one won."""
        with self._lock:
            first = self._error is None
            if first:
                self._error = error
        if first:
            self._set.set()
            log.error("fatal error; the worker stops", error=str(error), kind=type(error).__name__)
        else:
            log.warning("another fatal error after the first", error=str(error))
        return first

    @property
    def error(self) -> WorkerError | None:
        with self._lock:
            return self._error

    def is_set(self) -> bool:
        return self._set.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._set.wait(timeout)


def guarded(latch: FatalLatch, name: str, body: Callable[..., Any]) -> Callable[..., None]:
    """A thread body that reports its exception to the latch instead of dying silently, and runs
    under `name` at the OS level too (top -H, py-spy), with SIGTERM and SIGINT left to the main
    thread (worker/core/os_threads.py)."""

    def run(*args: Any, **kwargs: Any) -> None:
        name_current_thread(name)
        block_stop_signals()
        try:
            body(*args, **kwargs)
        except WorkerError as exc:
            latch.trip(exc)
        except BaseException as exc:  # noqa: BLE001 - a dead thread must stop the worker, not stall it
            latch.trip(ThreadDiedError(f"thread {name} failed: {exc!r}"))

    return run
