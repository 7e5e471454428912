"""The one CPU the interpreter's threads are held on, kept up while the worker runs (`interpreter_cpu` auto).

Thread ownership: an `InterpreterHold` belongs to the poll thread (the caller of `Pipeline.run`),
which starts it and calls `check` once a turn; nothing here starts a thread or takes a lock.

Why it moves: held on one CPU the worker's Python threads spend about a quarter less CPU a keyword
(worker/core/os_threads.py), but a lone process cannot know what else its machine runs. A fixed
CPU would stack every pod of a node on CPU 0. So auto starts on the CPU the poll thread is on when
the pipeline starts (where the scheduler put it) and, once a second, reads what the kernel counts:
each CPU's busy time (/proc/stat) and the held threads' own time on the CPU
(/proc/self/task/<tid>/schedstat). The rest of the held CPU's busy time is somebody else's: another
process, or this process's unheld threads (librdkafka's). When that foreign share stays above
`HoldRule.contested` for `patience` checks in a row and another CPU carries at least `margin` less,
the threads move there. A coin decides each move, so two workers that meet on one CPU do not
swap places in step forever: one moves, the other then finds its CPU its own.

Where every CPU is as busy as the held one, the threads stay: a held thread competes for its CPU
like any other, and the lock runs one of them at a time wherever they are. `interpreter_cpu=off`
leaves them to the scheduler altogether.
"""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from worker.core.os_threads import hold_interpreter_threads, set_affinity, started_on

# Of /proc/stat's per-CPU columns (user nice system idle iowait irq softirq steal ...), those that
# are time the CPU was not free for us; guest time is already counted in user.
_BUSY_COLUMNS = (0, 1, 2, 5, 6, 7)
_IDLE_COLUMNS = (3, 4)


@dataclass(frozen=True)
class CpuTimes:
    """One CPU's counters from /proc/stat, in clock ticks since boot."""

    busy: int
    total: int


def parse_cpu_times(text: str) -> dict[int, CpuTimes]:
    """/proc/stat's per-CPU lines ("cpu0 ...", not the "cpu" total) as CpuTimes by CPU number."""
    times = {}
    for line in text.splitlines():
        if not line.startswith("cpu") or line.startswith("cpu "):
            continue
        name, *columns = line.split()
        if not name[3:].isdigit():
            continue
        ticks = [int(c) for c in columns]
        busy = sum(ticks[i] for i in _BUSY_COLUMNS if i < len(ticks))
        idle = sum(ticks[i] for i in _IDLE_COLUMNS if i < len(ticks))
        times[int(name[3:])] = CpuTimes(busy, busy + idle)
    return times


def read_cpu_times(path: str = "/proc/stat") -> dict[int, CpuTimes]:
    with open(path, encoding="ascii") as f:
        return parse_cpu_times(f.read())


def read_threads_cpu_ns(tids: Iterable[int], task_dir: str = "/proc/self/task") -> int:
    """The nanoseconds the threads `tids` have run (schedstat's first field), summed; a thread that
    ended meanwhile counts nothing."""
    spent = 0
    for tid in tids:
        try:
            with open(f"{task_dir}/{tid}/schedstat", encoding="ascii") as f:
                spent += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return spent


def foreign_loads(before: Mapping[int, CpuTimes], after: Mapping[int, CpuTimes], cpus: Iterable[int],
                  held: int, own_share: float) -> dict[int, float]:
    """Each CPU's share of the interval busy with work other than the held threads' (0..1): its busy
    share, less `own_share` (the held threads' run time over the interval) on the held CPU."""
    loads = {}
    for cpu in cpus:
        a, b = before.get(cpu), after.get(cpu)
        if a is None or b is None or b.total <= a.total:
            continue
        share = (b.busy - a.busy) / (b.total - a.total)
        if cpu == held:
            share -= own_share
        loads[cpu] = min(1.0, max(0.0, share))
    return loads


