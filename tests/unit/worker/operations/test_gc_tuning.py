"""The garbage collector set for the steady state (worker/operations/gc_tuning.py): what is alive at
the call frozen, the young generation collected far less often."""

from __future__ import annotations

import gc

from worker.operations.gc_tuning import OLDER_THRESHOLDS, YOUNG_THRESHOLD, settle_for_steady_state


def test_start_up_objects_are_frozen_and_the_thresholds_raised() -> None:
    before = gc.get_threshold()
    kept = [object() for _ in range(100)]
    try:
        gc.unfreeze()
        settle_for_steady_state()
        assert gc.get_threshold() == (YOUNG_THRESHOLD, *OLDER_THRESHOLDS)
        assert gc.get_freeze_count() >= len(kept)
        assert YOUNG_THRESHOLD > before[0]
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
