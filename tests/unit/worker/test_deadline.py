"""The one shutdown deadline: shared, reserves, and a second signal shortening every holder."""

from __future__ import annotations

import math
import threading

from worker.deadline import Deadline


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_deadline_is_infinite_until_started_and_keeps_the_first_start() -> None:
    clock = Clock()
    d = Deadline(clock)
    assert d.left() == math.inf and not d.started
    d.start(25.0)
    d.start(60.0)  # a fatal error after a stop request does not extend it
    clock.now += 5.0
    assert d.left() == 20.0 and d.started


def test_reserves_and_a_shortening_apply_to_every_holder() -> None:
    clock = Clock()
    d = Deadline(clock)
    drain, leave = d.before(6.0), d.before(3.0)
    d.start(25.0)
    assert (drain.left(), leave.left(), d.left()) == (19.0, 22.0, 25.0)
    d.shorten(2.0)  # the second signal
    assert (drain.left(), leave.left(), d.left()) == (0.0, 0.0, 2.0)
    assert drain.expired() and not d.expired()
    d.shorten(10.0)  # never lengthened
    assert d.left() == 2.0
    assert d.capped(5.0) == 2.0


def test_wait_rereads_the_deadline() -> None:
    d = Deadline()
    d.start(30.0)
    event = threading.Event()
    threading.Timer(0.05, d.shorten, args=(0.0,)).start()
    assert not d.wait(event)  # returns once shortened, not after 30 s
    event.set()
    assert d.wait(event)


def test_a_limited_deadline_ends_at_its_own_limit_or_the_shared_end_whichever_is_first() -> None:
    """The waits of the transaction loop: a limit of their own that a later stop still cuts short."""
    clock = Clock()
    stop = Deadline(clock)
    wait = stop.limited(10.0)
    assert wait.left() == 10.0 and not wait.started  # a limit alone is no stop
    clock.now += 4.0
    assert wait.left() == 6.0
    stop.start(2.0)  # a stop after the wait began shortens it
    assert wait.left() == 2.0 and wait.started
    assert stop.before(-1.0).limited(10.0).left() == 3.0  # a grace past the stop


def test_after_runs_on_the_clock_it_is_given() -> None:
    clock = Clock()
    d = Deadline.after(5.0, clock)
    clock.now += 5.0
    assert d.expired()
