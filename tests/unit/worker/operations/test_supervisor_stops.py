"""How `run --processes N`'s supervisor stops (worker/operations/supervisor.py), with stand-in children
(tests/unit/worker/operations/test_supervisor.py's CHILD): one signal to the process group reaches each child once, the
children die with a killed supervisor, the supervisor sleeps while they drain, a child that does not
stop is killed after the bound, a stop during spawning is honoured, the metrics ports are held from
the pick to the child, and a member with nothing assigned stands by as ready."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import types
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT
from tests.proc_tools import alive, children_of
from tests.unit.worker.operations.test_supervisor import CHILD, _run, _supervisor
from worker.core.errors import KeywordEmbedderError
from worker.operations.metrics import Metrics
from worker.operations.supervisor import Supervisor
from worker.settings.schema import Settings


# A supervisor as `run --processes 2` runs it: its own process, its signal handling, two children.
MACHINE = textwrap.dedent("""
    import sys
    from worker.operations.stop_signals import StopSignals
    from worker.operations.supervisor import Supervisor
    signals = StopSignals()
    sup = Supervisor(["--input-topic", "in"], 2, member_id="host", metrics=False,
                     executable=(sys.executable, "-c", sys.argv[1], "0", sys.argv[2]))
    signals.on_stop = sup.request_stop
    sup.start()
    sys.exit(sup.run())
