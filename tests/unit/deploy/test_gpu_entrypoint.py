"""deploy/docker/gpu-entrypoint.sh, run for real with a stand-in `keyword-embedder` on PATH.

The stand-in records how it was called and either builds a "plan" at once, fails, or hangs in
the build the way a long TensorRT build does; asked to `--check` a kept plan, it answers that the
plan fits, does not fit, or cannot be checked. What is checked is the entry point's own job:
build only when asked to, never leave a half-written plan, pass SIGTERM on to a running build
and exit at once, bound the build by ENGINE_BUILD_TIMEOUT_S, and exec the worker (same PID, so
the worker gets the container's signals directly).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.deploy_tools import DEPLOY

ENTRYPOINT = DEPLOY / "docker" / "gpu-entrypoint.sh"

FAKE = r"""#!/usr/bin/env bash
cmd="$1"; shift
echo "$cmd $$ $*" >> "$FAKE_DIR/calls"
case "$cmd" in
  build-engine)
    if [[ " $* " == *" --check "* ]]; then
      case "${FAKE_CHECK:-fits}" in
        fits) exit 0 ;;
        stale) echo "plan refused: foreign: built on GPU 'A', this GPU is 'B'" >&2; exit 1 ;;
        error) exit 2 ;;
      esac
    fi
    out=""
    while [[ $# -gt 0 ]]; do [[ "$1" == --output ]] && out="$2"; shift; done
    echo partial > "$out"; echo '{}' > "$out.json"
    echo $$ > "$FAKE_DIR/build.pid"
    case "${FAKE_BUILD:-ok}" in
      ok) echo plan > "$out"; exit 0 ;;
      fail) exit 7 ;;
      hang) exec sleep 60 ;;
    esac ;;
  run) exit 0 ;;
