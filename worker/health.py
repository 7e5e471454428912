"""Liveness: is this worker still making progress, or should it be restarted?

Read by the metrics server's request threads; everything it reads is owned elsewhere and read
atomically (the latch's event, threads' liveness, the committer's last-progress time).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from worker.latch import FatalLatch


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
