"""Running a test's step on a thread of its own, for what is per thread: a CUDA context current on
the thread that made it (the fake pycuda), an alternate signal stack (worker/core/os_threads.py)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def run_in_thread(fn: Callable[[], Any], timeout_s: float = 30.0) -> Any:
    """fn()'s result, run on a new thread; what it raised is raised here, on the test's thread."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test thread
            box["error"] = exc

    t = threading.Thread(target=target)
    t.start()
    t.join(timeout_s)
    if "error" in box:
        raise box["error"]
    return box.get("value")
