"""Several worker processes on one machine (`run --processes N`), under one supervisor.

One process's Python host path tops out well below what an accelerator embeds (docs/performance.md,
The host path): the GIL serialises intake, output and delivery. So a machine runs N workers, each
a full group member with its own consumer, producer, bucketer and backend (sharing the model
files and the caches on disk; on a GPU, sharing the device), and this supervisor:

- starts them with the same settings (`run`'s own command line, then `--processes 1`, a distinct
  `--member-id` (exactly-once's transactional IDs must differ), when metrics are on, a loopback
  metrics port of its own and, where `interpreter_cpu` is auto on a GPU, a CPU of its own for its
  Python threads to start on: the child moves them off it when another process takes it, so two
  pods' supervisors that both start at CPU 0 part);
- forwards SIGTERM/SIGINT to every child (a second signal, forwarded again, aborts them);
- serves one /metrics for the machine on `metrics_port` (every child's series with a `process`
  label, merged at scrape time), /readyz (ready when every child is) and /healthz (alive while
  every child is);
- restarts nothing: when a child exits on its own, the supervisor says which and with what
  code, stops the others (they drain and commit) and exits with that child's code, so the
  orchestrator sees the failure. After a requested stop it exits with the worst child's code.

Threads: the caller's thread runs `run` (spawns, watches, stops); the probe server's request
threads only read (the children's probes over loopback, and the process table).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

log = structlog.get_logger(__name__)

# The environment variable a child reads its index from (its log lines carry it as `process`).
ENV_PROCESS = "KWE_WORKER_PROCESS"
# How often the supervisor looks at its children, and how long it waits for one probe.
WATCH_S = 0.2
PROBE_TIMEOUT_S = 2.0
# After the stop of a child that failed, how long the others get before they are killed.
KILL_AFTER_S = 60.0
# The order in which exit codes count as worse: a fatal error (1) before a start-up failure (2)
# before any other failure before an abort (130) before a clean exit.
SEVERITY = {0: 0, 130: 1}


def severity(code: int) -> int:
    return SEVERITY.get(code, 4 if code == 1 else 3 if code == 2 else 2)


def worst(codes: Sequence[int]) -> int:
    return max(codes, key=severity, default=0)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class Child:
    index: int
    command: list[str]
    metrics_port: int  # 0: metrics off
    proc: Any = None
    code: int | None = None

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


Spawn = Callable[[list[str], dict[str, str]], Any]


def _popen(command: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    # The children write to the supervisor's stdout and stderr: one stream of log lines, each
    # child's carrying its `process` index.
    return subprocess.Popen(command, env=env)


@dataclass
class Supervisor:
    run_argv: list[str]  # `run`'s own command line, as the user gave it
    count: int
    member_id: str
    metrics: bool
    # Each process's --interpreter-cpu (worker/core/os_threads.py), in order; None: as given.
    interpreter_cpus: list[int] | None = None
    spawn: Spawn = _popen
    executable: Sequence[str] = (sys.executable, "-m", "worker.cli")
    children: list[Child] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _signals: int = 0
    failed: Child | None = None

    def start(self) -> None:
        for i in range(self.count):
            port = free_port() if self.metrics else 0
            command = [*self.executable, "run", *self.run_argv, "--processes", "1",
                       "--member-id", f"{self.member_id}-{i}"]
            if self.metrics:
                command += ["--metrics-port", str(port), "--metrics-host", "127.0.0.1"]
            if self.interpreter_cpus is not None:
                command += ["--interpreter-cpu", str(self.interpreter_cpus[i])]
            child = Child(i, command, port)
            child.proc = self.spawn(command, {**os.environ, ENV_PROCESS: str(i)})
            self.children.append(child)
        log.info("worker processes started", processes=self.count,
                 pids=[c.proc.pid for c in self.children])

    def request_stop(self) -> None:
        """A stop signal: forwarded to every running child (the second one makes them abort)."""
        self._signals += 1
        self._stop.set()
        for child in self.children:
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)

    def run(self) -> int:
        """Watches the children until they have all exited; returns the supervisor's exit code."""
        killed_at: float | None = None
        while True:
            for child in self.children:
                if child.code is None and (code := child.proc.poll()) is not None:
                    child.code = _exit_code(code)
                    if not self._stop.is_set() and self.failed is None:
                        self.failed = child
                        log.error("a worker process exited on its own; stopping the others (nothing is "
                                  "restarted)", process=child.index, pid=child.proc.pid, exit_code=child.code)
                        self.request_stop()
                        killed_at = time.monotonic() + KILL_AFTER_S
            if all(c.code is not None for c in self.children):
                break
            if killed_at is not None and time.monotonic() > killed_at:
                for child in self.children:
                    if child.code is None:
                        child.proc.kill()
                killed_at = None
            self._stop.wait(WATCH_S)
        codes = [c.code or 0 for c in self.children]
        code = self.failed.code if self.failed is not None and self.failed.code else worst(codes)
        log.info("worker processes stopped", exit_codes=codes, exit_code=code)
        return int(code or 0)

    # ------------------------------------------------------------------ probes (request threads)
    def ready(self) -> tuple[bool, dict[str, bool]]:
        checks = {f"process_{c.index}": c.code is None and c.probe("/readyz") == 200 for c in self.children}
        return bool(checks) and all(checks.values()), checks

    def live(self) -> tuple[bool, str]:
        dead = [c.index for c in self.children if c.proc.poll() is not None]
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
        return merge_expositions(texts, label="process", up=[(str(c.index), c.proc.poll() is None)
                                                            for c in self.children])


def _exit_code(returncode: int) -> int:
    """A child killed by a signal (negative returncode) counts as 128 + the signal, as a shell says."""
    return 128 - returncode if returncode < 0 else returncode
