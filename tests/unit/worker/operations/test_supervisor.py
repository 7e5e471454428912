"""`run --processes N` (worker/operations/supervisor.py): signals forwarded, a child that dies stops
the others and names itself in the exit, one /metrics for the machine."""

from __future__ import annotations

import sys
import textwrap
import time
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from worker.commands.run import interpreter_cpus, process_count
from worker.operations.merged_metrics import merge_expositions
from worker.operations.metrics import Metrics
from worker.operations.supervisor import Supervisor, worst
from worker.settings.schema import Settings, SettingsError

# A stand-in for `python -m worker.cli run ...`: child 1 exits with FAIL_CODE after a moment (or
# never, when it is 0); every child exits 0 on a stop signal (SIGTERM or SIGINT) after STUB_DRAIN_S,
# 130 on a second one, and writes what it got. The children listed in STUB_IGNORE_STOP ignore
# stops. A child handed a metrics socket checks it is bound to the port its command line names.
CHILD = textwrap.dedent("""
    import os, signal, socket, sys, time
    index = int(os.environ["KWE_WORKER_PROCESS"])
    fail, out = int(sys.argv[1]), sys.argv[2]
    drain = float(os.environ.get("STUB_DRAIN_S", "0.2"))
    stubborn = str(index) in os.environ.get("STUB_IGNORE_STOP", "").split(",")
    got = []
    def stop(signum, frame):
        got.append(signum)
        with open(f"{out}/child-{index}.signals", "w") as fh:
            fh.write(" ".join(map(str, got)))
        if len(got) > 1 and not stubborn:
            sys.exit(130)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})  # as StopSignals does
    try:
        from worker.operations.supervisor import watch_supervisor
        watch_supervisor(os.environ)
    except ImportError:
        pass
    if os.environ.get("KWE_METRICS_FD"):
        sock = socket.socket(fileno=int(os.environ["KWE_METRICS_FD"]))
        port = sys.argv[sys.argv.index("--metrics-port") + 1]
        with open(f"{out}/child-{index}.socket", "w") as fh:
            fh.write(str(sock.getsockname()[1] == int(port)))
    with open(f"{out}/child-{index}.argv", "w") as fh:
        fh.write(" ".join(sys.argv[3:]))
    start = time.monotonic()
    while not got or stubborn:
        if index == 1 and fail and time.monotonic() - start > 0.3:
            sys.exit(fail)
        time.sleep(0.02)
    time.sleep(drain)
    sys.exit(130 if len(got) > 1 else 0)
""")


def _supervisor(tmp_path: Any, fail: int, count: int = 3, **kwargs: Any) -> Supervisor:
    return Supervisor(["--input-topic", "in"], count, member_id="host",
                      executable=(sys.executable, "-c", CHILD, str(fail), str(tmp_path)), **{"metrics": False, **kwargs})


def _run(sup: Supervisor, timeout: float = 30.0) -> int:
    import threading

    result: list[int] = []
    t = threading.Thread(target=lambda: result.append(sup.run()))
    t.start()
    t.join(timeout)
    assert result, "the supervisor did not return"
    return result[0]


def test_a_child_that_exits_on_its_own_stops_the_others_and_sets_the_exit_code(tmp_path: Any) -> None:
    sup = _supervisor(tmp_path, fail=3)
    sup.start()
    code = _run(sup)
    assert code == 3
    assert sup.failed is not None and sup.failed.index == 1
    assert [c.code for c in sup.children] == [0, 3, 0], "the others were stopped (SIGTERM: drain, exit 0)"


def test_a_stop_is_forwarded_and_the_worst_code_wins(tmp_path: Any) -> None:
    sup = _supervisor(tmp_path, fail=0, count=2)
    sup.start()
    time.sleep(0.5)
    sup.request_stop()
    assert _run(sup) == 0 and sup.failed is None
    sup = _supervisor(tmp_path, fail=0, count=2)
    sup.start()
    time.sleep(0.5)
    sup.request_stop()
    time.sleep(0.05)  # two signals at once would reach a child as one
    sup.request_stop()  # a second signal: the children abort
    assert _run(sup) == 130


def test_each_child_gets_run_s_argv_with_its_own_member_id(tmp_path: Any) -> None:
    sup = _supervisor(tmp_path, fail=0, count=2)
    sup.start()
    time.sleep(0.5)
    sup.request_stop()
    _run(sup)
    for i in range(2):
        argv = (tmp_path / f"child-{i}.argv").read_text().split()
        assert argv[:3] == ["run", "--input-topic", "in"]
        assert argv[argv.index("--processes") + 1] == "1" and argv[argv.index("--member-id") + 1] == f"host-{i}"


def test_worst_orders_a_fatal_error_before_a_start_failure_before_an_abort() -> None:
    assert worst([0, 130, 2, 1]) == 1
    assert worst([0, 2, 130]) == 2
    assert worst([0, 137, 130]) == 137
    assert worst([0, 130]) == 130 and worst([0, 0]) == 0 and worst([]) == 0


