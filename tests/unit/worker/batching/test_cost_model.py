"""The cost model t(B, L) = fixed + per_row*B + per_token*B*L: fitting, live refinement, calibration and its cache."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from worker.batching.calibration import SHAPES, cost_model_for, load_or_measure, measure
from worker.batching.cost_model import CostModel, CostModelError, Prices, fit

TRUE = Prices(fixed_s=0.004, per_row_s=0.0002, per_token_s=0.00004)


def samples(prices: Prices, shapes=SHAPES, noise: float = 0.0, seed: int = 0) -> list[tuple[int, int, float]]:
    rng = np.random.default_rng(seed)
    return [(b, n, prices.cost(b, n) * (1 + noise * rng.standard_normal())) for b, n in shapes]


def test_fit_recovers_the_prices_of_exact_samples() -> None:
    got = fit(samples(TRUE))
    assert got.fixed_s == pytest.approx(TRUE.fixed_s, rel=1e-6)
    assert got.per_row_s == pytest.approx(TRUE.per_row_s, rel=1e-6)
    assert got.per_token_s == pytest.approx(TRUE.per_token_s, rel=1e-6)


def test_fit_predicts_within_a_few_percent_from_noisy_samples() -> None:
    got = fit(samples(TRUE, noise=0.03))
    for b, n in ((1, 5), (8, 9), (64, 8), (128, 12)):
        assert got.cost(b, n) == pytest.approx(TRUE.cost(b, n), rel=0.08)


def test_fit_never_returns_a_negative_price() -> None:
    # Calls that get cheaper per row as batches grow would fit a negative per-row price.
    data = [(1, 8, 0.010), (2, 8, 0.0105), (8, 8, 0.012), (32, 8, 0.020), (64, 8, 0.030)]
    got = fit(data)
    assert min(got.fixed_s, got.per_row_s, got.per_token_s) >= 0
    assert got.cost(8, 8) == pytest.approx(0.012, rel=0.25)


def test_fit_needs_three_distinct_shapes() -> None:
    with pytest.raises(CostModelError, match="3"):
        fit([(1, 4, 0.01), (1, 4, 0.011), (2, 8, 0.02)])


def test_live_calls_move_the_prices_and_the_calibration_anchors_what_they_do_not_see() -> None:
    model = CostModel(samples(TRUE), refit_every=1)
    assert model.prices() == model.calibrated
    # Under load every small call costs 2.5x its idle price (issue 19's trickle): the live prices follow.
    for k in range(200):
        b, n = (1, 5) if k % 2 else (3, 9)
        model.observe(b, n, 2.5 * TRUE.cost(b, n))
    live = model.prices()
    for b, n in ((1, 5), (3, 9)):
        assert live.cost(b, n) == pytest.approx(2.5 * TRUE.cost(b, n), rel=0.15)
    # Shapes never seen live stay finite and positive (anchored by the calibration, not extrapolated wildly).
    assert 0 < live.cost(128, 12) < 10 * TRUE.cost(128, 12)
    assert model.calibrated == fit(samples(TRUE))  # the calibration itself is kept
    assert model.observed == 200


def test_live_observations_are_forgotten_so_a_quieter_box_moves_the_prices_back() -> None:
    model = CostModel(samples(TRUE), refit_every=1, forget=0.9)
    for _ in range(100):
        model.observe(2, 8, 3 * TRUE.cost(2, 8))
    slow = model.prices().cost(2, 8)
    for _ in range(100):
        model.observe(2, 8, TRUE.cost(2, 8))
    assert model.prices().cost(2, 8) == pytest.approx(TRUE.cost(2, 8), rel=0.1) and slow > 2 * TRUE.cost(2, 8)


def test_measure_times_every_shape_and_stops_at_the_budget() -> None:
    now = [0.0]
    calls: list[tuple[int, int]] = []

    def run(ids: np.ndarray, mask: np.ndarray) -> None:
        assert ids.shape == mask.shape and ids.dtype == np.int64
        calls.append(ids.shape)
        now[0] += TRUE.cost(*ids.shape)

    got = measure(run, repeats=3, budget_s=1e9, clock=lambda: now[0])
    assert [(b, n) for b, n, _ in got] == list(SHAPES)
    assert all(s == pytest.approx(TRUE.cost(b, n)) for b, n, s in got)
    assert len(calls) == 4 * len(SHAPES)  # one warm-up and three timed calls per shape

    calls.clear()
    short = measure(run, repeats=3, budget_s=0.0, clock=lambda: now[0])
    assert len(short) == len(SHAPES) and len(calls) == 2 * len(SHAPES)  # warm-up + one timed round


def test_calibration_is_cached_per_key(tmp_path: Path) -> None:
    runs = [0]

    def run(ids: np.ndarray, mask: np.ndarray) -> None:
        runs[0] += 1

    first, cached = load_or_measure(run, {"model": "m", "threads": 1}, cache_dir=tmp_path)
    assert not cached and runs[0] > 0
    n = runs[0]
    again, cached = load_or_measure(run, {"model": "m", "threads": 1}, cache_dir=tmp_path)
    assert cached and runs[0] == n and again == [tuple(s) for s in first]
    _, cached = load_or_measure(run, {"model": "m", "threads": 2}, cache_dir=tmp_path)
    assert not cached, "another thread layout must be measured, not read from the first one's cache"
    # A damaged cache file is measured again, not trusted.
    for path in tmp_path.glob("*.json"):
        path.write_text(json.dumps({"samples": [[1, 4, "x"]]}))
    _, cached = load_or_measure(run, {"model": "m", "threads": 1}, cache_dir=tmp_path)
    assert not cached


class _Ctx:
    def __init__(self, owner: "_Backend") -> None:
        self.owner = owner

    def run(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        self.owner.shapes.append(ids.shape)
        return np.zeros((ids.shape[0], 2), dtype=np.float32)

    def close(self) -> None:
        self.owner.closed += 1


class _Backend:
    name = "fake"
    dim = 2
    requires_serial_dispatch = False

    def __init__(self, max_contexts: int | None) -> None:
        self.max_contexts = max_contexts
        self.shapes: list[tuple[int, int]] = []
        self.closed = 0

    def create_context(self, index: int) -> _Ctx:
        return _Ctx(self)


def test_only_backends_whose_contexts_serve_every_bucket_are_calibrated(tmp_path: Path) -> None:
    bound = _Backend(max_contexts=5)  # TensorRT: context i = bucket i, a batch never holds two buckets
    assert cost_model_for(bound, {"k": 1}, cache_dir=tmp_path) is None and bound.shapes == []
    free = _Backend(max_contexts=None)
    model = cost_model_for(free, {"k": 1}, cache_dir=tmp_path)
    assert set(free.shapes) == set(SHAPES) and free.closed == 1
    assert model is not None and min(model.calibrated.as_dict().values()) >= 0
