"""Open-loop load: when each keyword is sent, decided up front and never by the receiver.

A closed-loop load (send the next batch when the last one is answered) slows down exactly when
the system under test lags, and so hides the queueing that latency is about. Here the send
times are a fixed schedule (Poisson or evenly spaced at `rate` per second); a sender that falls
behind it sends at once to catch up, and reports how far behind it fell, so a starved load
generator shows up in its own report instead of in the latency numbers.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

Spacing = Literal["poisson", "fixed"]
SPACINGS: tuple[Spacing, ...] = ("poisson", "fixed")


def arrivals(rate: float, duration_s: float, spacing: Spacing = "poisson", *, seed: int = 0) -> Iterator[float]:
    """Send times in seconds from the start, in [0, duration_s), at `rate` per second on average."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0 keywords/s, got {rate}")
    if duration_s <= 0:
        raise ValueError(f"duration must be > 0 s, got {duration_s}")
    if spacing not in SPACINGS:
        raise ValueError(f"spacing must be one of {', '.join(SPACINGS)}, got {spacing!r}")
    rng = random.Random(seed)
    t = 0.0 if spacing == "fixed" else rng.expovariate(rate)
    i = 0
    while t < duration_s:
        yield t
        i += 1
        t = i / rate if spacing == "fixed" else t + rng.expovariate(rate)


def cycled(rows: Iterable[tuple[str, str]]) -> Iterator[tuple[str, str]]:
    """The rows in order, then again and again; from the second pass on each ID gets a `~pass`
    suffix, so that every record of a long run has its own ID (outputs are matched by ID)."""
    first = list(rows)
    if not first:
        return
    yield from first
    rnd = 1
    while True:
        for qid, text in first:
            yield f"{qid}~{rnd}", text
        rnd += 1


@dataclass
class Lateness:
    """How far the sender fell behind its schedule (seconds); a healthy generator stays near 0."""

    max_s: float = 0.0
    total_s: float = 0.0
    n: int = 0

    def add(self, late_s: float) -> None:
        late_s = max(0.0, late_s)
        self.max_s = max(self.max_s, late_s)
        self.total_s += late_s
        self.n += 1

    @property
    def mean_s(self) -> float:
        return self.total_s / self.n if self.n else 0.0