@dataclass(frozen=True)
class HoldRule:
    """When the held threads move. Shares are of one CPU over one check's interval."""

    contested: float = 0.35  # foreign work on the held CPU above which it counts as contested
    margin: float = 0.25  # how much less foreign work another CPU must carry to be worth the move
    patience: int = 2  # contested checks in a row before a move (one busy second is not a neighbour)
    interval_s: float = 1.0

    def better_cpu(self, loads: Mapping[int, float], held: int, rng: random.Random) -> int | None:
        """The CPU to move to when `held` is contested and another is clearly freer; else None.
        Among CPUs within a tenth of the least loaded one, a random one (two workers leaving one
        CPU should not pick the same next one)."""
        here = loads.get(held)
        others = {cpu: load for cpu, load in loads.items() if cpu != held}
        if here is None or not others or here < self.contested:
            return None
        least = min(others.values())
        if here - least < self.margin:
            return None
        return rng.choice(sorted(cpu for cpu, load in others.items() if load <= least + 0.1))


@dataclass(frozen=True)
class HoldPlan:
    """Where the worker's Python threads are held, decided once when the pipeline is built
    (`plan_hold`) and carried out by the pipeline's poll thread when it starts."""

    cpus: tuple[int, ...]  # the process's CPU set
    cpu: int | None  # the CPU to start on; None: the one the poll thread runs on at the start
    moves: bool  # off a CPU another process takes (auto, a supervisor's pick); False: held for good
    leave: tuple[str, ...] = ()  # threads never held (a CPU backend's dispatchers, which compute)

    def describe_moves(self) -> str:
        return "when another process takes it" if self.moves else "never (interpreter_cpu set)"


def plan_hold(setting: str, *, cpu_backend: bool, supervised: bool, cpus: list[int]) -> HoldPlan | None:
    """`interpreter_cpu` as a plan, or None: nothing held.

    A CPU number holds there: for good when the user set it, moving from there when a supervisor
    gave it (settings refuse a number with processes above 1, so a user's never reaches a child;
    two pods' supervisors that both start at CPU 0 part). Auto holds only on a backend that does
    not compute on the CPU (there the model's own threads need the cores) and on more than one
    CPU, starting where the poll thread runs. `cpu_backend`: the backend's dispatchers compute on
    the CPU, so they are left out of a hold."""
    leave = ("kwe-dispatch",) if cpu_backend else ()
    if setting.isdigit():
        return HoldPlan(tuple(cpus), int(setting), moves=supervised, leave=leave)
    if setting == "auto" and not cpu_backend and len(cpus) > 1:
        return HoldPlan(tuple(cpus), None, moves=True, leave=leave)
    return None


