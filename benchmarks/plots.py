"""The documentation's plots, made from the committed benchmark JSONs under benchmarks/results/.

    .venv/bin/python -m benchmarks.plots            # or: make plots; then commit docs/img/
    .venv/bin/python -m benchmarks.plots --results DIR --out DIR

A rerun of a benchmark rewrites its JSON; rerunning this script redraws its picture.
tests/unit/benchmarks/test_plots.py runs it on the committed JSONs and fails when a committed PNG is not what it
draws now (pixel for pixel, with the pinned matplotlib), so a picture never drifts from its data.

Each plot in PLOTS names the JSONs it is drawn from. A plot whose `waiting_for` is set belongs to
work still in progress: it is drawn once all its JSONs exist, and until then the script says what
it waits for and the documentation shows a marked slot instead.

Headless (matplotlib's Agg backend), fixed size and resolution, no timestamp in the PNG.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from worker.benchmark.report import quartiles  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
OUT = ROOT / "docs" / "img"
SIZE = (8.0, 4.0)  # inches
DPI = 100
BLUE, GREY, ORANGE, GREEN = "#1f77b4", "#7f7f7f", "#ff7f0e", "#2ca02c"

Draw = Callable[[Sequence[dict[str, Any]], Sequence[str]], Figure]


@dataclass(frozen=True)
class Plot:
    name: str  # the PNG's file name
    sources: tuple[str, ...]  # JSONs under the results folder
    draw: Draw
    what: str  # one line for the script's report and the docs
    waiting_for: str = ""  # work in progress that will write the sources


def _figure(ncols: int = 1) -> tuple[Figure, list[Axes]]:
    fig, axes = plt.subplots(1, ncols, figsize=SIZE, dpi=DPI, squeeze=False)
    return fig, list(axes[0])


def _label_bars(ax: Axes, bars: Any, fmt: str, tops: Sequence[float] | None = None) -> None:
    """Each bar's value above it (above its error bar: `tops`)."""
    for i, bar in enumerate(bars):
        top = bar.get_height() if tops is None else tops[i]
        ax.annotate(fmt.format(bar.get_height()), (bar.get_x() + bar.get_width() / 2, top),
                    ha="center", va="bottom", fontsize=8, xytext=(0, 2), textcoords="offset points")


def _spread(rounds: Sequence[float]) -> tuple[float, float, float]:
    """Median and the distances to q1 and q3 (for error bars)."""
    q = quartiles(rounds)
    return q["median"], q["median"] - q["q1"], q["q3"] - q["median"]


# ------------------------------------------------------------------ the plots


def draw_bucketing(data: Sequence[dict[str, Any]], sources: Sequence[str]) -> Figure:
    """`keyword-embedder bench --json`: keywords/s (median, q1-q3 over rounds) and padding waste."""
    (bench,) = data
    policies = bench["policies"]
    rows = [("monolithic", policies["monolithic"], GREY),
            (f"bucketed\n{bench['profile']}", policies["bucketed"], BLUE)]
    if "compare" in bench:
        rows.append((f"bucketed\n{bench['compare']['profile']}", bench["compare"]["bucketed"], ORANGE))
    rows.append(("sorted\n(oracle)", policies["sorted"], GREEN))
    fig, (speed, waste) = _figure(2)
    spreads = [_spread(p["rounds_keywords_per_s"]) for _, p, _ in rows]
    x = range(len(rows))
    bars = speed.bar(x, [s[0] for s in spreads], yerr=[[s[1] for s in spreads], [s[2] for s in spreads]],
                     color=[c for *_, c in rows], capsize=3)
    _label_bars(speed, bars, "{:,.0f}", [s[0] + s[2] for s in spreads])
    speed.set_xticks(list(x), [r[0] for r in rows], fontsize=8)
    speed.set_ylabel("keywords/s (median, q1-q3)")
    ratio = bench["ratios"]["bucketed/monolithic"]
    speed.set_title(f"throughput: bucketed / monolithic {ratio['median']:.2f} (paired)", fontsize=9)
    bars = waste.bar(x, [100 * p["padding_waste"] for _, p, _ in rows], color=[c for *_, c in rows])
    _label_bars(waste, bars, "{:.1f}%")
    waste.set_xticks(list(x), [r[0] for r in rows], fontsize=8)
    waste.set_ylabel("padding waste (% of padded tokens)")
    waste.set_title("padding waste", fontsize=9)
    fig.suptitle(f"Length-bucketed batching: {bench['n']:,} queries, {bench['backend']['name']}, "
                 f"{bench['rounds']} rounds ({sources[0]})", fontsize=10)
    fig.tight_layout()
    return fig


def draw_peers(data: Sequence[dict[str, Any]], sources: Sequence[str]) -> Figure:
    """benchmarks/peers.py --json: FastEmbed, our Embedder and our bucketed stream on the same weights."""
    (peers,) = data
    rows = [("FastEmbed " + peers["host"].get("fastembed", ""), "fastembed", GREY),
            ("our Embedder", "embedder", ORANGE), ("our bucketed stream", "bucketed", BLUE)]
    fig, (ax,) = _figure()
    qs = [peers["keywords_per_s"][key] for _, key, _ in rows]
    x = range(len(rows))
    bars = ax.bar(x, [q["median"] for q in qs], color=[c for *_, c in rows], capsize=3,
                  yerr=[[q["median"] - q["q1"] for q in qs], [q["q3"] - q["median"] for q in qs]])
    _label_bars(ax, bars, "{:,.0f}", [q["q3"] for q in qs])
    ax.set_xticks(list(x), [r[0] for r in rows], fontsize=9)
    ax.set_ylabel("keywords/s (median, q1-q3)")
    r = peers["ratios"]
    ax.set_title(f"paired: Embedder / FastEmbed {r['embedder/fastembed']['median']:.2f}, "
                 f"bucketed / FastEmbed {r['bucketed/fastembed']['median']:.2f}", fontsize=9)
    fig.suptitle(f"The same ONNX weights, {peers['n']:,} queries, cache off, {peers['host']['cpus']} cores "
                 f"({sources[0]})", fontsize=10)
    fig.tight_layout()
    return fig


