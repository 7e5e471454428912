"""One deadline for stopping, shared by everything that stops.

The poll thread starts it at the first stop request (or a fatal error), with shutdown_timeout_s.
Every step of the shutdown (drain, flush, final commit or transaction, leaving the group) holds
the same object and asks `left()` each time it waits, instead of computing an end time once: so
a second signal, which `shorten`s it, shortens every wait already under way. `before(s)` is the
same deadline ending s earlier: what a step leaves for the steps after it; `limited(s)` is the
same deadline ending at most s from now: a wait bounded by both its own limit and the stop.

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
                 _reserve: float = 0.0, _cap: float | None = None) -> None:
        self._clock = clock
        self._end = _end if _end is not None else _End()
        self._reserve = _reserve
        # An end of this holder's own (`limited`), on the same clock; None: only the shared end.
        self._cap = _cap

    @classmethod
    def after(cls, seconds: float, clock: Callable[[], float] = time.monotonic) -> Deadline:
        """A deadline of its own, started now (on `clock`, the caller's injected one)."""
        d = cls(clock)
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
        """Seconds left (infinite before it starts, unless `limited`), never negative."""
        with self._end.lock:
            at = self._end.at
        if at is None and self._cap is None:
            return math.inf
        now = self._clock()
        left = math.inf if at is None else at - self._reserve - now
        if self._cap is not None:
            left = min(left, self._cap - now)
        return max(0.0, left)

    def expired(self) -> bool:
        return self.left() <= 0.0

    def before(self, reserve_s: float) -> Deadline:
        """The same deadline, ending reserve_s earlier (shortened with it); a negative reserve is a
        grace past it."""
        return Deadline(self._clock, _end=self._end, _reserve=self._reserve + reserve_s, _cap=self._cap)

    def limited(self, seconds: float) -> Deadline:
        """The same deadline, ending at most `seconds` from now: a wait with a limit of its own that
        a stop (started or shortened later) still cuts short. `started` stays the shared end's."""
        cap = self._clock() + max(0.0, seconds)
        return Deadline(self._clock, _end=self._end, _reserve=self._reserve,
                        _cap=cap if self._cap is None else min(self._cap, cap))

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


class Overrun:
    """The last resort that makes the deadline the process's: once it has started and passed by
    `grace_s`, calls `act` (which exits the process) whatever is still running, such as a librdkafka
    call inside a rebalance callback that no bound reaches. Every step that can be bounded ends by
    the deadline itself; this only catches the rest.

    Threads: `start` runs a daemon thread ("kwe-stop-watch") that owns nothing but the call to `act`;
    it re-reads the deadline (a second signal shortens it) and sleeps in steps of at most WATCH_S
    until the deadline has started, so a stop needs nothing from the signal handler but the start.
    """

    WATCH_S = 0.25

    def __init__(self, deadline: Deadline, grace_s: float, act: Callable[[], None]) -> None:
        self._past = deadline.before(-grace_s)
        self._act = act
        self._cancelled = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._watch, name="kwe-stop-watch", daemon=True).start()

    def cancel(self) -> None:
        """No act after all (an in-process run whose caller goes on)."""
        self._cancelled.set()

    def _watch(self) -> None:
        while (left := self._past.left()) > 0:
            if self._cancelled.wait(min(left, self.WATCH_S)):
                return
        if not self._cancelled.is_set():
            self._act()
