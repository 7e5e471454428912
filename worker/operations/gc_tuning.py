"""The garbage collector, set for a long-running worker once its start-up is done.

A worker allocates a few short-lived containers per keyword; CPython's collector then runs a
young collection every ~700 allocations and, every few of those, an older one that walks every
object start-up left behind (modules, the model's metadata, the tokenizer, the caches): on the
broker-free host path (benchmarks/host/) that was about a tenth of the worker's CPU per keyword.
So at the start of the run: everything alive is frozen (never scanned again; what dies of its
refcount is still freed) and the young generation is collected every 20,000 allocations instead
of 700 (the per-keyword containers die by refcount, not in cycles, so little waits longer).
Measured there: CPU per keyword 18.2 us with both, 20.1 with the freeze alone, 22.5 without
(median of 3 alternating runs; docs/performance.md, The host path).
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 20_000
OLDER_THRESHOLDS = (50, 100)


def settle_for_steady_state() -> None:
    """Called once, when start-up has built everything the worker keeps and before the first record."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, *OLDER_THRESHOLDS)
