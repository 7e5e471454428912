"""Several worker processes on one machine (`run --processes N`), under one supervisor.

One process's Python host path tops out well below what an accelerator embeds (docs/performance.md,
The host path): the GIL serialises intake, output and delivery. So a machine runs N workers, each
a full group member with its own consumer, producer, bucketer and backend (sharing the model
files and the caches on disk; on a GPU, sharing the device), and this supervisor, built as
gunicorn's arbiter is:

- starts them with the same settings (`run`'s own command line, then `--processes 1`, a distinct
  `--member-id` (exactly-once's transactional IDs must differ), when metrics are on, a loopback
  metrics port of its own and, where `interpreter_cpu` is auto on a GPU, a CPU of its own for its
  Python threads to start on: the child moves them off it when another process takes it, so two
  pods' supervisors that both start at CPU 0 part). The port is bound here, before the child
  starts, and handed to it as an open socket (`ENV_METRICS_FD`): nothing else can take it between
  the pick and the child's bind. A stop requested while they start ends the spawning there, and
  reaches those started: each starts with SIGTERM and SIGINT blocked, unblocked once its handlers
  are in (worker/operations/stop_signals.py), so a stop sent before then waits for them instead
  of killing it (143);
- starts each child in a session of its own, so that a signal to the supervisor's process group
  (Ctrl-C in a terminal, `tini -g`, `kill -- -PGID`) reaches the supervisor only, and each child
  gets it once, from the supervisor: the first stop is forwarded as SIGTERM (drain and commit),
  a second as SIGINT (abort; a different signal, so the kernel never merges two stops sent at
  once into one). A child dies with the supervisor: it watches a pipe only the supervisor can
  write to and SIGTERMs itself when the pipe closes (`watch_supervisor`), so a SIGKILLed
  supervisor leaves no worker behind, and the orphans drain and commit as on any stop;
- bounds every stop: a child still running `shutdown_timeout_s` + `KILL_MARGIN_S` after the stop
  was forwarded (`ABORT_S` + the margin after an abort) is SIGKILLed with its process group, the
  log says which, and its 137 is in the exit code;
- serves one /metrics for the machine on `metrics_port`, bound before any child starts (every
  child's series with a `process` label, merged at scrape time), /readyz (ready when every child
  is: a child with no partition while the group has more members than partitions counts as
  ready, worker/operations/health.py, `Readiness`) and /healthz (alive while every child is);
- restarts nothing: when a child exits on its own, the supervisor says which and with what
  code, stops the others (they drain and commit) and exits with that child's code, so the
  orchestrator sees the failure. After a requested stop it exits with the worst child's code.

Threads: the caller's thread runs `start` and `run` (spawns, forwards, kills), blocked on one
queue of events between them: stop requests (put by the signal handler, which does nothing
else: `queue.SimpleQueue.put` is safe there) and child exits (put by one "kwe-child-N" thread per
child, blocked in its `wait()`). The probe server's request threads only read (the children's
probes over loopback, and each child's exit status). In each child, "kwe-supervisor-watch" (a
daemon) blocks on the supervisor's pipe and only signals its own process.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

log = structlog.get_logger(__name__)

# The environment variables a child reads: its index (its log lines carry it as `process`), the
# file descriptors of the pipe that tells it the supervisor is gone and of its metrics socket.
ENV_PROCESS = "KWE_WORKER_PROCESS"
ENV_SUPERVISOR_FD = "KWE_SUPERVISOR_FD"
ENV_METRICS_FD = "KWE_METRICS_FD"
PROBE_TIMEOUT_S = 2.0
# How long past its own deadline a stopping child gets before it is SIGKILLed. A child keeps
# shutdown_timeout_s plus at most 2 s (the pipeline's stated margin); the rest is its
# interpreter's exit. Deployments give 10 s above shutdown_timeout_s (deploy/README.md, Shutdown
# and grace periods), so the supervisor kills and says so before the orchestrator does.
KILL_MARGIN_S = 5.0
# A child's own deadline after a second stop (worker.pipeline.ABORT_S).
ABORT_S = 2.0
# The order in which exit codes count as worse: a fatal error (1) before a start-up failure (2)
# before any other failure before an abort (130) before a clean exit.
SEVERITY = {0: 0, 130: 1}


def severity(code: int) -> int:
    return SEVERITY.get(code, 4 if code == 1 else 3 if code == 2 else 2)


def worst(codes: Sequence[int]) -> int:
    return max(codes, key=severity, default=0)


def watch_supervisor(environ: Mapping[str, str]) -> bool:
    """In one of a supervisor's processes: a "kwe-supervisor-watch" thread that SIGTERMs this process
    once when the supervisor is gone, so a SIGKILLed supervisor (an OOM kill, a `kill -9`) leaves
    no worker running on its own; the signal takes the path any stop takes (drain, commit, leave).
    The thread waits on a pipe whose only write end the supervisor holds and never writes: the read
    sees end-of-file when the supervisor's process ends, however it ends, and at once when it ended
    before the watch began. (Not PR_SET_PDEATHSIG: that fires at the exit of the parent's thread,
    once for each thread the child is handed on to, and a second SIGTERM aborts.) False where this
    process is not a supervisor's."""
    fd = environ.get(ENV_SUPERVISOR_FD)
    if not fd:
        return False

    def watch() -> None:
        while True:
            try:
                if not os.read(int(fd), 1):
                    break
            except InterruptedError:
                continue
            except OSError:
                return  # not the supervisor's pipe: nothing to watch
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="kwe-supervisor-watch", daemon=True).start()
    return True


