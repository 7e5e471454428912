"""The latency benchmark's report: pure functions over what benchmarks/kafka_latency.py measured.

- `quartiles` over rounds; `window_stats` (p50/p99 per 5 s window of send time), `windows_line`;
- the generator's own lag: `schedule_lag_ms`, `generator_verdict` (a level more than
  MAX_GENERATOR_LAG_P99_MS behind its schedule at p99 is rejected);
- the overload: `overload_verdict` (backlog, drain, p99 after it), `partition_spread`, `partition_line`;
- the report: `summarise`, `render_markdown`, `render_overload`, `render_windows`, `merge_reports`
  (--merge), `write_report` (--json, --markdown, stdout), and `level_line` (one level's printout).

Nothing here talks to Kafka or the worker; tests/unit/benchmarks/test_latency_bench.py tests it on made-up numbers.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

# More cache hits than this and a level measures the cache, not the model.
MAX_HIT_RATE = 0.02


def quartiles(values: list[float]) -> dict[str, float]:
    vals = [v for v in values if not math.isnan(v)]
    if not vals:
        return {"q1": math.nan, "median": math.nan, "q3": math.nan}
    q1, med, q3 = np.percentile(vals, [25, 50, 75])
    return {"q1": float(q1), "median": float(med), "q3": float(q3)}


# --------------------------------------------------------------------------- transients, generator
# The per-window view: a transient that a level's p99 averages away shows as one bad window.
WINDOW_S = 5.0
# A level whose generator fell behind its schedule by more than this at p99 measured the
# generator (a starved sender bunches records), not the worker: it is rejected.
MAX_GENERATOR_LAG_P99_MS = 20.0


def window_stats(t_send_ms: np.ndarray, latency_ms: np.ndarray, window_s: float = WINDOW_S) -> list[dict[str, Any]]:
    """p50/p99 per `window_s` window of send time, from the first record sent; empty windows are left out."""
    if len(t_send_ms) == 0:
        return []
    t0 = float(np.min(t_send_ms))
    idx = ((t_send_ms - t0) // (window_s * 1000)).astype(int)
    out = []
    for w in range(int(idx.max()) + 1):
        lat = latency_ms[idx == w]
        if len(lat):
            p50, p99 = np.percentile(lat, [50, 99])
            out.append({"start_s": w * window_s, "n": int(len(lat)), "p50_ms": float(p50), "p99_ms": float(p99),
                        "max_ms": float(lat.max())})
    return out


def schedule_lag_ms(sent_ms: np.ndarray, scheduled_s: np.ndarray) -> np.ndarray:
    """How late each record was sent against its schedule (ms): send stamp minus planned time, the
    schedule's origin taken as the earliest (least late) record, since a sender is never early."""
    offset = np.asarray(sent_ms, dtype=np.float64) - 1000.0 * np.asarray(scheduled_s, dtype=np.float64)
    return offset - offset.min() if len(offset) else offset


def generator_verdict(lag_ms: np.ndarray, limit_ms: float = MAX_GENERATOR_LAG_P99_MS) -> dict[str, Any]:
    """The generator's lag (p50/p99/max, ms) and whether the level is valid (p99 within `limit_ms`)."""
    if len(lag_ms) == 0:
        return {"lag_p50_ms": math.nan, "lag_p99_ms": math.nan, "lag_max_ms": math.nan, "valid": False,
                "why": "nothing sent"}
    p50, p99 = np.percentile(lag_ms, [50, 99])
    valid = bool(p99 <= limit_ms)
    return {"lag_p50_ms": float(p50), "lag_p99_ms": float(p99), "lag_max_ms": float(np.max(lag_ms)), "valid": valid,
            "why": "" if valid else f"generator {p99:.0f} ms behind its schedule at p99 (limit {limit_ms:g} ms)"}


def windows_line(windows: list[dict[str, Any]], key: str = "p99_ms") -> str:
    return " / ".join(f"{w[key]:.0f}" for w in windows)


def level_line(label: str, rate: float, name: str, res: dict[str, Any]) -> str:
    g = res["generator"]
    return (f"{label} {rate:6.0f} kw/s {name:>10}: p50 {res['p50_ms']:6.0f}  p99 {res['p99_ms']:6.0f}  "
            f"reader p50/p99 {res['reader_p50_ms']:5.0f}/{res['reader_p99_ms']:5.0f}  batch {res['mean_batch']:5.1f}  "
            f"hits {res['cache_hit_rate']:.1%}  drain {res['drain_s']:.1f} s  missing {res['missing']}  "
            f"box busy {res.get('box_busy', math.nan):.0%}  "
            f"gen lag p99 {g['lag_p99_ms']:.0f} ms{'' if res['valid'] else ' REJECTED'}\n"
            f"    p99 by {WINDOW_S:g} s window: {windows_line(res['windows'])}")


