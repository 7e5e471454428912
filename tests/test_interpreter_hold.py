"""interpreter_cpu auto: the held CPU is watched, and the interpreter's threads move when another
process takes it (worker/core/interpreter_hold.py). The rule and the move on counters a test
makes; then once on the kernel's own counters, with a real process spinning on the held CPU."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Mapping

import pytest

from worker.core.interpreter_hold import CpuTimes, HoldRule, InterpreterHold, foreign_loads, parse_cpu_times
from worker.core.os_threads import move_threads_held_on

linux_only = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs sched_setaffinity (Linux)")

STAT = """cpu  100 0 50 1000 10 0 5 3 0 0
cpu0 60 0 30 400 5 0 3 2 0 0
cpu1 40 0 20 600 5 0 2 1 0 0
intr 12345
ctxt 999
"""


class Heads(random.Random):
    """A coin that always says move, and picks the first of equal CPUs."""

    def random(self) -> float:
        return 0.99

    def choice(self, seq):  # type: ignore[no-untyped-def,override]
        return seq[0]


def test_proc_stat_gives_each_cpus_busy_and_total_ticks() -> None:
    times = parse_cpu_times(STAT)
    # busy: user nice system irq softirq steal; idle: idle iowait
    assert times == {0: CpuTimes(busy=95, total=500), 1: CpuTimes(busy=63, total=668)}


def test_the_held_threads_own_time_is_not_counted_against_their_cpu() -> None:
    before = {0: CpuTimes(0, 0), 1: CpuTimes(0, 0)}
    after = {0: CpuTimes(90, 100), 1: CpuTimes(30, 100)}
    loads = foreign_loads(before, after, [0, 1], held=0, own_share=0.8)
    assert loads == pytest.approx({0: 0.1, 1: 0.3})


@pytest.mark.parametrize(("loads", "expected"), [
    ({0: 0.9, 1: 0.1}, 1),          # a neighbour on the held CPU, the other free: move
    ({0: 0.9, 1: 0.8}, None),       # every CPU as busy: stay
    ({0: 0.3, 1: 0.0}, None),       # below `contested`: a little foreign work is not a neighbour
    ({0: 0.9, 1: 0.7, 2: 0.2, 3: 0.25}, 2),  # the freest; 3 is within a tenth of it too
    ({0: 0.9}, None),               # nowhere else to go
])
def test_the_rule_moves_only_off_a_contested_cpu_onto_a_clearly_freer_one(loads: dict[int, float],
                                                                          expected: int | None) -> None:
    assert HoldRule().better_cpu(loads, 0, Heads()) == expected
    if expected == 2:
        picks = {HoldRule().better_cpu(loads, 0, random.Random(seed)) for seed in range(40)}
        assert picks == {2, 3}, "near-equal CPUs are picked at random, so two leaving workers part"


class Machine:
    """Two or more CPUs and some workers, each wanting `want` of a CPU for its held threads, plus
    fixed foreign load per CPU. One step is one second; CPU shares are split fairly."""

    def __init__(self, cpus: int, foreign: Mapping[int, float] | None = None) -> None:
        self.cpus = list(range(cpus))
        self.foreign = dict(foreign or {})
        self.busy = {c: 0.0 for c in self.cpus}
        self.total = {c: 0.0 for c in self.cpus}
        self.own: dict[str, float] = {}
        self.where: dict[str, int] = {}
        self.want: dict[str, float] = {}

    def add(self, name: str, want: float) -> None:
        self.want[name], self.own[name] = want, 0.0

    def step(self) -> None:
        for c in self.cpus:
            here = [w for w, cpu in self.where.items() if cpu == c]
            demand = self.foreign.get(c, 0.0) + sum(self.want[w] for w in here)
            scale = min(1.0, 1.0 / demand) if demand else 1.0
            for w in here:
                self.own[w] += self.want[w] * scale
            self.busy[c] += min(1.0, demand)
            self.total[c] += 1.0

    def stat(self) -> dict[int, CpuTimes]:
        return {c: CpuTimes(round(self.busy[c] * 100), round(self.total[c] * 100)) for c in self.cpus}

    def hold_for(self, name: str, seed: int) -> InterpreterHold:
        def hold(cpu: int) -> list[int]:
            self.where[name] = cpu
            return [1]
        return InterpreterHold(self.cpus, rng=random.Random(seed), hold=hold, read_cpus=self.stat,
                               read_own_ns=lambda tids: round(self.own[name] * 1e9))


def test_a_neighbour_that_takes_the_held_cpu_moves_the_threads_after_patience_checks() -> None:
    machine = Machine(2)
    machine.add("worker", 0.8)
    moved: list[tuple[int, int]] = []
    hold = machine.hold_for("worker", seed=1)
    hold.rng = Heads()
    hold.on_move = lambda old, new, loads: moved.append((old, new))
    hold.start(0, now=0.0)
    for second in range(1, 6):  # alone: its own work on CPU 0 is no reason to move
        machine.step()
        hold.check(float(second))
    assert hold.cpu == 0 and not moved
    machine.foreign[0] = 1.0  # a neighbour spins on CPU 0
    machine.step()
    hold.check(6.0)
    assert hold.cpu == 0, "one contested second is not enough"
    machine.step()
    hold.check(7.0)
    assert (hold.cpu, moved, hold.moves) == (1, [(0, 1)], 1)
    for second in range(8, 20):  # now alone on CPU 1: stays
        machine.step()
        hold.check(float(second))
    assert hold.cpu == 1 and hold.moves == 1


def test_between_checks_nothing_is_read() -> None:
    reads: list[int] = []
    hold = InterpreterHold([0, 1], hold=lambda cpu: [1], read_cpus=lambda: reads.append(1) or {},
                           read_own_ns=lambda tids: 0)
    hold.start(0, now=10.0)
    for t in (10.1, 10.5, 10.99):
        hold.check(t)
    assert len(reads) == 1
    hold.check(11.0)
    assert len(reads) == 2


@pytest.mark.parametrize("seed", range(20))
def test_two_workers_that_start_on_one_cpu_part_and_then_stay(seed: int) -> None:
    machine = Machine(2, foreign={1: 0.1})
    holds = {}
    for i, name in enumerate(("a", "b")):
        machine.add(name, 0.8)
        holds[name] = machine.hold_for(name, seed=seed * 7 + i)
        holds[name].start(0, now=0.0)
    for second in range(1, 40):
        machine.step()
        for name in ("a", "b"):
            holds[name].check(float(second))
    assert machine.where["a"] != machine.where["b"], "two workers left stacked on one CPU"
    moves = holds["a"].moves + holds["b"].moves
    # Checked in the same second every time (the worst case: real ones drift apart), without the
    # coin and the wait after a move they swap places every second check, ~38 moves here.
    assert moves <= 7, f"{moves} moves: the two swap places instead of parting"
    for second in range(40, 100):
        machine.step()
        for name in ("a", "b"):
            holds[name].check(float(second))
    assert holds["a"].moves + holds["b"].moves == moves, "parted workers moved again"


def test_where_every_cpu_is_busy_the_threads_stay() -> None:
    machine = Machine(4, foreign={0: 0.9, 1: 0.9, 2: 0.8, 3: 0.85})
    machine.add("worker", 0.5)
    hold = machine.hold_for("worker", seed=3)
    hold.rng = Heads()
    hold.start(0, now=0.0)
    for second in range(1, 30):
        machine.step()
        hold.check(float(second))
    assert hold.moves == 0


def test_a_fixed_hold_never_moves_and_a_refused_move_stays_put() -> None:
    machine = Machine(2, foreign={0: 1.0})
    machine.add("worker", 0.5)
    fixed = machine.hold_for("worker", seed=0)
    fixed.adaptive, fixed.rng = False, Heads()
    fixed.start(0, now=0.0)
    for second in range(1, 10):
        machine.step()
        fixed.check(float(second))
    assert fixed.cpu == 0 and fixed.moves == 0

    calls: list[int] = []

    def refuse_moves(cpu: int) -> list[int]:
        calls.append(cpu)
        if len(calls) > 1:
            raise OSError("cpuset changed")
        machine.where["worker"] = cpu
        return [1]
    hold = InterpreterHold([0, 1], rng=Heads(), hold=refuse_moves, read_cpus=machine.stat,
                           read_own_ns=lambda tids: round(machine.own["worker"] * 1e9))
    hold.start(0, now=100.0)
    for second in range(101, 106):
        machine.step()
        hold.check(float(second))
    assert hold.cpu == 0 and hold.moves == 0 and len(calls) > 2, "tried, was refused, and went on held where it was"


def test_without_counters_the_threads_stay_held_where_they_are() -> None:
    def no_proc() -> dict[int, CpuTimes]:
        raise FileNotFoundError("/proc/stat")
    held: list[int] = []
    hold = InterpreterHold([0, 1], hold=lambda cpu: held.append(cpu) or [1], read_cpus=no_proc,
                           read_own_ns=lambda tids: 0)
    hold.start(1, now=0.0)
    for t in range(1, 5):
        hold.check(float(t))
    assert held == [1] and hold.cpu == 1


def test_counters_that_stop_being_readable_mid_run_leave_the_threads_held_where_they_are() -> None:
    machine = Machine(2, foreign={0: 1.0})
    machine.add("worker", 0.5)
    hold = machine.hold_for("worker", seed=0)
    hold.rng = Heads()
    readable = [True]

    def stat() -> dict[int, CpuTimes]:
        if not readable[0]:
            raise PermissionError("/proc/stat")
        return machine.stat()
    hold.read_cpus = stat
    hold.start(0, now=0.0)
    machine.step()
    hold.check(1.0)  # contested once
    readable[0] = False
    for second in range(2, 8):  # the poll thread calls on: no error reaches it, and no move
        machine.step()
        hold.check(float(second))
    assert hold.cpu == 0 and hold.moves == 0 and machine.where["worker"] == 0


@linux_only
def test_threads_started_after_the_hold_follow_a_move_and_nothing_follows_without_one() -> None:
    machine = Machine(2)
    machine.add("worker", 0.8)
    follows: list[tuple[int, int, list[int]]] = []

    def follow(old: int, new: int, held: list[int]) -> int:
        follows.append((old, new, held))
        return 3

    hold = machine.hold_for("worker", seed=1)
    hold.rng, hold.follow = Heads(), follow
    hold.start(0, now=0.0)
    for second in range(1, 4):
        machine.step()
        hold.check(float(second))
    assert follows == [] and hold.followers == 0
    machine.foreign[0] = 1.0
    for second in range(4, 6):
        machine.step()
        hold.check(float(second))
    assert hold.cpu == 1 and follows == [(0, 1, hold._tids)] and hold.followers == 3

    def unreadable(old: int, new: int, held: list[int]) -> int:
        raise OSError("no /proc")

    hold.follow = unreadable
    machine.foreign[1], machine.foreign[0] = 1.0, 0.0
    for second in range(6, 60):
        machine.step()
        hold.check(float(second))
        if hold.cpu == 0:
            break
    assert hold.cpu == 0 and hold.moves == 2 and hold.followers == 3  # the move stands; the rest stayed


def test_a_process_spinning_on_the_held_cpu_moves_the_threads_on_the_kernels_own_counters() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("one CPU here: nowhere to move to")
    quiet = threading.Event()
    ready = threading.Event()
    tid: list[int] = []

    def interpreter_thread() -> None:  # stands for the worker's held threads, idle
        tid.append(threading.get_native_id())
        ready.set()
        quiet.wait(30)

    thread = threading.Thread(target=interpreter_thread, name="held", daemon=True)
    thread.start()
    ready.wait(5)
    follower_tid: list[int] = []
    follower_ready = threading.Event()

    def follower() -> None:  # started by a held thread after the hold: a renewed producer's librdkafka thread
        follower_tid.append(threading.get_native_id())
        follower_ready.set()
        quiet.wait(30)

    def hold(cpu: int) -> list[int]:
        os.sched_setaffinity(tid[0], {cpu})
        return list(tid)

    start = cpus[0]
    spin = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{start}}})\nwhile True: pass"])
    moved: list[tuple[int, int]] = []
    held = InterpreterHold(cpus, rule=HoldRule(interval_s=0.25), rng=Heads(), hold=hold,
                           on_move=lambda old, new, loads: moved.append((old, new)),
                           follow=lambda old, new, tids: move_threads_held_on(old, new, skip=tids))
    try:
        time.sleep(0.3)  # the spinner runs
        held.start(start, now=time.monotonic())
        os.sched_setaffinity(0, {start})  # this thread starts the follower as a held thread would
        threading.Thread(target=follower, name="follower", daemon=True).start()
        os.sched_setaffinity(0, set(cpus))
        follower_ready.wait(5)
        assert os.sched_getaffinity(follower_tid[0]) == {start}
        deadline = time.monotonic() + 15
        while held.cpu == start and time.monotonic() < deadline:
            time.sleep(0.05)
            held.check(time.monotonic())
    finally:
        spin.kill()
        spin.wait()
        quiet.set()
    assert moved and moved[0][0] == start and held.cpu != start, "held on the CPU another process spins on"
    assert os.sched_getaffinity(tid[0]) == {held.cpu}
    assert os.sched_getaffinity(follower_tid[0]) == {held.cpu}, "a thread started held stayed on the CPU left"
    assert held.followers == 1 and os.sched_getaffinity(0) == set(cpus)  # nothing else of this process moved
    thread.join(5)
