"""SIGTERM/SIGINT for `keyword-embedder run`, installed before anything heavy is imported.

As PID 1 of a container, a signal with no handler is dropped by the kernel: a SIGTERM that came
while Python was still importing numpy, ONNX Runtime and confluent-kafka (the first ~0.3 s) was
ignored and the worker went on. So `worker.cli` installs this first, with the standard library
only, before the command's module is imported.

During start-up a signal unwinds it (`StopDuringStartup`, a BaseException so that no `except
Exception` swallows it); when it lands inside a C call (librdkafka's start-up check) it may
surface as another exception (a SystemError from a callback): `stopped_during_startup` tells
the caller that whatever unwound start-up, a stop was asked for. Once the worker runs, the
first signal and each later one call `on_stop`.

A supervisor starts its processes with both signals blocked (worker/operations/supervisor.py):
a stop sent before these handlers exist waits, pending, and lands on them once they are in,
rather than killing the process by the default action (143).
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from types import FrameType


class StopDuringStartup(BaseException):
    """A stop signal arrived before the worker ran: unwind start-up and exit cleanly."""


class StopSignals:
    def __init__(self) -> None:
        self.on_stop: Callable[[], None] | None = None
        self.requested: str | None = None
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._handle)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.on_stop is None:
            first = self.requested is None
            self.requested = name
            if first:
                raise StopDuringStartup(name)
            return  # already unwinding
        if "structlog" in sys.modules:
            sys.modules["structlog"].get_logger("worker.run").info("stop requested", signal=name)
        self.on_stop()

    def stopped_during_startup(self) -> str | None:
        """The signal's name when a stop came before the worker ran."""
        return self.requested if self.on_stop is None else None


def startup_stopped_message(signal_name: str) -> str:
    return f"keyword-embedder run: stopped by {signal_name} during start-up"