def overload_verdict(t_send_ms: np.ndarray, t_out_ms: np.ndarray, high_end_ms: float, *, goal_p99_ms: float,
                     settle_s: float = 10.0, caught_up_s: float = 1.0) -> dict[str, Any]:
    """After an overload phase ending at high_end_ms: the backlog it left, when the lag reached zero
    and how fast it drained, and the p99 of what was sent from settle_s after that on, against the goal.

    The lag at a moment is what was sent and not yet written. Records sent after the overload
    queue behind its backlog in their partitions, so the lag reaches zero only once they are
    out too, later than the overload's own last record (kept as `overload_out_s`). Under a
    steady stream the lag never reaches 0 exactly: "zero" is the first moment it holds no more
    than `caught_up_s` of what arrives after the overload."""
    high = t_send_ms < high_end_ms
    backlog = int((high & (t_out_ms > high_end_ms)).sum())
    overload_out_ms = float(t_out_ms[high].max()) if high.any() else high_end_ms
    sends, outs = np.sort(t_send_ms), np.sort(t_out_ms)
    # Only while the stream still flows: once sending stops, any lag reaches zero.
    end_ms = float(sends[-1]) if len(sends) else high_end_ms
    arrivals = sends[sends >= high_end_ms]
    low_rate = len(arrivals) / max(1e-3, (float(arrivals[-1]) - high_end_ms) / 1000) if len(arrivals) > 1 else 0.0
    grid = np.arange(high_end_ms, end_ms + 1.0, 100.0)
    lag = np.searchsorted(sends, grid, side="right") - np.searchsorted(outs, grid, side="right")
    zero = np.nonzero(lag <= low_rate * caught_up_s)[0]
    drained_ms = float(grid[zero[0]]) if len(zero) else end_ms
    after = t_send_ms >= drained_ms + settle_s * 1000
    lat = t_out_ms - t_send_ms
    p99_after = float(np.percentile(lat[after], 99)) if after.any() else math.nan
    drain_s = max(0.0, (drained_ms - high_end_ms) / 1000)
    return {"backlog_at_high_end": backlog, "drain_s": drain_s, "lag_zero": bool(len(zero)),
            "overload_out_s": max(0.0, (overload_out_ms - high_end_ms) / 1000),
            "drain_kw_s": backlog / drain_s if drain_s > 0 else math.nan,
            "p99_after_settle_ms": p99_after, "n_after_settle": int(after.sum()),
            "settled": bool(after.any() and p99_after <= goal_p99_ms)}


def partition_spread(t_send_ms: np.ndarray, t_out_ms: np.ndarray, partition: np.ndarray,
                     high_end_ms: float) -> dict[str, Any]:
    """Per input partition, of the records sent during the overload (before high_end_ms): how
    many, their wait's p50/p99 (ms), and when the partition's backlog reached zero (its last such
    record written, seconds after the overload ended); and the spread of those drain times, which
    is 0 when the worker serves its partitions fairly and the drain's length when it serves them
    one after another."""
    high = t_send_ms < high_end_ms
    rows = {}
    for p in np.unique(partition[high]):
        mine = high & (partition == p)
        wait = t_out_ms[mine] - t_send_ms[mine]
        p50, p99 = np.percentile(wait, [50, 99])
        rows[str(int(p))] = {"n": int(mine.sum()), "p50_ms": float(p50), "p99_ms": float(p99),
                             "drained_s": max(0.0, float(t_out_ms[mine].max() - high_end_ms) / 1000)}
    drained = [r["drained_s"] for r in rows.values()]
    return {"partitions": rows, "drain_spread_s": (max(drained) - min(drained)) if drained else math.nan}


def partition_line(spread: dict[str, Any]) -> str:
    """`p0 p50/p99 ms, drained at s | ...` for the overload's printout."""
    return " | ".join(f"p{p} {r['p50_ms'] / 1000:.1f}/{r['p99_ms'] / 1000:.1f} s, 0 at +{r['drained_s']:.1f} s"
                      for p, r in sorted(spread["partitions"].items(), key=lambda kv: int(kv[0])))


