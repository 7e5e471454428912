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
