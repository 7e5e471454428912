"""A blocking client call on a helper thread, waited for until a `Deadline`.

librdkafka's own timeouts do not always hold: a synchronous commit waits without a limit for its
answer, and a coordinator that parks a JoinGroup answers nothing else on that connection until the
rebalance completes (up to a session, 30 s, when a member left without leaving); `close()` waits
for the leave and the final rebalance callbacks. A call that blocks the poll thread blocks the
whole member and its shutdown deadline, so such a call runs here: the caller waits until the
deadline (re-read while waiting, so a second signal shortens it) and, past it, goes on without the
answer. The call stays on its thread inside the client; nothing is committed past what the call
itself was given, so abandoning it loses nothing.

At most one call of a `BoundedCall` runs at a time: a call that is still blocked is waited for
(within the same deadline) before the next starts, and never doubled, so an outage does not leave a
thread per try blocked in librdkafka.

Threads: `run` and `busy` are called from one owner thread (the poll thread). The helper thread (a
daemon: a call that never returns must not keep the process alive) only runs the call and hands
its result or exception back through a list, read after the helper ended, or never if it hangs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from worker.deadline import Deadline

T = TypeVar("T")
# How often the waiting thread re-reads the deadline (a second signal shortens it).
POLL_S = 0.05


@dataclass(frozen=True)
class Answer(Generic[T]):
    """What a call that returned in time gave: its value, or the exception it raised."""

    value: T | None = None
    error: Exception | None = None


class BoundedCall:
    """Runs one call at a time on a helper thread named `name`; `last` is that thread."""

    def __init__(self, name: str) -> None:
        self._name = name
        self.last: threading.Thread | None = None

    @property
    def busy(self) -> bool:
        """A call abandoned at its deadline is still blocked in the client."""
        return self.last is not None and self.last.is_alive()

    def run(self, fn: Callable[[], T], deadline: Deadline) -> Answer[T] | None:
        """fn()'s answer, or None when it did not return by the deadline (nor, when the previous
        call is still blocked, did that one: then fn is not started at all)."""
        if self.busy and not self._wait(deadline):
            return None
        answer: list[Answer[T]] = []

        def call() -> None:
            try:
                answer.append(Answer(value=fn()))
            except Exception as exc:  # noqa: BLE001 - handed to the caller's thread
                answer.append(Answer(error=exc))

        self.last = threading.Thread(target=call, name=self._name, daemon=True)
        self.last.start()
        self._wait(deadline)
        return answer[0] if answer else None

    def _wait(self, deadline: Deadline) -> bool:
        """Waits for the current call until the deadline; True once it ended."""
        helper = self.last
        while helper is not None and helper.is_alive():
            left = deadline.left()
            if left <= 0:
                return False
            helper.join(min(POLL_S, left))
        return True