def inherited_metrics_socket(environ: Mapping[str, str]) -> socket.socket | None:
    """The bound, not yet listening, socket a supervisor handed this process for its probes."""
    fd = environ.get(ENV_METRICS_FD)
    return socket.socket(fileno=int(fd)) if fd else None


def bound_loopback_socket() -> socket.socket:
    """A loopback TCP socket bound to a free port and not listening: a connection to it is refused
    (a probe of a child still loading fails at once rather than waiting), and without
    SO_REUSEADDR no other socket can bind the port while it is open."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    return sock


@dataclass
class Child:
    index: int
    command: list[str]
    metrics_port: int  # 0: metrics off
    proc: Any = None
    code: int | None = None  # set by the supervisor's thread once the exit is seen
    killed: bool = False

    @property
    def running(self) -> bool:
        """Read by the probe threads: the return code is set by the child's waiting thread."""
        return self.proc.returncode is None

    def probe(self, path: str) -> int | None:
        """The child's HTTP status for `path`, or None when it does not answer."""
        if not self.metrics_port:
            return None
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}{path}", timeout=PROBE_TIMEOUT_S) as r:
                return int(r.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)
        except OSError:
            return None

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=PROBE_TIMEOUT_S) as r:
            return r.read().decode("utf-8")


Spawn = Callable[[list[str], dict[str, str], Sequence[int]], Any]


def _popen(command: list[str], env: dict[str, str], pass_fds: Sequence[int]) -> subprocess.Popen[bytes]:
    # The children write to the supervisor's stdout and stderr: one stream of log lines, each
    # child's carrying its `process` index. A session of their own: see the module's docstring.
    return subprocess.Popen(command, env=env, pass_fds=tuple(pass_fds), start_new_session=True)


# What the supervisor's queue carries: a stop request, or a child that exited.
_STOP = "stop"