esac
exit 99
"""


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "keyword-embedder"
    fake.write_text(FAKE, encoding="utf-8")
    fake.chmod(0o755)
    (tmp_path / "engines").mkdir()
    return {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "FAKE_DIR": str(tmp_path),
        "KWE_ENGINE_PATH": str(tmp_path / "engines" / "model.plan"),
        "KWE_ONNX_PATH": "/opt/keyword-embedder/model.onnx",
    }


def _calls(env: dict[str, str]) -> list[list[str]]:
    path = Path(env["FAKE_DIR"]) / "calls"
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


def _start(env: dict[str, str], **extra: str) -> subprocess.Popen[str]:
    # The entry point as a container starts it, SIGINT and SIGTERM at their defaults (env execs it:
    # the same PID). A test run started in the background by a non-interactive shell (`.ci/run &`)
    # ignores SIGINT, a child inherits that, and bash cannot trap a signal ignored on entry: the
    # SIGINT test would wait out the build however the script is written.
    return subprocess.Popen(["env", "--default-signal=INT,TERM", str(ENTRYPOINT), "--max-in-flight", "8"],
                            env={**env, **extra}, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _run(env: dict[str, str], **extra: str) -> tuple[int, str, int]:
    proc = _start(env, **extra)
    _, err = proc.communicate(timeout=30)
    return proc.returncode, err, proc.pid


def _engine_dir(env: dict[str, str]) -> list[str]:
    return sorted(p.name for p in Path(env["KWE_ENGINE_PATH"]).parent.iterdir())


def test_builds_a_missing_plan_then_execs_the_worker_in_its_own_process(env: dict[str, str]) -> None:
    rc, err, pid = _run(env)
    assert rc == 0, err
    (build, run) = _calls(env)
    assert build[0] == "build-engine"
    assert build[2:4] == ["--profile", "gpu"] and "--onnx" in build and env["KWE_ONNX_PATH"] in build
    assert run[0] == "run"
    # exec: the worker has the entry point's PID, so the container's SIGTERM reaches it directly.
    assert int(run[1]) == pid
    assert run[2:] == ["--backend", "tensorrt", "--engine-path", env["KWE_ENGINE_PATH"], "--profile", "gpu",
                       "--max-in-flight", "8"]
    assert Path(env["KWE_ENGINE_PATH"]).read_text() == "plan\n"
    assert _engine_dir(env) == ["model.plan", "model.plan.json"]


def test_a_present_plan_that_fits_is_used_without_building(env: dict[str, str]) -> None:
    Path(env["KWE_ENGINE_PATH"]).write_text("kept\n")
    rc, err, _ = _run(env, FAKE_CHECK="fits")
    assert rc == 0, err
    check, run = _calls(env)
    assert check[0] == "build-engine" and check[-1] == "--check"
    assert check[check.index("--output") + 1] == env["KWE_ENGINE_PATH"]
    assert check[check.index("--onnx") + 1] == env["KWE_ONNX_PATH"]
    assert run[0] == "run"
    assert Path(env["KWE_ENGINE_PATH"]).read_text() == "kept\n"


def test_a_present_plan_that_does_not_fit_is_rebuilt(env: dict[str, str]) -> None:
    Path(env["KWE_ENGINE_PATH"]).write_text("from another GPU\n")
    rc, err, _ = _run(env, FAKE_CHECK="stale")
    assert rc == 0, err
    assert "does not fit (see above): rebuilding it" in err and "foreign: built on GPU" in err
    check, build, run = _calls(env)
    assert check[-1] == "--check" and "--check" not in build and run[0] == "run"
    assert Path(env["KWE_ENGINE_PATH"]).read_text() == "plan\n"


def test_a_plan_that_cannot_be_checked_stops_the_start(env: dict[str, str]) -> None:
    Path(env["KWE_ENGINE_PATH"]).write_text("kept\n")
    rc, err, _ = _run(env, FAKE_CHECK="error")
    assert rc == 2 and "could not check the plan" in err
    assert len(_calls(env)) == 1  # the check only: no build, no worker
    assert Path(env["KWE_ENGINE_PATH"]).read_text() == "kept\n"


def test_always_rebuilds_and_only_does_not_start_the_worker(env: dict[str, str]) -> None:
    Path(env["KWE_ENGINE_PATH"]).write_text("old\n")
    rc, err, _ = _run(env, ENGINE_BUILD="always")
    assert rc == 0, err
    assert [c[0] for c in _calls(env)] == ["build-engine", "run"]
    assert Path(env["KWE_ENGINE_PATH"]).read_text() == "plan\n"
    os.remove(env["KWE_ENGINE_PATH"])
    (Path(env["FAKE_DIR"]) / "calls").unlink()
    rc, err, _ = _run(env, ENGINE_BUILD="only")
    assert rc == 0, err
    assert [c[0] for c in _calls(env)] == ["build-engine"]
    assert Path(env["KWE_ENGINE_PATH"]).read_text() == "plan\n"


def test_never_refuses_to_build_and_says_where_the_plan_comes_from(env: dict[str, str]) -> None:
    rc, err, _ = _run(env, ENGINE_BUILD="never")
    assert rc == 3
    assert "no TensorRT plan at" in err and "init container" in err
    assert _calls(env) == []
    # With a plan, `never` neither checks nor builds: the worker checks the plan at load itself.
    Path(env["KWE_ENGINE_PATH"]).write_text("built by the init container\n")
    rc, err, pid = _run(env, ENGINE_BUILD="never", FAKE_CHECK="stale")
    assert rc == 0, err
    (run,) = _calls(env)
    assert run[0] == "run" and int(run[1]) == pid


def test_a_failed_build_leaves_nothing_and_passes_its_status_on(env: dict[str, str]) -> None:
    rc, err, _ = _run(env, FAKE_BUILD="fail")
    assert rc == 7
    assert "the plan build failed (exit 7)" in err
    assert [c[0] for c in _calls(env)] == ["build-engine"]
    assert _engine_dir(env) == []


def test_the_build_is_bounded_by_its_timeout(env: dict[str, str]) -> None:
    start = time.monotonic()
    rc, err, _ = _run(env, FAKE_BUILD="hang", ENGINE_BUILD_TIMEOUT_S="1")
    assert rc == 124
    assert time.monotonic() - start < 20
    assert "longer than ENGINE_BUILD_TIMEOUT_S=1s" in err
    assert _engine_dir(env) == []


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_during_the_build_stops_it_at_once(env: dict[str, str], sig: signal.Signals, code: int) -> None:
    proc = _start(env, FAKE_BUILD="hang")
    pid_file = Path(env["FAKE_DIR"]) / "build.pid"
    deadline = time.monotonic() + 20
    while not pid_file.exists() or not pid_file.read_text().strip():
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    build_pid = int(pid_file.read_text())
    sent = time.monotonic()
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=15)
    assert proc.returncode == code, err
    assert time.monotonic() - sent < 5, "the entry point waited for the build instead of stopping it"
    assert f"stopped by SIG{sig.name[3:]} during the plan build" in err
    with pytest.raises(ProcessLookupError):
        os.kill(build_pid, 0)  # the build itself was stopped, not orphaned
    assert _engine_dir(env) == []  # no half-written plan for the next start to trust
    assert [c[0] for c in _calls(env)] == ["build-engine"]  # and no worker started


@pytest.mark.parametrize(("var", "value", "message"), [
    ("ENGINE_BUILD", "sometimes", "ENGINE_BUILD=sometimes is not one of"),
    ("ENGINE_BUILD_TIMEOUT_S", "10m", "ENGINE_BUILD_TIMEOUT_S=10m is not a positive whole number"),
])
def test_bad_settings_stop_before_anything_runs(env: dict[str, str], var: str, value: str, message: str) -> None:
    rc, err, _ = _run(env, **{var: value})
    assert rc == 2 and message in err
    assert _calls(env) == []
