"""A CPU backend double for worker/backend_choice/auto.py: vectors derived from the token ids (the same on
every candidate, plus an optional distortion), and calls that cost a set time on a fake clock.

Single-threaded: auto.py gates and times candidates on the thread that starts the worker.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np


@dataclass
class FakeClock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


def reference_rows(ids: np.ndarray, dim: int) -> np.ndarray:
    """Unit vectors that depend only on each row's ids (what an exact fp32 backend returns)."""
    out = np.empty((len(ids), dim), dtype=np.float32)
    for i, row in enumerate(ids):
        rng = np.random.default_rng(int(row.sum()) + len(row))
        v = rng.standard_normal(dim)
        out[i] = v / np.linalg.norm(v)
    return out


@dataclass
class FakeCpuBackend:
    """`ms_per_token` per padded token on `clock`; `distort` turns reference rows into this backend's."""

    name: str
    clock: FakeClock
    ms_per_token: float = 0.1
    distort: Callable[[np.ndarray], np.ndarray] = lambda rows: rows
    dim: int = 8
    max_contexts: int | None = None
    requires_serial_dispatch: bool = False
    closed: bool = False
    calls: list[tuple[int, int]] = field(default_factory=list)

    def create_context(self, index: int) -> FakeCpuContext:
        return FakeCpuContext(self)

    def close(self) -> None:
        self.closed = True


@dataclass
class FakeCpuContext:
    backend: FakeCpuBackend

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        b = self.backend
        b.calls.append(input_ids.shape)
        b.clock.now += b.ms_per_token * input_ids.size / 1000.0
        return b.distort(reference_rows(input_ids, b.dim)).astype(np.float32)

    def close(self) -> None:
        pass