""")


def _wait_started(out: Path, count: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not all((out / f"child-{i}.argv").exists() for i in range(count)):
        assert time.monotonic() < deadline, "the children did not start"
        time.sleep(0.02)


def _signals(out: Path, index: int) -> list[int]:
    path = out / f"child-{index}.signals"
    return [int(s) for s in path.read_text().split()] if path.exists() else []


@pytest.fixture
def machine(tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    # A session of its own, as a terminal's foreground job or a container's entry point is: a
    # signal to its process group reaches no test.
    proc = subprocess.Popen([sys.executable, "-c", MACHINE, CHILD, str(tmp_path)], cwd=ROOT, start_new_session=True)
    _wait_started(tmp_path, 2)
    children = children_of(proc.pid)
    assert len(children) == 2, children
    try:
        yield proc
    finally:
        for pid in [proc.pid, *children]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait()


def test_a_signal_to_the_process_group_reaches_each_child_once(machine: subprocess.Popen[bytes],
                                                                tmp_path: Path) -> None:
    # Ctrl-C in a terminal (or tini -g, kill -- -PGID) signals the whole foreground process group.
    os.killpg(machine.pid, signal.SIGINT)
    code = machine.wait(30)
    got = [_signals(tmp_path, i) for i in range(2)]
    assert (code, got) == (0, [[signal.SIGTERM], [signal.SIGTERM]]), "one stop each: a drain, not an abort"


def test_the_children_die_with_a_killed_supervisor(machine: subprocess.Popen[bytes], tmp_path: Path) -> None:
    children = children_of(machine.pid)
    machine.kill()
    machine.wait()
    deadline = time.monotonic() + 15
    while any(alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(pid) for pid in children), "a child outlived its supervisor"
    assert [_signals(tmp_path, i) for i in range(2)] == [[signal.SIGTERM]] * 2, "each was told to drain"


def test_the_supervisor_sleeps_while_its_children_drain(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STUB_DRAIN_S", "1.5")
    sup = _supervisor(tmp_path, fail=0, count=2)
    sup.start()
    _wait_started(tmp_path, 2)
    sup.request_stop()
    result: list[tuple[int, float]] = []
    began = time.monotonic()
    thread = threading.Thread(target=lambda: result.append((sup.run(), time.thread_time())))
    thread.start()
    thread.join(30)
    wall = time.monotonic() - began
    assert result, "the supervisor did not return"
    code, cpu = result[0]
    assert code == 0 and wall >= 1.5
    assert cpu < 0.05 * wall, f"the supervisor used {cpu:.2f} s of CPU in {wall:.2f} s"


@pytest.mark.parametrize("how", ["ignores the stop", "SIGSTOPped"])
def test_a_child_that_does_not_stop_is_killed_after_the_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: Any, how: str) -> None:
    if how == "ignores the stop":
        monkeypatch.setenv("STUB_IGNORE_STOP", "1")
    sup = _supervisor(tmp_path, fail=0, count=2)
    sup.shutdown_timeout_s, sup.kill_margin_s = 0.5, 0.5
    sup.start()
    try:
        _wait_started(tmp_path, 2)
        if how == "SIGSTOPped":
            os.kill(sup.children[1].proc.pid, signal.SIGSTOP)
        began = time.monotonic()
        sup.request_stop()
        code = _run(sup, timeout=20)
        took = time.monotonic() - began
    finally:
        for child in sup.children:
            if child.proc.poll() is None:
                child.proc.kill()
    assert code == 137 and [c.code for c in sup.children] == [0, 137] and sup.children[1].killed
    assert 1.0 <= took < 10, f"killed after {took:.1f} s (bound: 1 s)"
    assert "did not stop in time; killing it" in capsys.readouterr().out


def test_a_stop_during_spawning_reaches_every_child_started_and_starts_no_more(tmp_path: Path) -> None:
    sup = _supervisor(tmp_path, fail=0, count=3)
    spawn = sup.spawn

    def spawn_then_signal(*args: Any) -> Any:
        proc = spawn(*args)
        sup.request_stop()  # the signal lands while the supervisor starts its children
        return proc

    sup.spawn = spawn_then_signal
    sup.start()
    try:
        code = _run(sup, timeout=20)
    finally:
        for child in sup.children:
            if child.proc.poll() is None:
                child.proc.kill()
    assert code == 0 and len(sup.children) == 1 and [c.code for c in sup.children] == [0]


def test_a_metrics_port_in_use_stops_the_machine_before_any_child_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.commands import run as run_command

    started: list[Supervisor] = []
    monkeypatch.setattr(Supervisor, "start", lambda self: started.append(self))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        settings = Settings(metrics_port=port, metrics_host="127.0.0.1", processes="2")
        with pytest.raises(KeywordEmbedderError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            run_command._supervise(argparse.Namespace(command_argv=[]), settings, 2,
                                   types.SimpleNamespace(on_stop=None))  # type: ignore[arg-type]
    assert not started, "no child started"


def test_a_childs_metrics_port_is_held_from_the_pick_until_the_child_has_it(tmp_path: Path) -> None:
    sup = _supervisor(tmp_path, fail=0, count=2, metrics=True)
    spawn = sup.spawn
    taken: list[int] = []

    def spawn_after_a_rival(command: list[str], *args: Any) -> Any:
        port = int(command[command.index("--metrics-port") + 1])
        for reuse in (0, 1):  # what another process could bind in between (HTTPServer sets SO_REUSEADDR)
            with socket.socket() as rival:
                rival.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, reuse)
                try:
                    rival.bind(("127.0.0.1", port))
                    taken.append(port)
                except OSError:
                    pass
        return spawn(command, *args)

    sup.spawn = spawn_after_a_rival
    sup.start()
    _wait_started(tmp_path, 2)
    sup.request_stop()
    assert _run(sup) == 0
    assert taken == [], "a child's port could be taken before the child bound it"
    assert [(tmp_path / f"child-{i}.socket").read_text() for i in range(2)] == ["True", "True"]


def test_a_child_serves_its_probes_on_the_socket_it_was_handed() -> None:
    from worker.operations.probes import MetricsServer
    from worker.operations.supervisor import bound_loopback_socket

    sock = bound_loopback_socket()
    port = sock.getsockname()[1]
    with pytest.raises(OSError):  # bound, not listening: a probe of a child still loading fails at once
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    with MetricsServer(Metrics(), "127.0.0.1", port, lambda: (True, "ok"), sock=sock) as server:
        assert server.port == port
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as r:
            assert r.status == 200


def test_a_supervisors_process_whose_supervisor_is_gone_stops_at_once(tmp_path: Path) -> None:
    # The supervisor's pipe is closed already (it died as the child started): `run` stops as if
    # told (a start-up stop: exit 0), before it would fail to reach this broker.
    watch_r, watch_w = os.pipe()
    os.close(watch_w)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KWE_")}
    env.update(KWE_WORKER_PROCESS="0", KWE_SUPERVISOR_FD=str(watch_r))
    try:
        done = subprocess.run([sys.executable, "-m", "worker.cli", "run", "--bootstrap-servers", "127.0.0.1:9",
                               "--input-topic", "in", "--output-topic", "out", "--processes", "1"],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, pass_fds=(watch_r,))
    finally:
        os.close(watch_r)
    assert done.returncode == 0 and "stopped by SIGTERM during start-up" in done.stderr, done.stderr[-2000:]


def test_a_member_with_nothing_assigned_stands_by_once_the_group_has_settled() -> None:
    from worker.operations.health import Readiness

    now = [100.0]
    last: list[tuple[str, float] | None] = [None]
    checks = {"assigned": False, "no_fatal_error": True}
    ready = Readiness(lambda: (all(checks.values()), dict(checks)), lambda: last[0], settle_s=15.0,
                      clock=lambda: now[0])
    assert ready() == (False, {"assigned": False, "no_fatal_error": True, "standby": False}), "not joined yet"
    last[0] = ("assign", 100.0)  # the cooperative protocol's first round: nothing yet
    now[0] = 110.0
    assert ready()[0] is False, "the second round may still bring partitions"
    now[0] = 115.0
    assert ready() == (True, {"assigned": False, "no_fatal_error": True, "standby": True})
    last[0] = ("revoke", 116.0)  # a rebalance under way
    now[0] = 140.0
    assert ready()[0] is False
    checks["assigned"] = True
    assert ready() == (True, {"assigned": True, "no_fatal_error": True})
    checks.update(assigned=False, no_fatal_error=False)
    last[0] = ("assign", 100.0)
    assert ready()[0] is False, "a fatal error is never ready"


def test_metrics_remember_the_last_rebalance() -> None:
    metrics = Metrics()
    assert metrics.last_rebalance() is None
    before = time.monotonic()
    metrics.count_rebalance("revoke")
    metrics.count_rebalance("assign")
    kind, at = metrics.last_rebalance() or ("", 0.0)
    assert kind == "assign" and before <= at <= time.monotonic()
