"""What every family's check measures against its reference: the row cosines and norms, and the bounds."""

from __future__ import annotations

import numpy as np

MIN_COS = 0.9999
# Norms against float32 references (the fixtures): float32 arithmetic in another order stays
# near 1e-6; a normalisation added or left out is off by far more.
NORM_TOL = 1e-4


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def norm_error(got: np.ndarray, expected: np.ndarray) -> float:
    """The worst row's |norm / reference norm - 1|."""
    return float(np.abs(np.linalg.norm(got, axis=1) / np.linalg.norm(expected, axis=1) - 1.0).max())
