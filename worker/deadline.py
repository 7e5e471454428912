"""One deadline for stopping, shared by everything that stops.

The poll thread starts it at the first stop request (or a fatal error), with shutdown_timeout_s.
Every step of the shutdown (drain, flush, final commit or transaction, leaving the group) holds
the same object and asks `left()` each time it waits, instead of computing an end time once: so
a second signal, which `shorten`s it, shortens every wait already under way. `before(s)` is the
same deadline ending s earlier: what a step leaves for the steps after it.

Thread-safety: any thread may read it; `start`/`shorten` come from the poll thread and the
signal handler (which runs on the main thread, between bytecodes): one lock.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable


class _End:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.at: float | None = None


class Deadline:
    def __init__(self, clock: Callable[[], float] = time.monotonic, *, _end: _End | None = None,
                 _reserve: float = 0.0) -> None:
        self._clock = clock
        self._end = _end if _end is not None else _End()
        self._reserve = _reserve

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        """A deadline of its own, started now."""
        d = cls()
        d.start(seconds)
        return d

    def start(self, seconds: float) -> None:
        """Sets the deadline `seconds` from now, unless it is set already (the earlier stays)."""
        with self._end.lock:
            if self._end.at is None:
                self._end.at = self._clock() + max(0.0, seconds)

    def shorten(self, seconds: float) -> None:
        """At most `seconds` from now, for every holder (a second stop request)."""
        with self._end.lock:
            at = self._clock() + max(0.0, seconds)
            self._end.at = at if self._end.at is None else min(self._end.at, at)

    @property
    def started(self) -> bool:
        with self._end.lock:
            return self._end.at is not None

    def left(self) -> float:
        """Seconds left (infinite before it starts), never negative."""
        with self._end.lock:
            at = self._end.at
        if at is None:
            return math.inf
        return max(0.0, at - self._reserve - self._clock())

    def expired(self) -> bool:
        return self.left() <= 0.0

    def before(self, reserve_s: float) -> Deadline:
        """The same deadline, ending reserve_s earlier (shortened with it)."""
        return Deadline(self._clock, _end=self._end, _reserve=self._reserve + reserve_s)

    def capped(self, seconds: float) -> float:
        """min(seconds, left()): a wait bounded by both its own limit and the deadline."""
        return min(seconds, self.left())

    def wait(self, event: threading.Event, step_s: float = 0.05) -> bool:
        """Waits for `event` until the deadline (re-reading it, so a shortening applies)."""
        while not event.is_set():
            left = self.left()
            if left <= 0:
                return False
            event.wait(min(step_s, left))
        return True