def test_the_machine_s_metrics_merge_every_process_with_its_label() -> None:
    texts = []
    for i, produced in enumerate((5, 7)):
        m = Metrics()
        m.count_produced(produced)
        m.observe_hops("encode", [0.001] * (i + 1))
        texts.append((str(i), m.render().decode()))
    merged = merge_expositions(texts, label="process", up=[("0", True), ("1", False)]).decode()
    families = {f.name: f for f in text_string_to_metric_families(merged)}
    produced = {s.labels["process"]: s.value for s in families["kwe_produced_messages"].samples
                if s.name == "kwe_produced_messages_total"}
    assert produced == {"0": 5.0, "1": 7.0}
    counts = {s.labels["process"]: s.value for s in families["kwe_hop_seconds"].samples
              if s.name == "kwe_hop_seconds_count" and s.labels["hop"] == "encode"}
    assert counts == {"0": 1.0, "1": 2.0}
    up = {s.labels["process"]: s.value for s in families["kwe_worker_process_up"].samples}
    assert up == {"0": 1.0, "1": 0.0}
    assert merged.count("# TYPE kwe_produced_messages_total counter") == 1, "one family per name"


def test_processes_auto_is_half_the_cores_up_to_8_on_a_gpu_and_1_on_cpu() -> None:
    assert process_count(Settings(processes="3")) == 3
    assert process_count(Settings(processes="auto", backend="tensorrt"), cores=16) == 8
    assert process_count(Settings(processes="auto", backend="auto"), gpu=True, cores=6) == 3
    assert process_count(Settings(processes="auto", backend="auto"), gpu=False, cores=64) == 1
    assert process_count(Settings(processes="auto", backend="onnxruntime"), gpu=True, cores=64) == 1
    assert process_count(Settings(processes="auto", backend="tensorrt"), cores=1) == 1


@pytest.mark.parametrize("value", ["0", "65", "two", "-1", ""])
def test_processes_takes_auto_or_a_number(value: str) -> None:
    with pytest.raises(SettingsError, match="processes"):
        Settings(processes=value)


def test_each_process_gets_its_own_cpu_for_its_interpreter_on_a_gpu_and_none_on_cpu(tmp_path: Any) -> None:
    gpu = Settings(backend="tensorrt", processes="3")
    assert interpreter_cpus(gpu, 3, cpus=[2, 5]) == [2, 5, 2]
    assert interpreter_cpus(Settings(backend="auto"), 2, gpu=True, cpus=[0, 1, 2, 3]) == [0, 1]
    assert interpreter_cpus(Settings(backend="onnxruntime"), 2, gpu=True, cpus=[0, 1]) is None
    assert interpreter_cpus(Settings(backend="tensorrt", interpreter_cpu="off"), 2, cpus=[0, 1]) is None
    assert interpreter_cpus(gpu, 1, cpus=[0, 1]) is None, "one process, no supervisor: as given"
    sup = Supervisor(["--input-topic", "in"], 2, member_id="host", metrics=False, interpreter_cpus=[4, 7],
                     executable=(sys.executable, "-c", CHILD, "0", str(tmp_path)))
    sup.start()
    time.sleep(0.5)
    sup.request_stop()
    assert _run(sup) == 0
    argv = [(tmp_path / f"child-{i}.argv").read_text().split() for i in range(2)]
    assert [a[a.index("--interpreter-cpu") + 1] for a in argv] == ["4", "7"]


@pytest.mark.parametrize("value", ["two", "-1", "", "0,1"])
def test_interpreter_cpu_takes_a_cpu_number_auto_or_off(value: str) -> None:
    with pytest.raises(SettingsError, match="interpreter_cpu"):
        Settings(interpreter_cpu=value)
    assert Settings(interpreter_cpu="3").interpreter_cpu == "3"


def test_a_cpu_number_is_for_one_process() -> None:
    for processes in ("2", "auto"):
        with pytest.raises(SettingsError, match="interpreter_cpu.*same CPU"):
            Settings(interpreter_cpu="0", processes=processes)
    assert Settings(interpreter_cpu="auto", processes="4").interpreter_cpu == "auto"


def test_only_a_supervisors_cpu_number_is_where_a_hold_starts_not_where_it_stays() -> None:
    from worker.core.interpreter_hold import plan_hold

    def plan(setting: str, supervised: bool):  # noqa: ANN202
        return plan_hold(Settings(interpreter_cpu=setting).interpreter_cpu, cpu_backend=False, supervised=supervised,
                         cpus=[0, 1, 2, 3])

    assert plan("3", supervised=True).moves and plan("3", supervised=True).cpu == 3
    assert not plan("3", supervised=False).moves, "a lone process's number holds for good"
    assert plan("auto", supervised=True).cpu is None  # where the poll thread runs: no number to start from
    assert plan("off", supervised=True) is None
