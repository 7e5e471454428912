"""Measure t(B, L) of a backend at start-up, bounded in time, and cache it per model, backend, layout and machine.

The worker calls `cost_model_for` once before it starts consuming: the first start on a machine
times a fixed grid of shapes on an idle context (about a second on 2 cores), later starts read
the cached samples. The key holds everything that changes a call's price: the model's files,
the backend and its precision, the thread layout (intra-op threads, spinning, dispatchers), the
CPU and the ONNX Runtime version. Live calls refine the prices afterwards (worker/batching/cost_model.py).

Only backends whose contexts all serve every bucket (ONNX Runtime: `max_contexts is None`) are
calibrated: where context i is bound to bucket profile i (TensorRT), a batch can never hold two
buckets, so there is nothing to decide.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import structlog

from worker.batching.cost_model import CostModel, CostModelError, Sample, fit
from worker.core.disk_cache import cache_dir, key_of, read_or_measure

log = structlog.get_logger(__name__)

# Rows and padded lengths that cover where the merge decisions are made (a trickle: 1-16 rows of
# 3-16 tokens) and enough of a backlog's shapes to anchor the per-token price.
SHAPES: tuple[tuple[int, int], ...] = ((1, 4), (1, 12), (2, 8), (4, 6), (4, 14), (8, 8), (16, 5), (16, 12),
                                       (32, 8), (64, 6))
REPEATS = 5
BUDGET_S = 4.0
# Bump when the grid or the way it is timed changes: old caches are then ignored.
VERSION = 1

Run = Callable[[np.ndarray, np.ndarray], Any]


def measure(run: Run, shapes: Sequence[tuple[int, int]] = SHAPES, *, repeats: int = REPEATS,
            budget_s: float = BUDGET_S, clock: Callable[[], float] = time.perf_counter,
            vocab_size: int | None = None) -> list[Sample]:
    """Median seconds of `repeats` calls per shape, after one warm-up call each; stops at the budget.

    Shapes are timed in rounds (every shape once, then again), so a burst of load elsewhere
    on the box lands on several shapes a little rather than on one shape entirely. The token IDs
    are BERT's [CLS] x [SEP] (the price does not depend on them), kept below `vocab_size` for a
    model with a smaller vocabulary (a tiny test model's 320 tokens).
    """
    top = (vocab_size or 1 << 62) - 1
    feeds = []
    for rows, length in shapes:
        ids = np.full((rows, length), min(1000, top), dtype=np.int64)
        ids[:, 0], ids[:, -1] = min(101, top), min(102, top)
        feeds.append((rows, length, ids, np.ones_like(ids)))
    start = clock()
    for _, _, ids, mask in feeds:
        run(ids, mask)
    times: list[list[float]] = [[] for _ in feeds]
    for _ in range(repeats):
        for k, (_, _, ids, mask) in enumerate(feeds):
            if clock() - start > budget_s and all(times[j] for j in range(len(feeds))):
                break
            t0 = clock()
            run(ids, mask)
            times[k].append(clock() - t0)
    return [(rows, length, float(np.median(ts))) for (rows, length, _, _), ts in zip(feeds, times) if ts]


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), for cache keys and the kwe_backend_info label."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_key(parts: dict[str, Any]) -> str:
    """A file name for these key parts (plus the machine's CPU, ONNX Runtime and the grid version)."""
    try:
        import onnxruntime

        ort_version = onnxruntime.__version__
    except ImportError:
        ort_version = "-"
    full = {**parts, "cpu": cpu_model(), "cores": os.cpu_count(), "ort": ort_version, "version": VERSION,
            "shapes": SHAPES, "repeats": REPEATS}
    return key_of(full)


def default_cache_dir() -> Path:
    return cache_dir("cost-models")


def _parse_samples(data: Any) -> list[Sample]:
    samples = [(int(r), int(n), float(s)) for r, n, s in data["samples"]]
    fit(samples)  # a file whose samples cannot be fitted is measured again
    return samples


def load_or_measure(run: Run, key_parts: dict[str, Any], *, cache_dir: Path | None = None,
                    remeasure: bool = False, vocab_size: int | None = None) -> tuple[list[Sample], bool]:
    """(samples, from_cache): the cached samples for this key, or fresh ones (then cached)."""
    path = (cache_dir or default_cache_dir()) / f"{cache_key(key_parts)}.json"
    return read_or_measure(path, _parse_samples, lambda: measure(run, vocab_size=vocab_size),
                           lambda samples: {"key": key_parts, "samples": samples},
                           what="cost model", remeasure=remeasure)


def backend_key(backend: Any, key_parts: dict[str, Any]) -> dict[str, Any]:
    """The cache key parts of this backend: its kind (the class, so a test double never shares a real
    backend's cache), its output size, and what the caller says changes a call's price."""
    kind = f"{type(backend).__module__}.{type(backend).__qualname__}"
    return {"backend": backend.name, "class": kind, "dim": backend.dim, **key_parts}


def cost_model_for(backend: Any, key_parts: dict[str, Any], *, cache_dir: Path | None = None,
                   vocab_size: int | None = None) -> CostModel | None:
    """The backend's calibrated cost model, or None where batches cannot merge buckets (or it cannot be measured)."""
    if backend.max_contexts is not None:
        return None
    ctx = backend.create_context(0)
    t0 = time.monotonic()
    try:
        samples, cached = load_or_measure(ctx.run, backend_key(backend, key_parts), cache_dir=cache_dir,
                                          vocab_size=vocab_size)
        model = CostModel(samples)
    except (CostModelError, ValueError) as exc:
        log.warning("cost model not fitted; length buckets are not merged", error=str(exc))
        return None
    finally:
        ctx.close()
    p = model.calibrated
    log.info("cost model", cached=cached, seconds=round(time.monotonic() - t0, 2),
             fixed_ms=round(1000 * p.fixed_s, 3), per_row_ms=round(1000 * p.per_row_s, 4),
             per_token_ms=round(1000 * p.per_token_s, 5))
    return model
