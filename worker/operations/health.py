"""Liveness: is this worker still making progress, or should it be restarted? And the shape of
the liveness and readiness checks that /healthz and /readyz (worker/operations/probes.py) call.

Read by the metrics server's request threads; everything it reads is owned elsewhere and read
atomically (the latch's event, threads' liveness, the committer's last-progress time).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from worker.latch import FatalLatch

# The readiness callable returns (ready, detail). The detail is either named checks
# ({"assigned": True, "backend_loaded": False, ...}, what Pipeline.ready() returns) or a
# plain reason string; either way /readyz shows it, so a failing probe says why.
ReadyCheck = Callable[[], tuple[bool, Mapping[str, bool] | str]]
# The liveness callable returns (alive, reason); /healthz answers 503 with the reason when not alive.
LiveCheck = Callable[[], tuple[bool, str]]


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
