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
exactly-once producer's renewed client's threads): the hold reads every thread's set as it starts
(`thread_affinities`), so those started since follow its moves and are let go with it
(`started_on`), and the threads there before, pinned on purpose or not, are never touched. A CPU
backend's dispatchers are left free: ONNX Runtime and OpenVINO compute on the calling thread too, outside the lock.

The alternate signal stack (`signal_stack_kept`): OpenVINO's CPU plugin installs one (11.5 kB) on
the thread that compiles a model and does not take it back when the model is freed. auto on CPU
compiles its candidates on the main thread and frees the refused ones, so the kernel went on
delivering signals onto that stack: a SIGTERM then killed the worker with SIGSEGV (exit 139, about
one start in three with a cold cache on an AVX-512 machine) where it should drain and exit 0.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from contextlib import contextmanager

PR_SET_NAME = 15
SS_DISABLE = 2  # sigaltstack's flag: no alternate stack
MAX_NAME_BYTES = 15  # the kernel's TASK_COMM_LEN, less its NUL
# The worker's own threads: every long-lived one is started under a name with this prefix.
WORKER_THREAD_PREFIX = "kwe-"


def _libc_function(name: str) -> Callable[..., int] | None:
    """libc's `name` (loading the already loaded libc is a dlsym, microseconds); None where absent."""
    try:
        return getattr(ctypes.CDLL(None, use_errno=True), name)  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


def name_current_thread(name: str, prctl: Callable[..., int] | None = None) -> bool:
    """The calling thread's OS name becomes `name` (cut to 15 bytes); False where it could not.
    Called once as a thread starts."""
    call = prctl
    if call is None and sys.platform.startswith("linux"):
        call = _libc_function("prctl")
    if call is None:
        return False
    raw = name.encode("utf-8", "replace")[:MAX_NAME_BYTES]
    return call(PR_SET_NAME, ctypes.c_char_p(raw), 0, 0, 0) == 0


def block_stop_signals() -> bool:
    """SIGTERM and SIGINT blocked on the calling thread, as each of the worker's threads starts:
    Python runs their handlers on the main thread anyway, and the kernel hands a process's signal
    to any thread that does not block it. So it reaches the main thread (or a client library's own),
    never one whose alternate signal stack a runtime may have freed (see `signal_stack_kept`); the
    threads a worker thread starts (a runtime's pool) inherit the block. False where the OS cannot."""
    if not hasattr(signal, "pthread_sigmask"):
        return False
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    return True


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity: a container's cpuset, taskset), in order;
    where the OS does not say (no sched_getaffinity), every CPU."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def current_cpu() -> int | None:
    """The CPU the calling thread runs on now (sched_getcpu); None where the OS does not say."""
    call = _libc_function("sched_getcpu")
    if call is None:
        return None
    cpu = call()
    return cpu if cpu >= 0 else None


def set_affinity(tid: int, cpus: set[int]) -> None:
    if not hasattr(os, "sched_setaffinity"):
        raise OSError("this OS cannot hold a thread on a CPU (no sched_setaffinity)")
    os.sched_setaffinity(tid, cpus)


def interpreter_threads(threads: Iterable[threading.Thread] | None = None, *, leave: tuple[str, ...] = ()) -> list[int]:
    """The OS thread IDs of the calling thread (the worker's poll thread, its main thread) and of
    every running kwe-* thread but those whose names start with one of `leave`."""
    ids = {threading.get_native_id()}
    for t in threading.enumerate() if threads is None else threads:
        if t.name.startswith(WORKER_THREAD_PREFIX) and not (leave and t.name.startswith(leave)) \
                and t.native_id is not None and t.is_alive():
            ids.add(t.native_id)
    return sorted(ids)


def hold_interpreter_threads(cpu: int, *, leave: tuple[str, ...] = (), threads: Iterable[threading.Thread] | None = None,
                             set_affinity: Callable[[int, set[int]], None] = set_affinity) -> list[int]:
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


def thread_affinities(task_dir: str = "/proc/self/task",
                      get_affinity: Callable[[int], set[int]] | None = None) -> dict[int, set[int]]:
    """Every thread of this process and its CPU set, by OS thread ID; a thread that ended
    meanwhile is skipped. OSError where the threads cannot be listed (no /proc)."""
    get = get_affinity if get_affinity is not None else os.sched_getaffinity
    found = {}
    for name in os.listdir(task_dir):
        try:
            found[int(name)] = set(get(int(name)))
        except (ProcessLookupError, FileNotFoundError):
            continue  # ended between the listing and here
    return found


def started_on(cpu: int, before: Collection[int], now: Mapping[int, set[int]], *,
               skip: Collection[int] = ()) -> list[int]:
    """The threads in `now` that were not in `before` (started since) and run on `cpu` alone, but
    those in `skip`: the ones a held thread started, which inherited its CPU set (a renewed
    producer's librdkafka threads, a GPU runtime's own). A thread there before, pinned to that
    CPU on purpose by a runtime or an operator, is not one of them; nor is one started since by an
    unheld thread (librdkafka's, on the process's whole set)."""
    return sorted(tid for tid, cpus in now.items() if tid not in before and tid not in skip and cpus == {cpu})


class _SignalStack(ctypes.Structure):  # stack_t
    _fields_ = [("ss_sp", ctypes.c_void_p), ("ss_flags", ctypes.c_int), ("ss_size", ctypes.c_size_t)]


def signal_stack() -> tuple[int | None, int, int] | None:
    """The calling thread's alternate signal stack: (address, flags, size); None where it cannot be read."""
    call = _libc_function("sigaltstack")
    current = _SignalStack()
    if call is None or call(None, ctypes.byref(current)) != 0:
        return None
    return current.ss_sp, current.ss_flags, current.ss_size


@contextmanager
def signal_stack_kept() -> Iterator[None]:
    """Runs the block, then gives the calling thread back the alternate signal stack it had before
    it, where a library in the block installed its own (see the module docstring): a stack that
    may be freed under the kernel's feet is worse than none."""
    before = signal_stack()
    try:
        yield
    finally:
        call = _libc_function("sigaltstack")
        if before is not None and call is not None and signal_stack() != before:
            address, flags, size = before
            call(ctypes.byref(_SignalStack(address, flags & SS_DISABLE, size)), None)
