"""What one backend call costs: t(B, L) = fixed + per_row * B + per_token * B * L, fitted and refined live.

The batching policy (worker/batching/batch_policy.py) prices a batch with it to decide whether two length
buckets should run as one call or two. The seeds' measurement: this three-term model predicted
five batching schedules within 2% over 41 paired rounds; B is the rows, L the padded length.

- `fit` solves the weighted least squares problem from sufficient statistics, with every
  coefficient kept >= 0 (a negative fixed cost or per-token price would make the policy merge or
  split for no reason).
- `CostModel` starts from the prices `calibrate` measured on an idle context at start-up (a
  fixed grid of shapes, bounded in time and cached per model, backend, thread layout and
  machine: worker/batching/calibration.py) and refines them from every live call. The calibration stays
  in the fit as a prior worth one live call, so the per-token price stays anchored
  under a trickle where live calls are all small; live calls are forgotten exponentially, so a
  box that gets busier moves the prices within some tens of calls.

Threads: `observe` is called by the bucketer's dispatcher threads, `prices` by its former
thread and by the metrics scrape; one lock guards the statistics and the current prices.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from worker.core.errors import KeywordEmbedderError

# Features are scaled so that the 3x3 normal equations are well conditioned for B up to a few
# hundred and B*L up to the token budget.
_SCALE = np.array([1.0, 1.0 / 64.0, 1.0 / 1024.0])


@dataclass(frozen=True)
class Prices:
    """Seconds per call, per row and per padded token (row x position)."""

    fixed_s: float
    per_row_s: float
    per_token_s: float

    def cost(self, rows: int, length: int) -> float:
        return self.fixed_s + self.per_row_s * rows + self.per_token_s * rows * length

    def as_dict(self) -> dict[str, float]:
        return {"fixed_s": self.fixed_s, "per_row_s": self.per_row_s, "per_token_s": self.per_token_s}


Sample = tuple[int, int, float]  # (rows, padded length, seconds)


def _features(rows: int, length: int) -> np.ndarray:
    return np.array([1.0, float(rows), float(rows) * float(length)]) * _SCALE


@dataclass
class _Stats:
    """Weighted normal equations: sum w x x^T, sum w x y, sum w y^2, and how many samples (decayed).

    Each sample is weighted by 1/y^2: the fit minimises *relative* error, so a 4 ms call counts as
    much as a 200 ms one (the merge decisions are made between small calls; an absolute fit
    would let the largest shapes set every price).
    """

    xx: np.ndarray
    xy: np.ndarray
    yy: float = 0.0
    weight: float = 0.0

    @classmethod
    def empty(cls) -> _Stats:
        return cls(np.zeros((3, 3)), np.zeros(3))

    def add(self, rows: int, length: int, seconds: float) -> None:
        x = _features(rows, length)
        w = 1.0 / (seconds * seconds)
        self.xx += w * np.outer(x, x)
        self.xy += w * x * seconds
        self.yy += w * seconds * seconds
        self.weight += 1.0

    def scaled(self, factor: float) -> _Stats:
        return _Stats(self.xx * factor, self.xy * factor, self.yy * factor, self.weight * factor)

    def __add__(self, other: _Stats) -> _Stats:
        return _Stats(self.xx + other.xx, self.xy + other.xy, self.yy + other.yy, self.weight + other.weight)


class CostModelError(KeywordEmbedderError, ValueError):
    """Too few or degenerate samples to fit the three prices."""


def _solve(stats: _Stats) -> Prices:
    """Non-negative least squares over the three coefficients (exhaustive over the 7 supports)."""
    best: tuple[float, np.ndarray] | None = None
    for k in (3, 2, 1):
        for support in itertools.combinations(range(3), k):
            idx = list(support)
            a = stats.xx[np.ix_(idx, idx)]
            try:
                sub = np.linalg.solve(a + 1e-12 * np.eye(k), stats.xy[idx])
            except np.linalg.LinAlgError:
                continue
            if (sub < 0).any():
                continue
            theta = np.zeros(3)
            theta[idx] = sub
            residual = stats.yy - 2 * theta @ stats.xy + theta @ stats.xx @ theta
            if best is None or residual < best[0] - 1e-18:
                best = (residual, theta)
        if best is not None and k == 3:
            break  # the unconstrained fit is already non-negative
    if best is None:
        raise CostModelError("cannot fit the cost model: no non-negative solution")
    coef = best[1] * _SCALE
    return Prices(float(coef[0]), float(coef[1]), float(coef[2]))


def fit(samples: Iterable[Sample]) -> Prices:
    """The non-negative least-squares prices of (rows, length, seconds) samples."""
    stats = _Stats.empty()
    shapes = set()
    for rows, length, seconds in samples:
        if seconds <= 0:
            raise CostModelError(f"a call of {rows} x {length} took {seconds} s; timings must be > 0")
        stats.add(rows, length, seconds)
        shapes.add((rows, rows * length))
    if len(shapes) < 3:
        raise CostModelError(f"cannot fit the cost model from {len(shapes)} distinct shapes; it needs 3")
    return _solve(stats)


class CostModel:
    """Prices that start from a calibration and follow the live calls."""

    def __init__(self, calibration: Sequence[Sample], *, prior_weight: float = 1.0, forget: float = 0.98,
                 refit_every: int = 8) -> None:
        if not 0.0 < forget < 1.0:
            raise ValueError(f"forget must be in (0, 1), got {forget}")
        self.calibrated = fit(calibration)
        prior = _Stats.empty()
        for rows, length, seconds in calibration:
            prior.add(rows, length, seconds)  # fit() above has checked every timing
        # The calibration counts as `prior_weight` observations in all, whatever its size.
        self._prior = prior.scaled(prior_weight / max(1.0, prior.weight))
        self._live = _Stats.empty()
        self._forget = forget
        self._refit_every = refit_every
        self._since_fit = 0
        self._observed = 0
        self._lock = threading.Lock()
        self._prices = self.calibrated

    def observe(self, rows: int, length: int, seconds: float) -> None:
        """One live call (dispatcher threads)."""
        if rows <= 0 or seconds <= 0:
            return
        with self._lock:
            self._live = self._live.scaled(self._forget)
            self._live.add(rows, length, seconds)
            self._observed += 1
            self._since_fit += 1
            if self._since_fit < self._refit_every:
                return
            self._since_fit = 0
            try:
                self._prices = _solve(self._prior + self._live)
            except CostModelError:
                pass  # keep the last good prices

    def prices(self) -> Prices:
        with self._lock:
            return self._prices

    @property
    def observed(self) -> int:
        with self._lock:
            return self._observed
