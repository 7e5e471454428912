"""`--max-rate`: a token bucket on consumption, so a backfill leaves the machine to the live group.

Tokens accrue at `rate` per second up to `burst`; each record consumed takes one. The poll loop
asks how many records it may take now (`allow`), consumes at most that many and hands back how
many it got (`take`). Over any window the records taken stay within rate x window + burst, so a
run of a few seconds already holds the rate within a few percent; the burst (a tenth of a second's
worth, at least one record) only smooths the poll loop's own granularity.

Threads: the poll thread only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

# Longest the poll loop sleeps for a token at once: it goes back to serving the group (and seeing a
# stop request) at least this often.
MAX_WAIT_S = 0.05


@dataclass
class TokenBucket:
    rate: float  # tokens (records) per second, > 0
    burst: float = 0.0  # the most tokens kept; 0: a tenth of a second's worth, at least 1
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    _tokens: float = field(init=False, default=0.0)
    _at: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"rate must be positive, got {self.rate!r}")
        self.burst = self.burst or max(1.0, self.rate / 10)
        self._at = self.clock()
        self._tokens = 1.0  # the first record goes at once

    def _refill(self) -> None:
        now = self.clock()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now

    def allow(self, want: int) -> int:
        """How many records (at most `want`) may be taken now; waits up to MAX_WAIT_S for the first
        token when there is none, and returns 0 if it still has none."""
        self._refill()
        if self._tokens < 1.0:
            self.sleep(min(MAX_WAIT_S, (1.0 - self._tokens) / self.rate))
            self._refill()
        return max(0, min(want, int(self._tokens)))

    def take(self, n: int) -> None:
        """`n` records were consumed (after `allow`)."""
        self._tokens -= n