@dataclass
class InterpreterHold:
    """The poll thread's and the kwe-* threads' one CPU, moved when another process takes it.

    `hold(cpu)` holds the calling thread and the kwe-* threads but those named in `leave` (it raises
    OSError where the OS refuses); the readers are the kernel's counters (replaced in tests).

    Which other threads it touches: those started after the hold on its CPU alone (`threads` read
    as it starts, then at each move and at `release`: os_threads.started_on), which a held thread
    started and which inherited its CPU; they follow each move, and `release` lets them go with the
    held ones, each held thread back to its own set before the hold. Matching masks alone (every
    thread on the old CPU alone, as before) also moved threads a runtime or an operator had pinned
    there on purpose, and `release` let only the poll thread go (issue 57)."""

    cpus: list[int]
    leave: tuple[str, ...] = ()
    rule: HoldRule = field(default_factory=HoldRule)
    rng: random.Random = field(default_factory=lambda: random.Random(os.getpid()))
    hold: Callable[[int], list[int]] | None = None
    read_cpus: Callable[[], Mapping[int, CpuTimes]] = read_cpu_times
    read_own_ns: Callable[[list[int]], int] = read_threads_cpu_ns
    on_move: Callable[[int, int, Mapping[int, float]], None] | None = None
    # False: held where `start` says for good (a CPU number set by the user or a supervisor).
    adaptive: bool = True
    set_affinity: Callable[[int, set[int]], None] = set_affinity
    # Every thread of the process and its CPU set (os_threads.thread_affinities in the worker; None:
    # only the held threads move and are let go).
    threads: Callable[[], Mapping[int, set[int]]] | None = None
    cpu: int | None = None
    moves: int = 0
    followers: int = 0  # threads that followed the held ones, over every move
    _tids: list[int] = field(default_factory=list)
    # Every thread's set as the hold began (None: not read): who was there before it, and where.
    _before: dict[int, set[int]] | None = None
    _due: float = 0.0
    _last: tuple[float, Mapping[int, CpuTimes], int] | None = None
    _strikes: int = 0

    def start(self, cpu: int, now: float) -> list[int]:
        """Holds the threads on `cpu` and starts watching it; the thread IDs held. OSError: refused."""
        self._before = self._read_threads()  # first: the held threads' own sets too
        self._tids = self._hold(cpu)
        self.cpu = cpu
        if self.adaptive:  # a hold for good never reads the counters
            self._sample(now)
        return self._tids

    def check(self, now: float) -> None:
        """Once an interval: reads the counters and moves the threads where the rule says. Cheap
        (one comparison) between intervals."""
        held = self.cpu
        if now < self._due or self._last is None or held is None:  # no counters: not adaptive, or unreadable
            return
        then, cpus_before, own_before = self._last
        self._sample(now)
        if self._last is None:
            return
        _, cpus_after, own_after = self._last
        own_share = (own_after - own_before) / 1e9 / (now - then)  # now - then >= interval_s
        loads = foreign_loads(cpus_before, cpus_after, self.cpus, held, own_share)
        target = self.rule.better_cpu(loads, held, self.rng)
        if target is None:
            self._strikes = 0
            return
        self._strikes += 1
        # The coin: of two workers contesting one CPU, on average one moves first and the other
        # then finds its CPU its own (its strikes start again).
        if self._strikes < self.rule.patience or self.rng.random() < 0.5:
            return
        try:
            self._tids = self._hold(target)
        except OSError:
            # The set shrank under us (a cpuset changed): stay, and look again next interval.
            self._strikes = 0
            return
        self.moves += 1
        for tid in self._started_on(held):
            if self._set(tid, {target}):
                self.followers += 1
        # A random wait (in checks, doubling with each move, up to 32) before the next move may
        # count: two workers that left one CPU in the same second and met again do not do so in step.
        self.cpu, self._strikes = target, -self.rng.randrange(1 << min(self.moves, 5))
        self._sample(now)  # the threads' own time so far was on the old CPU
        if self.on_move is not None:
            self.on_move(held, target, loads)

    def release(self) -> None:
        """The calling thread (the poll thread, its work done), every other held thread still running
        and every thread started on the held CPU since the hold, let go: a held thread back on its own
        set before the hold, one started since on the process's whole set. A caller that goes on
        after the pipeline (a test, an embedding program) is not left with threads held."""
        held = self.cpu
        if held is None:
            return
        self.cpu, self._last = None, None
        before = self._before or {}
        whole = set(self.cpus)
        for tid in sorted({threading.get_native_id(), *self._tids}):
            self._set(tid, before.get(tid, whole))
        for tid in self._started_on(held):
            self._set(tid, whole)

    def _read_threads(self) -> dict[int, set[int]] | None:
        if self.threads is None:
            return None
        try:
            return dict(self.threads())
        except OSError:
            return None  # no thread list (no /proc): only the held threads move and are let go

    def _started_on(self, cpu: int) -> list[int]:
        """The threads started since the hold that run on `cpu` alone (the held ones aside)."""
        if self._before is None or (now := self._read_threads()) is None:
            return []
        return started_on(cpu, self._before, now, skip=self._tids)

    def _set(self, tid: int, cpus: set[int]) -> bool:
        try:
            self.set_affinity(tid, cpus)
            return True
        except OSError:
            return False  # ended meanwhile, or the set changed under us (a cpuset): left where it is

    def _hold(self, cpu: int) -> list[int]:
        if self.hold is not None:
            return self.hold(cpu)
        return hold_interpreter_threads(cpu, leave=self.leave)

    def _sample(self, now: float) -> None:
        self._due = now + self.rule.interval_s
        try:
            self._last = (now, self.read_cpus(), self.read_own_ns(self._tids))
        except (OSError, ValueError):
            self._last = None  # no counters to read (no /proc): held where it is, never moved