# --------------------------------------------------------------------------- report
def summarise(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per level and variant: quartiles over rounds of p50/p99, and the paired p99 ratio to the first variant."""
    first = report["variant_order"][0]
    rows = []
    for load in report["levels"]:
        runs = report["runs"][str(load)]
        for name in report["variant_order"]:
            every = runs[name]
            # A level whose generator fell behind its schedule measured the generator: left out.
            mine = [r for r in every if r.get("valid", True)] or every
            row = {"load": load, "variant": name, "rate": report["rates"][str(load)],
                   "rejected": sum(not r.get("valid", True) for r in every),
                   "reader_p50": quartiles([r.get("reader_p50_ms", math.nan) for r in mine]),
                   "reader_p99": quartiles([r.get("reader_p99_ms", math.nan) for r in mine]),
                   "p50": quartiles([r["p50_ms"] for r in mine]), "p99": quartiles([r["p99_ms"] for r in mine]),
                   "mean_batch": quartiles([r["mean_batch"] for r in mine]),
                   # Older reports have no box_busy: nan, shown as "-".
                   "box_busy": quartiles([r.get("box_busy", math.nan) for r in mine]),
                   "max_hit_rate": max(r["cache_hit_rate"] for r in mine),
                   "all_keep_up": all(r["keeps_up"] for r in mine), "missing": sum(r["missing"] for r in mine),
                   "rounds": len(mine)}
            if name != first:
                row["p99_ratio_to_first"] = quartiles([r["p99_ms"] / b["p99_ms"] for r, b in zip(every, runs[first])
                                                       if b["p99_ms"] > 0 and r.get("valid", True)
                                                       and b.get("valid", True)])
            rows.append(row)
    return rows


def _q(q: dict[str, float], fmt: str = "{:.0f}") -> str:
    return f"{fmt.format(q['median'])} ({fmt.format(q['q1'])}-{fmt.format(q['q3'])})"


def render_markdown(report: dict[str, Any]) -> str:
    lines = ["# Latency through Kafka (open loop, keywords not seen before in the run)\n",
             f"Command: `{report['command']}`  ",
             f"Conditions: {report['conditions']}\n",
             *([f"Merged from: {'; '.join(f'`{c}`' for c in report['merged_from'])}\n"] if report.get("merged_from") else []),
             "Sustained from a backlog (keywords/s): " + "; ".join(
                 f"{n}: steady {s['steady_kw_s']:.0f}, whole backlog {s['whole_kw_s']:.0f} ({s['n']:,} keywords)"
                 for n, s in report["sustained"].items()) + "\n",
             f"Medians over {report['rounds']} paired rounds, (q1-q3) in brackets. Cache hits: the highest "
             f"of the rounds; a level above {MAX_HIT_RATE:.0%} does not measure the model.\n",
             "Latency is the output record's timestamp (stamped at produce()) minus the input's (stamped at send); "
             "at the reader it is when the benchmark's reader got the output record, after the producer's linger "
             f"and the broker's acks. A level whose generator was more than {MAX_GENERATOR_LAG_P99_MS:g} ms behind "
             "its schedule at p99 is rejected and left out of the medians.\n",
             "| variant | load | offered kw/s | p50 ms | p99 ms | at the reader p50 / p99 ms | "
             "p99 / first variant's (paired) | mean batch | box busy | cache hits | every ID out, keeps up | "
             "rejected |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for row in summarise(report):
        ratio = _q(row["p99_ratio_to_first"], "{:.2f}") if "p99_ratio_to_first" in row else "-"
        hits = f"{row['max_hit_rate']:.1%}" + ("" if row["max_hit_rate"] <= MAX_HIT_RATE else " (cache, not model)")
        busy = "-" if math.isnan(row["box_busy"]["median"]) else f"{row['box_busy']['median']:.0%}"
        lines.append(f"| {row['variant']} | {row['load']:.0%} | {row['rate']:.0f} | {_q(row['p50'])} | "
                     f"{_q(row['p99'])} | {row['reader_p50']['median']:.0f} / {row['reader_p99']['median']:.0f} | "
                     f"{ratio} | {_q(row['mean_batch'], '{:.1f}')} | {busy} | {hits} | "
                     f"{'yes' if row['all_keep_up'] and not row['missing'] else 'NO'} "
                     f"(missing {row['missing']}) | {row['rejected']} |")
    if report.get("overload"):
        lines += ["", render_overload(report)]
    lines += ["", render_windows(report)]
    lines += ["", "## Where the time goes (per hop, last round; mean / p50 / p99 ms, p50 and p99 estimated "
              "from histogram buckets)", ""]
    last = {(load, name): report["runs"][str(load)][name][-1] for load in report["levels"]
            for name in report["variant_order"] if report["runs"][str(load)].get(name)}
    hops = sorted({h for r in last.values() for h in r["hops"]})
    lines.append("| variant | load | " + " | ".join(h.removeprefix("kwe_").removesuffix("_seconds") for h in hops) + " |")
    lines.append("|---|---:|" + "---:|" * len(hops))
    for (load, name), r in last.items():
        cells = [(f"{v['mean_ms']:.1f} / {v['p50_ms']:.1f} / {v['p99_ms']:.0f}" if (v := r["hops"].get(h)) else "")
                 for h in hops]
        lines.append(f"| {name} | {load:.0%} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def render_overload(report: dict[str, Any]) -> str:
    """--overload: per variant, what was lost, memory, the drain, and how alike the partitions drained."""
    lines = ["## Overload\n",
             "The lag is what was sent and not yet written; it counts as zero once it holds at most one second of "
             "the low phase's arrivals. Drain spread: between the first and the last partition whose overload "
             "records were all written.\n",
             "| variant | phases | sent | missing | RSS growth MiB | backlog at the overload's end | its last record "
             "out, s after | lag zero at, s after | p99 from 10 s after it, ms | drain spread s |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, ov in report["overload"].items():
        phases = ", then ".join(f"{p['load']:g}x ({p['rate']:.0f} kw/s) for {p['seconds']:g} s" for p in ov["phases"])
        zero = f"{ov['drain_s']:.1f}" if ov.get("lag_zero", True) else "not reached"
        p99 = "-" if math.isnan(ov["p99_after_settle_ms"]) else f"{ov['p99_after_settle_ms']:.0f}"
        lines.append(f"| {name} | {phases} | {ov['sent']} | {ov['missing']} | {ov['rss_growth_mib']:.1f} | "
                     f"{ov['backlog_at_high_end']} | {ov.get('overload_out_s', ov['drain_s']):.1f} | {zero} | {p99} | "
                     f"{ov['by_partition']['drain_spread_s']:.1f} |")
    lines += ["", "By partition (the overload's records: wait p50/p99, and when the partition's backlog reached "
              "zero):", ""]
    lines += [f"- {name}: {partition_line(ov['by_partition'])}" for name, ov in report["overload"].items()]
    return "\n".join(lines) + "\n"


def render_windows(report: dict[str, Any]) -> str:
    """Every level, round and variant: p99 (and p50) per window, the catch-up level first."""
    lines = [f"## p50 / p99 by {WINDOW_S:g} s window of send time (ms), every round\n",
             "| level | variant | round | p50 by window | p99 by window | generator lag p99 ms |",
             "|---|---|---:|---|---|---:|"]
    catchup = report.get("catchup") or {}
    blocks = []
    if catchup.get("load"):
        blocks.append((f"catch-up {catchup['load']:.0%} (after {catchup['backlog']:,})", catchup["runs"]))
    blocks += [(f"{load:.0%}", report["runs"][str(load)]) for load in report["levels"]]
    for label, runs in blocks:
        for name in report["variant_order"]:
            for rnd, r in enumerate(runs.get(name, [])):
                lines.append(f"| {label} | {name} | {rnd} | {windows_line(r['windows'], 'p50_ms')} | "
                             f"{windows_line(r['windows'])} | {r['generator']['lag_p99_ms']:.0f}"
                             f"{'' if r.get('valid', True) else ' (rejected)'} |")
    return "\n".join(lines) + "\n"


def merge_reports(reports: list[dict[str, Any]], command: str) -> dict[str, Any]:
    """Invocations of the same levels and variants (e.g. one round each, same --peak) as one report:
    their rounds side by side, in the order given."""
    first = reports[0]
    for r in reports[1:]:
        if r["levels"] != first["levels"] or r["variant_order"] != first["variant_order"]:
            raise SystemExit("--merge: the reports must have the same --levels and variants")
    runs = {lvl: {name: [x for r in reports for x in r["runs"][lvl].get(name, [])] for name in first["variant_order"]}
            for lvl in first["runs"]}
    loads = [r["load_average_at_start"][0] for r in reports] + [r["load_average_at_end"][0] for r in reports]
    return {**first, "command": command, "rounds": sum(r["rounds"] for r in reports), "runs": runs,
            "merged_from": [r["command"] for r in reports],
            "conditions": first["conditions"] + f"; {len(reports)} invocations merged, load average "
                                                f"{min(loads):.1f}-{max(loads):.1f} at their starts and ends"}


def write_report(report: dict[str, Any], json_path: Path | None, markdown_path: Path | None) -> None:
    """The report as --json and --markdown ask, and as markdown on stdout."""
    if json_path:
        json_path.write_text(json.dumps(report, indent=2, default=float) + "\n")
    if markdown_path:
        markdown_path.write_text(render_markdown(report))
    print(render_markdown(report))
