"""The worker's threads carry their names at the OS level (worker/core/os_threads.py)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import ROOT
from tests.thread_tools import run_in_thread
from worker.core.interpreter_hold import plan_hold
from worker.core.os_threads import (PR_SET_NAME, allowed_cpus, hold_interpreter_threads, name_current_thread, started_on,
                                    thread_affinities)
from worker.latch import FatalLatch, guarded

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_NAME) is Linux's")


def _comm_of_thread_running(body_name: str, name: str) -> tuple[str, str]:
    """(the OS name of a guarded thread, the main thread's OS name), read from /proc while it runs."""
    seen: dict[str, str] = {}

    def body() -> None:
        seen["comm"] = Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()

    t = threading.Thread(target=guarded(FatalLatch(), name, body), name=body_name)
    t.start()
    t.join(10)
    return seen["comm"], Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()


@linux_only
def test_a_guarded_thread_runs_under_its_name_and_the_main_thread_keeps_the_process_name() -> None:
    before = Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()
    comm, main_after = _comm_of_thread_running("kwe-output", "kwe-output")
    assert comm == "kwe-output"
    assert main_after == before != "kwe-output"


@linux_only
def test_a_long_name_is_cut_to_what_the_kernel_keeps() -> None:
    comm, _ = _comm_of_thread_running("kwe-bucket-former", "kwe-bucket-former")
    assert comm == "kwe-bucket-form"  # 15 bytes


def test_the_call_passes_the_name_cut_to_15_bytes_and_reports_a_refusal() -> None:
    calls: list[tuple[object, ...]] = []

    def prctl(*args: object) -> int:
        calls.append(args)
        return -1

    assert name_current_thread("kwe-dispatch-12345678", prctl=prctl) is False
    option, name = calls[0][0], calls[0][1]
    assert option == PR_SET_NAME
    assert name.value == b"kwe-dispatch-12"  # type: ignore[attr-defined]
    assert name_current_thread("kwe-output", prctl=lambda *a: 0) is True


HOLD = """
import os, threading, time
from worker.core.os_threads import allowed_cpus, hold_interpreter_threads
stop = threading.Event()
names = ("kwe-output", "kwe-dispatch-0", "kwe-dispatch-1", "helper")
threads = [threading.Thread(target=stop.wait, name=name) for name in names]
for t in threads:
    t.start()
cpu = allowed_cpus()[-1]
held = hold_interpreter_threads(cpu, leave=("kwe-dispatch-1",))
got = {t.name: sorted(os.sched_getaffinity(t.native_id)) for t in threads}
got["main"] = sorted(os.sched_getaffinity(threading.get_native_id()))
stop.set()
print(cpu, len(held), got)
"""


@linux_only
def test_holding_puts_the_main_and_kwe_threads_on_one_cpu_and_leaves_the_others() -> None:
    import subprocess

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU here: nothing to tell held from free")
    out = subprocess.run([sys.executable, "-c", HOLD], capture_output=True, text=True, check=True,
                         cwd=ROOT).stdout.split(" ", 2)
    cpu, held, got = int(out[0]), int(out[1]), eval(out[2])
    assert held == 3  # main, kwe-output, kwe-dispatch-0
    assert got["main"] == got["kwe-output"] == got["kwe-dispatch-0"] == [cpu]
    assert got["helper"] == sorted(os.sched_getaffinity(0)), "a thread not the worker's keeps the whole set"
    assert got["kwe-dispatch-1"] == sorted(os.sched_getaffinity(0)), "one left free by name keeps it too"


def test_a_thread_that_ended_meanwhile_is_skipped() -> None:
    calls: list[int] = []

    def set_affinity(tid: int, cpus: set[int]) -> None:
        calls.append(tid)
        if len(calls) == 1:
            raise ProcessLookupError

    held = hold_interpreter_threads(0, threads=[], set_affinity=set_affinity)
    assert held == [] and calls == [threading.get_native_id()]


def test_only_threads_started_since_the_hold_on_its_cpu_alone_are_its_followers(tmp_path: Path) -> None:
    # Threads 1-7 of a process: 1 and 2 are the held ones (skipped: the hold moves them itself); 3 was
    # pinned to CPU 0 before the hold (a runtime's or an operator's: not the hold's to move); 4 runs
    # anywhere; after the hold, 5 was started by a held thread (on CPU 0 alone), 6 by an unheld one
    # (both CPUs), and 7 ended between the listing and the read.
    before = {1: {0, 1}, 2: {0, 1}, 3: {0}, 4: {0, 1}}
    now = {1: {0}, 2: {0}, 3: {0}, 4: {0, 1}, 5: {0}, 6: {0, 1}, 7: {0}}
    for tid in now:
        (tmp_path / str(tid)).mkdir()

    def get(tid: int) -> set[int]:
        if tid == 7:
            raise ProcessLookupError
        return now[tid]

    listed = thread_affinities(task_dir=str(tmp_path), get_affinity=get)
    assert listed == {tid: cpus for tid, cpus in now.items() if tid != 7}
    assert started_on(0, before, listed, skip=[1, 2]) == [5]


@linux_only
@pytest.mark.parametrize("setting", ["last CPU", "auto", "a supervisor's CPU"])
def test_a_pipeline_holds_its_poll_and_worker_threads_on_one_cpu_and_lets_the_poll_thread_go_after(
        setting: str) -> None:
    from tests.fakes.consumer import FakeGroupConsumer
    from tests.fakes.pipeline import AckingProducer, HalvesBackend, ThreeTokens
    from worker.app import wire_pipeline
    from worker.formats.messages import OutputCodec
    from worker.core.profiles import Bucket, Profile
    from worker.settings.schema import Settings

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("one CPU here: nothing to tell held from free")
    made: dict[str, Any] = {}

    class GpuBackend(HalvesBackend):
        name = "tensorrt"  # its dispatchers launch work and wait: held with the rest

    s = Settings(input_format="raw", pad_to="bucket", shutdown_timeout_s=5.0, max_queue_delay_ms=1, dispatchers=1,
                 interpreter_cpu="auto" if setting == "auto" else str(cpus[-1]))
    pipeline = wire_pipeline(s, tokenizer=ThreeTokens(), backend=GpuBackend(),
                             profile=Profile("test", (Bucket(8, 16, 16),), token_budget=256, pad_to="bucket"),
                             model_name="m", codec=OutputCodec(model="m", dim=4, encoding="float-list"),
                             consumer_factory=lambda c: made.setdefault("consumer", FakeGroupConsumer(c, records=50)),
                             producer_factory=lambda c: made.setdefault("producer", AckingProducer(c)),
                             hold=plan_hold(s.interpreter_cpu, cpu_backend=False,
                                            supervised=setting == "a supervisor's CPU", cpus=allowed_cpus()))
    seen: dict[str, list[int]] = {}

    def poll_thread() -> None:
        pipeline.run()
        seen["poll after"] = sorted(os.sched_getaffinity(0))

    runner = threading.Thread(target=poll_thread, name="poll", daemon=True)
    runner.start()
    deadline = time.monotonic() + 20
    while not {"kwe-output", "kwe-dispatch-0", "poll"} <= seen.keys() and time.monotonic() < deadline:
        for t in threading.enumerate():
            if t.name in ("kwe-output", "kwe-delivery", "kwe-dispatch-0", "poll") and t.native_id is not None:
                got = sorted(os.sched_getaffinity(t.native_id))
                if len(got) == 1:
                    seen[t.name] = got
        time.sleep(0.01)
    held = pipeline.metrics.interpreter_cpu._value.get()
    cpu, moves = pipeline.interpreter_cpu
    pipeline.request_stop()
    runner.join(20)
    assert seen.get("kwe-output") == seen.get("kwe-dispatch-0") == seen.get("poll") == [int(held)] == [cpu]
    if setting != "auto":
        assert held == cpus[-1]
    assert moves is (setting != "last CPU"), "auto's hold, and a supervisor's pick, move off a CPU another takes"
    assert seen.get("poll after") == cpus, "the poll thread was let go once the pipeline stopped"
    assert sorted(os.sched_getaffinity(0)) == cpus, "this (pytest's) thread was not held"


@linux_only
def test_run_refuses_a_cpu_outside_its_set_in_one_line_before_the_broker() -> None:
    import subprocess

    out = subprocess.run([sys.executable, "-m", "worker.cli", "run", "--interpreter-cpu", "4096",
                          "--bootstrap-servers", "127.0.0.1:9", "--log-format", "json"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT, check=False)
    assert out.returncode == 2
    cpus = ", ".join(map(str, sorted(os.sched_getaffinity(0))))
    assert (f"keyword-embedder run: setting 'interpreter_cpu': CPU 4096 is not one this process may run on ({cpus})"
            in out.stderr)


@linux_only
@pytest.mark.parametrize("setting", ["first CPU", "auto"])
def test_a_cpu_backends_dispatchers_are_left_free_and_on_auto_nothing_is_held(setting: str) -> None:
    from tests.fakes.consumer import FakeGroupConsumer
    from tests.fakes.pipeline import AckingProducer, HalvesBackend, ThreeTokens
    from worker.app import wire_pipeline
    from worker.formats.messages import OutputCodec
    from worker.core.profiles import Bucket, Profile
    from worker.settings.schema import Settings

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("one CPU here: nothing to tell held from free")
    made: dict[str, Any] = {}
    s = Settings(input_format="raw", pad_to="bucket", shutdown_timeout_s=5.0, max_queue_delay_ms=1, dispatchers=1,
                 interpreter_cpu=str(cpus[0]) if setting == "first CPU" else "auto")
    pipeline = wire_pipeline(s, tokenizer=ThreeTokens(), backend=HalvesBackend(),  # named onnxruntime: a CPU backend
                             profile=Profile("test", (Bucket(8, 16, 16),), token_budget=256, pad_to="bucket"),
                             model_name="m", codec=OutputCodec(model="m", dim=4, encoding="float-list"),
                             consumer_factory=lambda c: made.setdefault("consumer", FakeGroupConsumer(c, records=5)),
                             producer_factory=lambda c: AckingProducer(c),
                             hold=plan_hold(s.interpreter_cpu, cpu_backend=True, supervised=False, cpus=allowed_cpus()))
    runner = threading.Thread(target=pipeline.run, name="poll", daemon=True)
    runner.start()
    deadline = time.monotonic() + 20
    while not ("consumer" in made and made["consumer"].calls > 2) and time.monotonic() < deadline:
        time.sleep(0.01)  # the poll loop runs: any hold came before its first consume
    seen = {t.name: sorted(os.sched_getaffinity(t.native_id)) for t in threading.enumerate()
            if t.name in ("kwe-output", "kwe-dispatch-0", "poll") and t.native_id is not None}
    pipeline.request_stop()
    runner.join(20)
    held = [cpus[0]] if setting == "first CPU" else cpus
    assert seen.get("kwe-output") == seen.get("poll") == held, "the output and poll threads held as set"
    assert seen.get("kwe-dispatch-0") == cpus, "the CPU backend's dispatcher keeps the whole set"


@linux_only
def test_an_alternate_signal_stack_a_library_leaves_behind_is_taken_back() -> None:
    import ctypes

    from worker.core.os_threads import SS_DISABLE, _SignalStack, signal_stack, signal_stack_kept

    def body() -> tuple[Any, Any, Any]:
        before = signal_stack()
        memory = ctypes.create_string_buffer(64 * 1024)
        with signal_stack_kept():
            # What OpenVINO's CPU plugin does on the thread that compiles a model.
            libc = ctypes.CDLL(None, use_errno=True)
            assert libc.sigaltstack(ctypes.byref(_SignalStack(ctypes.addressof(memory), 0, len(memory))), None) == 0
            inside = signal_stack()
        return before, inside, signal_stack()

    before, inside, after = run_in_thread(body)
    assert before is not None and before[1] & SS_DISABLE, "a new thread has no alternate stack"
    assert inside is not None and not inside[1] & SS_DISABLE
    assert after is not None and after[1] & SS_DISABLE, "taken back: the thread has none again"


@linux_only
def test_openvino_compiling_a_model_leaves_no_alternate_signal_stack_behind_the_guard() -> None:
    ov = pytest.importorskip("openvino")
    from worker.core.os_threads import SS_DISABLE, signal_stack, signal_stack_kept

    def compile_one() -> Any:
        x = ov.opset13.parameter([4, 64], ov.Type.f32)
        compiled = ov.Core().compile_model(ov.Model([ov.opset13.relu(x)], [x]), "CPU")
        compiled.create_infer_request().infer({0: np.ones((4, 64), dtype=np.float32)})
        return compiled

    def unguarded() -> Any:
        compiled = compile_one()
        try:
            return signal_stack()
        finally:
            del compiled

    def guarded() -> Any:
        with signal_stack_kept():
            compiled = compile_one()
        try:
            return signal_stack()  # the compiled model still alive, as a chosen backend's would be
        finally:
            del compiled

    left = run_in_thread(unguarded)
    if left is None or left[1] & SS_DISABLE:
        pytest.skip("this OpenVINO installs no alternate signal stack: the guard has nothing to take back")
    after = run_in_thread(guarded)
    assert after is not None and after[1] & SS_DISABLE, f"left behind: {after}"


@pytest.mark.skipif(not hasattr(signal, "pthread_sigmask"), reason="no pthread_sigmask here")
def test_a_guarded_thread_leaves_sigterm_and_sigint_to_the_main_thread() -> None:
    seen: dict[str, set[int]] = {}

    def body() -> None:
        seen["mask"] = set(signal.pthread_sigmask(signal.SIG_BLOCK, []))

    t = threading.Thread(target=guarded(FatalLatch(), "kwe-output", body))
    t.start()
    t.join(10)
    assert {signal.SIGTERM, signal.SIGINT} <= seen["mask"]
    assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, []), "this thread's mask is its own"
