"""benchmarks/plots.py draws every plot from the committed benchmark JSONs, and the PNGs committed
under docs/img/ are what it draws now, pixel for pixel (a JSON rewritten by a benchmark rerun
without `make plots` fails here). Headless, a few seconds."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread

from benchmarks.plots import OUT, PLOTS, RESULTS, make


def test_every_plot_is_drawn_from_the_committed_jsons_and_matches_the_committed_png(tmp_path: Path) -> None:
    made, waiting = make(PLOTS, RESULTS, tmp_path)
    ready = [p for p in PLOTS if all((RESULTS / s).is_file() for s in p.sources)]
    assert sorted(m.name for m in made) == sorted(p.name for p in ready)
    assert all(p.waiting_for for p in PLOTS if p not in ready), "a plot without its JSON must say what it waits for"
    assert len(waiting) == len(PLOTS) - len(ready)
    for path in made:
        committed = OUT / path.name
        assert committed.is_file(), f"docs/img/{path.name} is not committed: run `make plots`"
        drawn, kept = imread(path), imread(committed)
        assert drawn.shape == kept.shape and np.array_equal(drawn, kept), (
            f"docs/img/{path.name} is not what benchmarks/plots.py draws from its JSON now: run `make plots`")
    # No committed picture that the script does not make (a renamed plot leaves none behind).
    assert sorted(p.name for p in OUT.glob("*.png")) == sorted(m.name for m in made)


def test_the_plots_that_wait_for_other_work_are_drawn_once_their_jsons_exist(tmp_path: Path) -> None:
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results, ignore=shutil.ignore_patterns("gpu"))
    latency = RESULTS / "latency" / "kafka_latency.json"
    (results / "latency" / "kafka_latency_curve.json").write_bytes(latency.read_bytes())
    for name, median in (("backends_offline.json", 2.6), ("backends_kafka.json", 2.1)):
        ab = {"label": name.split("_")[1].removesuffix(".json"),
              "ratio_new_over_old": {"median": median, "q1": median - 0.1, "q3": median + 0.1}}
        (results / "backends" / name).write_text(json.dumps(ab), encoding="utf-8")
    made, waiting = make(PLOTS, results, tmp_path / "img")
    assert waiting == []
    assert sorted(m.name for m in made) == sorted(p.name for p in PLOTS)
    assert all(imread(m).shape[:2] == (400, 800) for m in made)


def test_a_plot_that_waits_for_nothing_fails_without_its_json(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="bucketing.json"):
        make([p for p in PLOTS if p.name == "bucketing.png"], tmp_path, tmp_path / "img")
