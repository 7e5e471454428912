"""What one dispatched batch measured: written by the bucketer, read by the metrics (series per
bucket bound) and the offline benchmark; below both, so neither imports the other for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class BatchStats:
    """Per-batch measurements: what Metrics.observe_batch and the benchmark read."""

    bucket: int
    bound: int
    size: int
    pad_len: int
    real_tokens: int
    padded_tokens: int
    queue_wait_s: Sequence[float]  # per item: submit -> dispatch start
    backend_s: float
    merged: int = 1  # length buckets whose items share this batch (worker/batching/batch_policy.py)

    @property
    def padding_waste(self) -> float:
        return 1.0 - self.real_tokens / self.padded_tokens if self.padded_tokens else 0.0