@dataclass
class Supervisor:
    run_argv: list[str]  # `run`'s own command line, as the user gave it
    count: int
    member_id: str
    metrics: bool
    shutdown_timeout_s: float = 25.0
    # Each process's --interpreter-cpu (worker/core/os_threads.py), in order; None: as given.
    interpreter_cpus: list[int] | None = None
    spawn: Spawn = _popen
    executable: Sequence[str] = (sys.executable, "-m", "worker.cli")
    kill_margin_s: float = KILL_MARGIN_S
    children: list[Child] = field(default_factory=list)
    failed: Child | None = None
    # Stop requests made (the signal handler's, or a child's failure) and forwarded so far.
    _requested: int = 0
    _forwarded: int = 0
    _kill_at: float | None = None
    kill_after_s: float = 0.0  # the bound that _kill_at keeps (the log says it)
    _events: queue.SimpleQueue[Any] = field(default_factory=queue.SimpleQueue)
    _watch_w: int | None = None

    def start(self) -> None:
        # The children's watch on this process (watch_supervisor): the write end stays open here,
        # unwritten, for the supervisor's life; it is not inherited (os.pipe's ends are not).
        watch_r, self._watch_w = os.pipe()
        try:
            self._start(watch_r)
        finally:
            os.close(watch_r)

    def _start(self, watch_r: int) -> None:
        for i in range(self.count):
            if self._requested:
                # A stop during spawning: the ones started get it from `run`; the rest never start.
                log.info("stop requested while the worker processes start; starting no more",
                         started=len(self.children), processes=self.count)
                break
            command = [*self.executable, "run", *self.run_argv, "--processes", "1",
                       "--member-id", f"{self.member_id}-{i}"]
            env = {**os.environ, ENV_PROCESS: str(i), ENV_SUPERVISOR_FD: str(watch_r)}
            if self.interpreter_cpus is not None:
                command += ["--interpreter-cpu", str(self.interpreter_cpus[i])]
            child = Child(i, command, 0)
            listener = None
            try:
                if self.metrics:
                    listener = bound_loopback_socket()
                    child.metrics_port = listener.getsockname()[1]
                    command += ["--metrics-port", str(child.metrics_port), "--metrics-host", "127.0.0.1"]
                    env[ENV_METRICS_FD] = str(listener.fileno())
                with _stops_blocked():
                    child.proc = self.spawn(command, env, [watch_r, *([listener.fileno()] if listener else [])])
            except OSError as exc:
                log.error("cannot start a worker process; stopping the others", process=i, error=str(exc))
                self.failed = child
                child.code = 2
                self.request_stop()
                break
            finally:
                if listener is not None:
                    listener.close()  # the child holds its own copy
            self.children.append(child)
            threading.Thread(target=self._wait_for, args=(child,), name=f"kwe-child-{i}", daemon=True).start()
        log.info("worker processes started", processes=len(self.children),
                 pids=[c.proc.pid for c in self.children])

    def request_stop(self) -> None:
        """A stop signal: the first drains every child, a second aborts them. Called from the
        signal handler: it only counts and queues; `run` forwards."""
        self._requested += 1
        self._events.put_nowait(_STOP)

    def run(self) -> int:
        """Watches the children until they have all exited; returns the supervisor's exit code."""
        while not all(c.code is not None for c in self.children):
            timeout = None if self._kill_at is None else max(0.0, self._kill_at - time.monotonic())
            try:
                event = self._events.get(timeout=timeout)
            except queue.Empty:
                event = None
            while event is not None:
                if isinstance(event, Child):
                    self._exited(event)
                try:
                    event = self._events.get_nowait()
                except queue.Empty:
                    event = None
            self._forward()
            if self._kill_at is not None and time.monotonic() >= self._kill_at:
                self._kill_the_rest()
        codes = [c.code or 0 for c in self.children]
        if self.failed is not None and self.failed.code:
            code = self.failed.code
        else:
            code = worst(codes)
        log.info("worker processes stopped", exit_codes=codes, exit_code=code,
                 killed=[c.index for c in self.children if c.killed])
        if self._watch_w is not None:
            os.close(self._watch_w)  # every child has exited: nothing watches it any more
            self._watch_w = None
        return int(code or 0)

    # ------------------------------------------------------------------ the supervisor's thread
    def _wait_for(self, child: Child) -> None:
        """A "kwe-child-N" thread: blocks until the child exits, then tells the supervisor."""
        child.proc.wait()
        self._events.put(child)

    def _exited(self, child: Child) -> None:
        child.code = _exit_code(child.proc.returncode)
        if self._requested == 0 and self.failed is None:
            self.failed = child
            log.error("a worker process exited on its own; stopping the others (nothing is "
                      "restarted)", process=child.index, pid=child.proc.pid, exit_code=child.code)
            self.request_stop()

    def _forward(self) -> None:
        """Sends each stop request not yet forwarded to every running child: SIGTERM, then SIGINT."""
        while self._forwarded < min(self._requested, 2):
            self._forwarded += 1
            first = self._forwarded == 1
            bound = (self.shutdown_timeout_s if first else ABORT_S) + self.kill_margin_s
            kill_at = time.monotonic() + bound
            if self._kill_at is None or kill_at < self._kill_at:
                self._kill_at, self.kill_after_s = kill_at, bound
            running = [c for c in self.children if c.code is None]
            log.info("stopping the worker processes" if first else "second stop: the worker processes abort",
                     processes=[c.index for c in running], kill_after_s=round(self._kill_at - time.monotonic(), 1))
            for child in running:
                _signal(child, signal.SIGTERM if first else signal.SIGINT)

    def _kill_the_rest(self) -> None:
        for child in self.children:
            if child.code is None and not child.killed:
                child.killed = True
                log.error("a worker process did not stop in time; killing it", process=child.index,
                          pid=child.proc.pid, waited_s=self.kill_after_s)
                try:
                    os.killpg(child.proc.pid, signal.SIGKILL)  # with whatever it started
                except OSError:
                    _signal(child, signal.SIGKILL)
        self._kill_at = None

    # ------------------------------------------------------------------ probes (request threads)
    def ready(self) -> tuple[bool, dict[str, bool]]:
        checks = {f"process_{c.index}": c.running and c.probe("/readyz") == 200 for c in self.children}
        return bool(checks) and all(checks.values()), checks

    def live(self) -> tuple[bool, str]:
        dead = [c.index for c in self.children if not c.running]
        if dead:
            return False, f"worker process(es) {', '.join(map(str, dead))} exited"
        failing = [c.index for c in self.children if c.probe("/healthz") not in (200, None)]
        if failing:
            return False, f"worker process(es) {', '.join(map(str, failing))} failing their liveness check"
        return True, f"{len(self.children)} worker processes alive"

    def watch_liveness(self, live: Any) -> None:
        """Each process exports its own kwe_healthy; the merge carries them, labelled."""

    def render(self) -> bytes:
        from worker.operations.merged_metrics import merge_expositions

        texts = []
        for child in self.children:
            try:
                texts.append((str(child.index), child.metrics()))
            except OSError:
                continue  # not up yet, or gone: its series are missing from this scrape
        return merge_expositions(texts, label="process", up=[(str(c.index), c.running) for c in self.children])


@contextlib.contextmanager
def _stops_blocked() -> Iterator[None]:
    """SIGTERM and SIGINT blocked in this thread, so that a child forked here inherits them blocked."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _signal(child: Child, sig: int) -> None:
    try:
        child.proc.send_signal(sig)
    except OSError:
        pass  # exited meanwhile: its exit is on the queue


def _exit_code(returncode: int) -> int:
    """A child killed by a signal (negative returncode) counts as 128 + the signal, as a shell says."""
    return 128 - returncode if returncode < 0 else returncode
