"""The default thread layout: dispatchers side by side, the cores divided among them."""

from __future__ import annotations

from worker.backend_choice.select import intra_op_threads
from worker.settings.schema import Settings


def test_zero_divides_the_cores_among_the_dispatchers() -> None:
    assert Settings().dispatchers == 2
    assert intra_op_threads(Settings(), cores=2) == 1  # this box: two single-threaded calls side by side
    assert intra_op_threads(Settings(), cores=16) == 8
    assert intra_op_threads(Settings(dispatchers=1), cores=2) == 2
    assert intra_op_threads(Settings(dispatchers=4), cores=2) == 1, "never below one thread per call"


def test_an_explicit_thread_count_is_kept() -> None:
    assert intra_op_threads(Settings(intra_op_threads=3), cores=2) == 3


def test_a_cgroup_cpu_quota_caps_the_usable_cores(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import os

    from worker.backend_choice.select import usable_cores

    affinity = len(os.sched_getaffinity(0))
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text("150000 100000\n")  # a Kubernetes limit of 1.5 CPUs
    assert usable_cores(cpu_max) == min(affinity, 2)
    cpu_max.write_text("max 100000\n")
    assert usable_cores(cpu_max) == affinity
    assert usable_cores(tmp_path / "missing") == affinity
    cpu_max.write_text("garbage\n")
    assert usable_cores(cpu_max) == affinity
