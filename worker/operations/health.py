"""Liveness: is this worker still making progress, or should it be restarted? Readiness: does it
hold partitions, or stand by in a group that has more members than partitions? And the shape of
the liveness and readiness checks that /healthz and /readyz (worker/operations/probes.py) call.

Read by the metrics server's request threads; everything it reads is owned elsewhere and read
atomically (the latch's event, threads' liveness, the committer's last-progress time, the last
rebalance callback).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from worker.latch import FatalLatch

# The readiness callable returns (ready, detail). The detail is either named checks
# ({"assigned": True, "backend_loaded": False, ...}, what Pipeline.ready() returns) or a
# plain reason string; either way /readyz shows it, so a failing probe says why.
ReadyCheck = Callable[[], tuple[bool, Mapping[str, bool] | str]]
# The liveness callable returns (alive, reason); /healthz answers 503 with the reason when not alive.
LiveCheck = Callable[[], tuple[bool, str]]
# How much longer than revoke_timeout_s an empty assignment must stand to count as a standby
# (worker/commands/run.py, standby_after_s): a heartbeat (1 s), a join and a sync, with room.
STANDBY_MARGIN_S = 5.0


def always_alive() -> tuple[bool, str]:
    """The liveness check of a worker that has none of its own (tests, the demo)."""
    return True, "ok"


@dataclass
class Liveness:
    latch: FatalLatch
    # Called at each probe: some threads (the bucketer's) only exist once the worker started.
    threads: Callable[[], Sequence[threading.Thread]]
    stalled_for: Callable[[], float]
    stall_timeout_s: float

    def __call__(self) -> tuple[bool, str]:
        error = self.latch.error
        if error is not None:
            return False, f"fatal error: {error}"
        dead = [t.name for t in self.threads() if t.ident is not None and not t.is_alive()]
        if dead:
            return False, f"worker thread(s) ended: {', '.join(dead)}"
        stalled = self.stalled_for()
        if self.stall_timeout_s > 0 and stalled > self.stall_timeout_s:
            return False, (f"stalled: work has waited {stalled:.0f} s for a commit "
                           f"(stall_timeout_s={self.stall_timeout_s:g})")
        return True, "ok"


@dataclass
class Readiness:
    """The worker's readiness: its own checks (`Pipeline.ready`: partitions assigned, no fatal
    error), where an empty assignment still counts as ready once the member stands by: the group
    has more members than the input topic has partitions (pods x processes > partitions).

    A member cannot count the group's members, but the cooperative-sticky assignor balances: once a
    rebalance has settled, every member holds within one partition of every other, so a member left
    with none means more members than partitions. Settled: the last rebalance callback was an
    assignment (empty or not) and nothing has changed for `settle_s`. The wait covers the
    cooperative protocol's two rounds: a joining member is first assigned nothing, and gets its
    partitions only once the others have revoked them (each waits up to revoke_timeout_s); it must
    not count as a standby in between.
    """

    checks: Callable[[], tuple[bool, Mapping[str, bool]]]
    last_rebalance: Callable[[], tuple[str, float] | None]  # (kind, monotonic time), Metrics'
    settle_s: float
    clock: Callable[[], float] = time.monotonic

    def __call__(self) -> tuple[bool, dict[str, bool]]:
        ready, checks = self.checks()
        detail = dict(checks)
        if detail.get("assigned", True):
            return ready, detail
        last = self.last_rebalance()
        detail["standby"] = (last is not None and last[0] == "assign"
                             and self.clock() - last[1] >= self.settle_s)
        others = all(ok for name, ok in detail.items() if name not in ("assigned", "standby"))
        return detail["standby"] and others, detail
