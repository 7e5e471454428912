"""Open-loop load: Poisson arrivals at a fixed rate through the worker's bucketer, latency percentiles."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from worker.backends.base import Backend
from worker.benchmark.errors import BenchError
from worker.benchmark.policies import BucketerHarness, BucketerOptions
from worker.core.profiles import Profile
from worker.intake.tokenize import Encoded


@dataclass
class LatencyLevel:
    load: float  # fraction of the bucketed peak rate
    offered_per_s: float
    achieved_per_s: float
    n: int
    p50_ms: float
    p95_ms: float
    p99_ms: float
    max_ms: float
    mean_batch: float
    padding_waste: float


def poisson_arrivals(rate: float, seconds: float, seed: int) -> np.ndarray:
    """Arrival times (s from the start) of a Poisson process at `rate`/s over `seconds`."""
    rng = random.Random(seed)
    arrivals: list[float] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            return np.asarray(arrivals)
        arrivals.append(t)


def run_open_loop(encoded: Sequence[Encoded], profile: Profile, backend: Backend, *, rate: float,
                  seconds: float, options: BucketerOptions = BucketerOptions(), seed: int = 0, load: float = 0.0,
                  warmup_fraction: float = 0.1) -> LatencyLevel:
    """Open-loop Poisson arrivals at `rate`/s for `seconds`; latency from arrival to embedding.

    Arrival times are drawn up front; the feeder sleeps until each one and submits. Latency is
    counted from the *scheduled* arrival, so a feeder running late is charged to the system,
    not hidden (no coordinated omission). Items arriving in the first `warmup_fraction` of the
    run are left out of the percentiles. Keywords are taken in file order, cycling.
    """
    arrivals = poisson_arrivals(rate, seconds, seed)
    n = len(arrivals)
    done_at = np.zeros(n)
    finished = threading.Event()
    remaining = [n]
    lock = threading.Lock()

    def settle(seqs: Sequence[int], now: float) -> None:
        done_at[list(seqs)] = now
        with lock:
            remaining[0] -= len(seqs)
            if remaining[0] == 0:
                finished.set()

    harness = BucketerHarness(profile, backend, options, settle)
    harness.bucketer.start()
    start = time.perf_counter()
    try:
        for i, at in enumerate(arrivals):
            delay = start + at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            harness.bucketer.submit(i, encoded[i % len(encoded)].ids)
        # Open loop: the system gets until the arrivals end plus a generous tail to finish.
        finished.wait(max(30.0, seconds * 3))
    finally:
        dropped = harness.bucketer.stop(drain=False)
    if harness.errors:
        raise BenchError(f"latency run at {rate:.0f}/s: {len(harness.errors)} batches failed "
                         f"(first: {harness.errors[0]!r})")
    if dropped or not finished.is_set():
        raise BenchError(f"latency run at {rate:.0f}/s did not finish: {remaining[0]} items left "
                         "(the offered load is above what the backend sustains)")
    end = float(done_at.max()) - start
    lat = (done_at - start - arrivals) * 1000.0
    keep = lat[arrivals >= seconds * warmup_fraction]
    p50, p95, p99 = np.percentile(keep, [50, 95, 99])
    _, real, padded = harness.totals()
    return LatencyLevel(load=load, offered_per_s=rate, achieved_per_s=n / end, n=len(keep), p50_ms=float(p50),
                        p95_ms=float(p95), p99_ms=float(p99), max_ms=float(keep.max()),
                        mean_batch=n / max(1, len(harness.stats)),
                        padding_waste=1.0 - real / padded if padded else 0.0)
