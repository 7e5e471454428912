"""The benchmark report: paired-ratio statistics and the Markdown rendering of the JSON report."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any


def quartiles(values: Sequence[float]) -> dict[str, float]:
    """Median and quartiles (inclusive method; with one value all three are that value)."""
    vals = sorted(values)
    if len(vals) == 1:
        return {"median": vals[0], "q1": vals[0], "q3": vals[0]}
    q1, med, q3 = statistics.quantiles(vals, n=4, method="inclusive")
    return {"median": med, "q1": q1, "q3": q3}


def _fmt_q(q: dict[str, float]) -> str:
    return f"{q['median']:.2f} ({q['q1']:.2f}-{q['q3']:.2f})"


def render_markdown(report: dict[str, Any], command: str) -> str:
    pol = report["policies"]
    lines = [
        "# Bucketed batching benchmark",
        "",
        f"`{command}`",
        "",
        f"Dataset `{report['dataset']}`, first {report['n']} queries, {report['rounds']} rounds in alternating "
        f"order, backend {report['backend'].get('name', '?')} "
        f"({', '.join(f'{k}={v}' for k, v in report['backend'].items() if k != 'name')}), "
        f"profile `{report['profile']}`, settings {report['settings']}. {report['timing'].capitalize()}.",
        "",
        "| policy | keywords/s (median) | padding waste | mean batch |",
        "|---|---:|---:|---:|",
    ]
    rows = [(name, pol[name]) for name in ("monolithic", "bucketed", "sorted")]
    if "compare" in report:
        rows.insert(2, (f"bucketed[{report['compare']['profile']}]", report["compare"]["bucketed"]))
    for name, p in rows:
        label = f"bucketed[{report['profile']}]" if name == "bucketed" else name
        lines.append(f"| {label} | {p['keywords_per_s']:.0f} | {p['padding_waste']:.1%} | {p['mean_batch']:.1f} |")
    lines += ["", "Paired per-round throughput ratios, median (q1-q3):", "", "| ratio | value |", "|---|---:|"]
    for name, q in report["ratios"].items():
        lines.append(f"| {name} | {_fmt_q(q)} |")
    if "compare" in report:
        for name, q in report["compare"]["ratios"].items():
            lines.append(f"| {name} | {_fmt_q(q)} |")
    ov = report["overhead"]
    lines += ["", f"Overhead guard ({ov['what']}): median {ov['median']:+.1%} (q1 {ov['q1']:+.1%}, "
              f"q3 {ov['q3']:+.1%}).", ""]
    lat = report.get("latency") or {}
    if lat:
        lines += [f"Latency, {lat['arrivals']}, {lat['seconds_per_level']:.0f} s per level, bucketed peak "
                  f"{lat['peak_keywords_per_s']:.0f} keywords/s:", "",
                  "| load | offered/s | achieved/s | p50 ms | p95 ms | p99 ms | max ms | mean batch |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for lv in lat["levels"]:
            lines.append(f"| {lv['load']:.0%} | {lv['offered_per_s']:.0f} | {lv['achieved_per_s']:.0f} | "
                         f"{lv['p50_ms']:.0f} | {lv['p95_ms']:.0f} | {lv['p99_ms']:.0f} | {lv['max_ms']:.0f} | "
                         f"{lv['mean_batch']:.1f} |")
        lines.append("")
    return "\n".join(lines)

