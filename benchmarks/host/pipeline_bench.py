"""The worker's host path with the model and the broker taken out: keywords/s per process and CPU
microseconds per keyword, by thread, paired against a baseline checkout and across N processes.

    python -m benchmarks.host.pipeline_bench --rounds 5 --baseline-root /tmp/kwe-base \
        --json benchmarks/results/host/pipeline_bench.json
    python -m benchmarks.host.pipeline_bench --rounds 3 --processes 1 2      # scaling on this box
    python -m benchmarks.host.pipeline_bench --rounds 9 --backend auto --against-backend null \
        --setting model_dir=STATIC_MODEL          # a static model's lookup over the do-nothing backend

Each run is one process of benchmarks/host/one_run.py (the worker's own pipeline, in-memory
records, a do-nothing backend, a producer that acknowledges at once; the embedding cache off, so
every keyword is tokenized and batched). A round runs every side once, in an order that rotates,
and ratios are paired per round: on a shared, noisy machine only same-round ratios mean anything.
Comparing a checkout with itself (`--baseline-root .`) gives the A/A noise floor.

With --processes N the side runs N such processes at once (each on its own slice of the data),
and reports their total keywords/s and the scaling over one process of the same round. With
--hold each process count runs a second time with process i's poll and kwe-* threads held on the
ith CPU of the set (what `interpreter_cpu` auto does under `run --processes N`), paired with it;
with --free a second time with `interpreter_cpu=off` (the threads left to the scheduler; the
default, auto, holds a lone process's where it starts and moves them off a CPU another takes).
No broker, no GPU needed: it runs wherever the worker's Python dependencies do.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
DEFAULT_DATA = ROOT / "tests" / "data" / "queries" / "terabyte05-20k.tsv"


def quartiles(values: list[float]) -> dict[str, float]:
    import statistics

    if len(values) == 1:
        return {"median": values[0], "q1": values[0], "q3": values[0]}
    q = statistics.quantiles(values, n=4, method="inclusive")
    return {"median": statistics.median(values), "q1": q[0], "q3": q[2]}


def paired_ratios(rounds: Sequence[Mapping[str, Any]], a: str, b: str, key: str) -> dict[str, float]:
    """Side a's `key` over side b's, paired per round (a round: its `order` of sides, and `sides`,
    each side's measures), as quartiles; and, once both orders have run, `balanced` and the median
    with each side first. On this shared box the second run of a round was the faster one in most
    rounds, whichever side it was (2026-12-06), so the order shifts each ratio. Rounds rotate the
    order; `balanced`, the geometric mean of the two orders' geometric means, takes it out."""
    ratios = [x["sides"][a][key] / x["sides"][b][key] for x in rounds]
    got = quartiles(ratios)
    first: dict[str, list[float]] = {a: [], b: []}
    for x, ratio in zip(rounds, ratios):
        first[next(s for s in x["order"] if s in (a, b))].append(ratio)
    if first[a] and first[b]:
        means = [math.exp(sum(map(math.log, v)) / len(v)) for v in first.values()]
        got["balanced"] = math.sqrt(means[0] * means[1])
        got[f"{a} first"], got[f"{b} first"] = (quartiles(v)["median"] for v in first.values())
    return got


def runner_dir(tmp: Path) -> Path:
    """This folder's one-run module and doubles as a package of their own (kwe_host), so a baseline
    checkout that lacks them runs the same measurement with its own `worker`."""
    pkg = tmp / "kwe_host"
    pkg.mkdir()
    for name in ("__init__.py", "doubles.py", "one_run.py"):
        shutil.copy(HERE / name, pkg / name)
    return tmp


def run_side(root: Path, pythonpath: Path, args: argparse.Namespace, processes: int,
             settings: list[str], hold: bool = False, backend: str | None = None) -> list[dict[str, Any]]:
    """`processes` one_run processes at once in checkout `root`; their JSON results. `hold`: process
    i's Python threads held on the ith CPU of this process's set, in turn (interpreter_cpu's auto)."""
    cpus = sorted(os.sched_getaffinity(0))
    # The runner first; what the caller's path holds (a lent GPU machine's libraries) after it.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(pythonpath), os.environ.get("PYTHONPATH")]))}
    procs = []
    per = args.n + args.warmup
    for i in range(processes):
        cmd = [sys.executable, "-m", "kwe_host.one_run", "--data", str(args.data), "--n", str(args.n),
               "--warmup", str(args.warmup), "--warmup-s", str(args.warmup_s), "--skip", str(i * per), "--backend", backend or args.backend,
               "--poll-records", str(args.poll_records), "--null-vectors", args.null_vectors]
        for s in settings:
            cmd += ["--setting", s]
        if hold:
            cmd += ["--hold-cpu", str(cpus[i % len(cpus)])]
        procs.append(subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    results = []
    for p in procs:
        out, err = p.communicate(timeout=args.timeout)
        if p.returncode != 0:
            raise SystemExit(f"one_run in {root} failed ({p.returncode}):\n{err[-3000:]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("-n", "--n", type=int, default=100000,
                    help="keywords per process and run after --warmup; those after --warmup-s are measured")
    ap.add_argument("--warmup", type=int, default=3000)
    ap.add_argument("--warmup-s", type=float, default=1.5,
                    help="one_run's: flow control sets its in-flight bound after a second of measuring")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--baseline-root", type=Path, default=None, help="a checkout to pair against")
    ap.add_argument("--processes", type=int, nargs="+", default=[1],
                    help="process counts to run this checkout with (each round runs every count)")
    ap.add_argument("--setting", action="append", default=[], metavar="NAME=VALUE",
                    help="a worker setting for both sides")
    ap.add_argument("--poll-records", type=int, default=0,
                    help="one_run's: at most this many records a consume (a live stream; 0: a backlog)")
    ap.add_argument("--backend", default="null", help="null (no model; the default) or a worker backend")
    ap.add_argument("--against-backend", default=None, metavar="BACKEND",
                    help="also run this checkout with this backend (e.g. null, with --backend auto and a static "
                         "model), paired against --backend: the model's cost over the host path's")
    ap.add_argument("--new-setting", action="append", default=[], metavar="NAME=VALUE",
                    help="a worker setting for this checkout's --backend sides only")
    ap.add_argument("--against-setting", action="append", default=[], metavar="NAME=VALUE",
                    help="a worker setting for the --against-backend side only")
    ap.add_argument("--null-vectors", choices=("unit", "random"), default="unit",
                    help="the null backend's answers (one_run's --null-vectors): random unit vectors cost the "
                         "float-list encoding what a real model's do")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--hold", action="store_true",
                    help="also run each process count with each process's Python threads held on a CPU of "
                         "its own (interpreter_cpu), paired against the same count run with the default")
    ap.add_argument("--free", action="store_true",
                    help="also run each process count with interpreter_cpu=off, paired against the default")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    sides: list[tuple[str, Path, int, bool]] = [(f"new-p{p}", ROOT, p, False) for p in args.processes]
    if args.hold:
        sides += [(f"new-p{p}-held", ROOT, p, True) for p in args.processes]
    if args.free:
        sides += [(f"new-p{p}-off", ROOT, p, False) for p in args.processes]
    if args.baseline_root is not None:
        sides.append(("old-p1", args.baseline_root.resolve(), 1, False))
    if args.against_backend is not None:
        sides.append(("against-p1", ROOT, 1, False))
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        path = runner_dir(Path(tmp))
        for r in range(args.rounds):
            order = sides[r % len(sides):] + sides[:r % len(sides)]
            got: dict[str, Any] = {}
            for name, root, processes, hold in order:
                # Held by the benchmark, or left free: either way the worker's own hold stays out.
                off = ["interpreter_cpu=off"] if hold or name.endswith("-off") else []
                against = name == "against-p1"
                own = args.against_setting if against else args.new_setting if name.startswith("new-") else []
                results = run_side(root, path, args, processes, args.setting + own + off, hold,
                                   args.against_backend if against else None)
                got[name] = {"keywords_per_s": sum(x["keywords_per_s"] for x in results),
                             "cpu_us_per_keyword": sum(x["cpu_us_per_keyword"] for x in results) / len(results),
                             "threads_us_per_keyword": results[0]["threads_us_per_keyword"],
                             "per_process_keywords_per_s": [x["keywords_per_s"] for x in results]}
            rounds.append({"round": r, "order": [s[0] for s in order], "sides": got})
            line = "  ".join(f"{k}: {v['keywords_per_s']:8.0f} kw/s {v['cpu_us_per_keyword']:5.1f} us"
                             for k, v in got.items())
            print(f"round {r}: {line}", flush=True)
    summary: dict[str, Any] = {"data": args.data.name, "n": args.n, "rounds_run": len(rounds),
                               "cpu_count": os.cpu_count(), "settings": args.setting, "backend": args.backend,
                               "poll_records": args.poll_records, "warmup_s": args.warmup_s, "sides": {}, "ratios": {}}
    for name, *_ in sides:
        rows = [x["sides"][name] for x in rounds]
        threads = {t: quartiles([row["threads_us_per_keyword"].get(t, 0.0) for row in rows])["median"]
                   for t in rows[0]["threads_us_per_keyword"]}
        summary["sides"][name] = {"keywords_per_s": quartiles([row["keywords_per_s"] for row in rows]),
                                  "cpu_us_per_keyword": quartiles([row["cpu_us_per_keyword"] for row in rows]),
                                  "threads_us_per_keyword_median": threads}

    def paired(a: str, b: str, key: str) -> dict[str, float]:
        return paired_ratios(rounds, a, b, key)

    if args.baseline_root is not None:
        summary["ratios"]["new/old keywords_per_s"] = paired("new-p1", "old-p1", "keywords_per_s")
        summary["ratios"]["old/new cpu_us_per_keyword"] = paired("old-p1", "new-p1", "cpu_us_per_keyword")
    if args.against_backend is not None:
        summary["against_backend"] = args.against_backend
        summary["ratios"]["new/against cpu_us_per_keyword"] = paired("new-p1", "against-p1", "cpu_us_per_keyword")
        summary["ratios"]["against/new keywords_per_s"] = paired("against-p1", "new-p1", "keywords_per_s")
    for p in args.processes[1:]:
        summary["ratios"][f"p{p}/p1 keywords_per_s"] = paired(f"new-p{p}", "new-p1", "keywords_per_s")
    # Each variant against the default (interpreter_cpu as the settings have it, auto; before
    # 2026-12-06 a lone process ran free by default, and held/default was named held/free).
    variants = [("held", "held/default", True)] if args.hold else []
    variants += [("off", "default/off", False)] if args.free else []
    for suffix, label, variant_first in variants:
        for p in args.processes:
            a, b = (f"new-p{p}-{suffix}", f"new-p{p}") if variant_first else (f"new-p{p}", f"new-p{p}-{suffix}")
            inverse = "/".join(reversed(label.split("/")))
            summary["ratios"][f"p{p} {label} keywords_per_s"] = paired(a, b, "keywords_per_s")
            summary["ratios"][f"p{p} {inverse} cpu_us_per_keyword"] = paired(b, a, "cpu_us_per_keyword")
        if args.baseline_root is not None:
            summary["ratios"][f"new {suffix}/old keywords_per_s"] = paired(f"new-p1-{suffix}", "old-p1", "keywords_per_s")
            summary["ratios"][f"old/new {suffix} cpu_us_per_keyword"] = paired("old-p1", f"new-p1-{suffix}",
                                                                             "cpu_us_per_keyword")
    for name, side in summary["sides"].items():
        k, c = side["keywords_per_s"], side["cpu_us_per_keyword"]
        print(f"{name}: {k['median']:8.0f} kw/s ({k['q1']:.0f}-{k['q3']:.0f}), CPU {c['median']:.1f} us/keyword "
              f"({c['q1']:.1f}-{c['q3']:.1f}); by thread {side['threads_us_per_keyword_median']}")
    for name, q in summary["ratios"].items():
        balanced = f"; order-balanced {q['balanced']:.3f}" if "balanced" in q else ""
        print(f"{name}: median {q['median']:.3f} (q1 {q['q1']:.3f}, q3 {q['q3']:.3f}){balanced}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**summary, "rounds": rounds}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
