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
