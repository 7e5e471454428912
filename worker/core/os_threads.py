"""The worker's threads at the OS level: their names, and the CPU the interpreter's threads run on.

Names: the worker's threads carry theirs at the OS level too, so `top -H`, `ps -L`, py-spy, perf
and /proc/<pid>/task/*/comm tell kwe-output, kwe-delivery and kwe-bucket-former apart beside
librdkafka's rdk:* threads instead of showing each as the process's name (Python does this itself
only from 3.14). The main thread, which polls the consumer, keeps the process's name: renaming it
would rename the process for `ps`, `top` and `pkill`. Linux only (prctl(PR_SET_NAME), 15 bytes);
elsewhere threads keep the process's name and nothing else changes. Holding needs
sched_setaffinity (Linux): elsewhere it is refused (OSError), which the worker logs and runs on.

One CPU for the interpreter (`interpreter_cpu`): the interpreter lock runs one of the worker's
Python threads at a time, so spreading them over cores buys no parallelism; it makes the lock and
the records it guards cross between caches at every hand-over. Held on one CPU (the poll thread
and every kwe-* thread, `hold_interpreter_threads`, called on the poll thread), they spent 25.1 us
of CPU a keyword through the broker against 32.1, paired, with the model taken out, on 2 shared
cores (docs/performance.md, The host path). librdkafka's threads and the inference runtimes' pools, created before the hold, keep the
process's whole set; a thread a held thread starts later inherits its CPU (a kwe-* helper; an
exactly-once producer's renewed client's threads). A CPU backend's dispatchers are left free: ONNX
Runtime and OpenVINO compute on the calling thread too, outside the lock.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections.abc import Callable, Iterable

PR_SET_NAME = 15
MAX_NAME_BYTES = 15  # the kernel's TASK_COMM_LEN, less its NUL
# The worker's own threads: every long-lived one is started under a name with this prefix.
WORKER_THREAD_PREFIX = "kwe-"


def _load_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


def name_current_thread(name: str, prctl: Callable[..., int] | None = None) -> bool:
    """The calling thread's OS name becomes `name` (cut to 15 bytes); False where it could not.
    Called once as a thread starts (loading libc's symbol is a dlsym, microseconds)."""
    call = prctl if prctl is not None else _load_prctl()
    if call is None:
        return False
    raw = name.encode("utf-8", "replace")[:MAX_NAME_BYTES]
    return call(PR_SET_NAME, ctypes.c_char_p(raw), 0, 0, 0) == 0


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity: a container's cpuset, taskset), in order;
    where the OS does not say (no sched_getaffinity), every CPU."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def _set_affinity(tid: int, cpus: set[int]) -> None:
    if not hasattr(os, "sched_setaffinity"):
        raise OSError("this OS cannot hold a thread on a CPU (no sched_setaffinity)")
    os.sched_setaffinity(tid, cpus)


def interpreter_threads(threads: Iterable[threading.Thread] | None = None, *, leave: tuple[str, ...] = ()) -> list[int]:
    """The OS thread IDs of the calling thread (the worker's poll thread, its main thread) and of
    every running kwe-* thread but those whose names start with one of `leave`."""
    ids: set[int | None] = {threading.get_native_id()}
    for t in threading.enumerate() if threads is None else threads:
        if t.name.startswith(WORKER_THREAD_PREFIX) and not (leave and t.name.startswith(leave)) \
                and t.native_id is not None and t.is_alive():
            ids.add(t.native_id)
    return sorted(i for i in ids if i is not None)


def hold_interpreter_threads(cpu: int, *, leave: tuple[str, ...] = (), threads: Iterable[threading.Thread] | None = None,
                             set_affinity: Callable[[int, set[int]], None] = _set_affinity) -> list[int]:
    """Holds the calling thread and every running kwe-* thread (but those named with a prefix in
    `leave`) on `cpu`; the thread IDs held.
    A thread that ended meanwhile is skipped; `cpu` outside the process's set is the OS's refusal
    (OSError), which the caller turns into its error."""
    held = []
    for tid in interpreter_threads(threads, leave=leave):
        try:
            set_affinity(tid, {cpu})
        except ProcessLookupError:
            continue  # ended between the listing and here
        held.append(tid)
    return held