def draw_latency(data: Sequence[dict[str, Any]], sources: Sequence[str]) -> Figure:
    """benchmarks/kafka_latency.py --json: p50 and p99 against the offered load, each variant a line
    (median over rounds, q1-q3 as error bars)."""
    (lat,) = data
    fig, (ax,) = _figure()
    levels = sorted(lat["runs"], key=float)
    variants = list(lat.get("variant_order") or lat["runs"][levels[0]])
    colours = [BLUE, GREY, ORANGE, GREEN]
    for i, variant in enumerate(variants):
        for pct, style in (("p50_ms", "--"), ("p99_ms", "-")):
            points = [(float(level), _spread([r[pct] for r in lat["runs"][level][variant]]))
                      for level in levels if lat["runs"][level].get(variant)]
            ax.errorbar([100 * p[0] for p in points], [p[1][0] for p in points], capsize=3, marker="o",
                        yerr=[[p[1][1] for p in points], [p[1][2] for p in points]], linestyle=style,
                        color=colours[i % len(colours)], label=f"{variant} {pct[:3]}")
    ax.set_yscale("log")
    peak = lat.get("peak_kw_s")
    ax.set_xlabel(f"offered load (% of {peak:,.0f} keywords/s, the sustained rate)" if peak
                  else "offered load (% of the first variant's sustained rate)")
    ax.set_ylabel("latency, ms (log scale)")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    rounds = lat.get("rounds", "?")
    fig.suptitle(f"Latency through Kafka, open loop, {rounds} rounds, {lat.get('cpu_count', '?')} cores "
                 f"({sources[0]})", fontsize=10)
    fig.tight_layout()
    return fig


def draw_paired_ratios(data: Sequence[dict[str, Any]], sources: Sequence[str]) -> Figure:
    """JSONs of benchmarks/bench_ab.py or benchmarks/kafka_ab.py (`ratio_new_over_old`): one bar per
    file, its `label` (or the file name), median with q1-q3, against 1.0."""
    fig, (ax,) = _figure()
    labels = [d.get("label") or Path(s).stem for d, s in zip(data, sources, strict=True)]
    qs = [d["ratio_new_over_old"] for d in data]
    x = range(len(qs))
    bars = ax.bar(x, [q["median"] for q in qs], color=BLUE, capsize=3,
                  yerr=[[q["median"] - q["q1"] for q in qs], [q["q3"] - q["median"] for q in qs]])
    _label_bars(ax, bars, "{:.2f}x", [q["q3"] for q in qs])
    ax.axhline(1.0, color=GREY, linewidth=1)
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("paired throughput ratio (median, q1-q3)")
    fig.suptitle("Throughput by backend, paired rounds", fontsize=10)
    fig.tight_layout()
    return fig


PLOTS = (
    Plot("bucketing.png", ("batching/bucketing.json",), draw_bucketing,
         "bucketed vs monolithic vs sorted batching, offline (make bench)"),
    Plot("peers.png", ("peers/peers.json",), draw_peers, "against FastEmbed on the same weights (benchmarks/peers.py)"),
    Plot("kafka-latency.png", ("latency/kafka_latency.json",), draw_latency,
         "latency through Kafka against the offered load (make bench-latency)"),
    Plot("latency-curve.png", ("latency/kafka_latency_curve.json",), draw_latency,
         "the latency-vs-load curve at 8 rates, 10% to 100% of the sustained rate",
         waiting_for="issue 37 (latency after a catch-up; the latency-vs-load curve)"),
    Plot("backends.png", ("backends/backends_offline.json", "backends/backends_kafka.json"), draw_paired_ratios,
         "throughput of the auto backend against ONNX Runtime fp32, offline and through Kafka"),
)


def make(plots: Sequence[Plot], results: Path, out: Path) -> tuple[list[Path], list[str]]:
    """Draw every plot whose JSONs exist; (the PNGs written, what is still waited for)."""
    out.mkdir(parents=True, exist_ok=True)
    made: list[Path] = []
    waiting: list[str] = []
    for plot in plots:
        missing = [s for s in plot.sources if not (results / s).is_file()]
        if missing:
            if not plot.waiting_for:
                raise FileNotFoundError(f"{plot.name}: {', '.join(str(results / m) for m in missing)} missing")
            waiting.append(f"{plot.name}: waiting for {plot.waiting_for}: {', '.join(missing)} not there yet")
            continue
        data = [json.loads((results / s).read_text(encoding="utf-8")) for s in plot.sources]
        fig = plot.draw(data, [f"benchmarks/results/{s}" for s in plot.sources])
        path = out / plot.name
        fig.savefig(path, dpi=DPI, metadata={"Software": None})
        plt.close(fig)
        made.append(path)
    return made, waiting


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="the benchmark JSONs (benchmarks/results)")
    parser.add_argument("--out", type=Path, default=OUT, help="where the PNGs go (docs/img)")
    args = parser.parse_args(argv)
    made, waiting = make(PLOTS, args.results, args.out)
    for path in made:
        print(f"plots: {path}")
    for line in waiting:
        print(f"plots: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
