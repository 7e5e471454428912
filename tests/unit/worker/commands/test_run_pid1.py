"""`keyword-embedder run` as PID 1 of a PID namespace, as in a container (finding 8).

The kernel drops a signal sent to a namespace's init when it has no handler for it, so a
SIGTERM during Python's imports used to be ignored and the worker ran on. Here the worker is
PID 1 of its own namespace (`unshare --pid --fork`) and gets SIGTERM from outside, as from
`docker stop`: 0.3 s after it starts (still importing), and during the start-up check of a
broker that does not answer. Both exit 0 at once with the one-line message, no traceback.
With tini (the images' init) as PID 1 instead, the signal is forwarded to the worker.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.kafka_tools import free_port

BIN = Path(sys.executable).parent / "keyword-embedder"


def _unshare() -> list[str]:
    for cmd in (["unshare", "--pid", "--fork", "--kill-child"],
                ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--kill-child"]):
        if shutil.which("unshare") and subprocess.run([*cmd, "true"], capture_output=True).returncode == 0:
            return cmd
    pytest.skip("no PID namespaces here (unshare --pid needs CAP_SYS_ADMIN or user namespaces)")


def _pid1(proc: subprocess.Popen[bytes]) -> int:
    """The host PID of the namespace's init (unshare's child)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        except OSError:
            children = []
        if children:
            return int(children[0])
        time.sleep(0.005)
    raise AssertionError("the namespace's init never started")


def _run_as_pid1(prefix: list[str], sigterm_after: float) -> tuple[int, float, str]:
    cmd = [*_unshare(), *prefix, str(BIN), "run", "--bootstrap-servers", f"127.0.0.1:{free_port()}",
           "--log-format", "json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    init = _pid1(proc)
    started = time.monotonic()
    time.sleep(max(0.0, sigterm_after - (time.monotonic() - started)))
    import os

    os.kill(init, signal.SIGTERM)
    sent = time.monotonic()
    try:
        out, err = proc.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"still running 15 s after SIGTERM:\n{err.decode()[-2000:]}") from None
    return proc.returncode, time.monotonic() - sent, (out + err).decode(errors="replace")


@pytest.mark.parametrize("after", [0.3, 3.0], ids=["while-importing", "during-the-broker-check"])
def test_the_bare_worker_as_pid_1_stops_on_sigterm_at_once(after: float) -> None:
    code, took, output = _run_as_pid1([], after)
    assert code == 0, output[-2000:]
    assert "stopped by SIGTERM during start-up" in output, output[-2000:]
    assert "Traceback" not in output and "SystemError" not in output, output[-2000:]
    assert took < 3.0, f"exited {took:.1f} s after SIGTERM"


def test_tini_as_pid_1_forwards_sigterm_to_the_worker() -> None:
    tini = shutil.which("tini") or shutil.which("tini-static")
    if tini is None:
        pytest.skip("tini is not installed here (the images install it: apt-get install tini)")
    code, took, output = _run_as_pid1([tini, "--"], 3.0)
    assert code == 0 and "stopped by SIGTERM during start-up" in output, output[-2000:]
    assert took < 3.0
