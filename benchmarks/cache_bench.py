"""What the embedding cache gives and costs, through the worker's bucketed path offline.

    .venv/bin/python benchmarks/cache_bench.py --json benchmarks/results/cache.json \
        --markdown benchmarks/results/cache.md

Three streams, tokenized once up front (outside the timings):
- trec:     the TREC 2005 efficiency queries in file order (repeats as they come);
- distinct: the same with every repeat removed (the cache can only cost: goal <= 2%);
- zipf:     as many draws as trec, from the distinct queries with Zipf(s=1.0) popularity
            (rank r drawn with probability proportional to 1/r, ranks a seeded shuffle).
Each stream runs through `worker.bench.run_bucketed` (the worker's Bucketer, the `cpu`
profile, the max_in_flight window) with the cache in front (a fresh, empty one of the default
cache_bytes per run: a hit is answered at once and skips the bucketer and the model) and
without it, alternating which goes first, `--rounds` times; the on/off throughput ratio is
paired per round (median, q1-q3). Hit rates are the cache's own counters.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engines.export_onnx import ensure_onnx  # noqa: E402
from worker.backends.onnxruntime import OnnxRuntimeBackend  # noqa: E402
from worker.bench import quartiles, read_queries, run_bucketed  # noqa: E402
from worker.cache import DEFAULT_CACHE_BYTES, EmbeddingCache  # noqa: E402
from worker.model import default_model_dir  # noqa: E402
from worker.profiles import load_profile  # noqa: E402
from worker.tokenize import KeywordTokenizer  # noqa: E402

DEFAULT_QUERIES = ROOT.parent / "shared" / "data" / "queries" / "terabyte05-efficiency.tsv"
GOALS = {"distinct": ("cost <= 2%", lambda r: r >= 0.98), "zipf": (">= 2x", lambda r: r >= 2.0)}


def zipf_replay(texts: list[str], n: int, s: float, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    ranked = [texts[i] for i in rng.permutation(len(texts))]
    p = 1.0 / np.arange(1, len(ranked) + 1) ** s
    draws = rng.choice(len(ranked), size=n, p=p / p.sum())
    return [ranked[i] for i in draws]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--queries", default=str(DEFAULT_QUERIES))
    ap.add_argument("--limit", type=int, default=None, help="first N queries of the file (default: all)")
    ap.add_argument("--streams", default="trec,distinct,zipf")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--zipf-s", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=13)
    ap.add_argument("--cache-bytes", type=int, default=DEFAULT_CACHE_BYTES)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--dispatchers", type=int, default=1)
    ap.add_argument("--json")
    ap.add_argument("--markdown")
    args = ap.parse_args(argv)

    trec = [t for _, t in read_queries(args.queries, limit=args.limit)]
    distinct = list(dict.fromkeys(trec))
    streams = {"trec": trec, "distinct": distinct,
               "zipf": zipf_replay(distinct, len(trec), args.zipf_s, args.seed)}
    wanted = args.streams.split(",")
    tokenizer = KeywordTokenizer.from_model_dir(default_model_dir())
    backend = OnnxRuntimeBackend(ensure_onnx(), intra_op_threads=args.threads)
    profile = load_profile("cpu", model_max_len=tokenizer.max_len)
    run_bucketed(tokenizer.encode(trec[:1000]), profile, backend, dispatchers=args.dispatchers)  # warm-up

    results: dict[str, Any] = {}
    for name in wanted:
        encoded = tokenizer.encode(streams[name])
        ratios, on_kws, off_kws, hit_rates, evictions = [], [], [], [], []
        for r in range(args.rounds):
            got = {}
            for mode in (("on", "off") if r % 2 == 0 else ("off", "on")):
                cache = EmbeddingCache(args.cache_bytes, backend.dim) if mode == "on" else None
                run = run_bucketed(encoded, profile, backend, dispatchers=args.dispatchers, cache=cache)
                got[mode] = run.keywords_per_s
                if cache is not None:
                    s = cache.stats()
                    hit_rates.append(s.hit_rate)
                    evictions.append(s.evictions)
                print(f"{name} round {r + 1}/{args.rounds} cache {mode:>3}: {run.keywords_per_s:8,.0f} kw/s"
                      + (f"  {cache.stats().line()}" if cache is not None else ""), flush=True)
            ratios.append(got["on"] / got["off"])
            on_kws.append(got["on"])
            off_kws.append(got["off"])
        q = quartiles(ratios)
        goal = GOALS.get(name)
        results[name] = {
            "n": len(encoded), "distinct_share": len(set(streams[name])) / len(streams[name]),
            "on_over_off": q, "ratios": ratios, "on_kw_s": on_kws, "off_kw_s": off_kws,
            "hit_rate": float(np.median(hit_rates)), "repeat_share": 1 - len(set(streams[name])) / len(streams[name]),
            "evictions": evictions,
            "goal": goal[0] if goal else None, "goal_met": goal[1](q["median"]) if goal else None,
        }
    report = {
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]),
        "queries": args.queries, "rounds": args.rounds, "zipf_s": args.zipf_s, "seed": args.seed,
        "cache_bytes": args.cache_bytes, "threads": args.threads, "dispatchers": args.dispatchers,
        "streams": results,
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version(),
                 "onnxruntime": __import__("onnxruntime").__version__},
    }
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    if args.markdown:
        Path(args.markdown).write_text(render(report), encoding="utf-8")
    return 0


def render(report: dict[str, Any]) -> str:
    lines = [
        "# The embedding cache: on vs off through the bucketed path (issue 13)",
        "",
        f"`{report['command']}`",
        "",
        f"The worker's Bucketer offline (`cpu` profile, {report['dispatchers']} dispatcher, max_in_flight window "
        f"4096), tokenisation done once outside the timings, the cache ({report['cache_bytes']:,} bytes, empty at "
        f"the start of each run) in front of the bucketer; on and off alternate, {report['rounds']} rounds, "
        f"ratio paired per round. {report['host']['cpus']} shared cores: absolute speeds drift, read the ratios.",
        "",
        "| stream | keywords | repeats | hit rate | cache on / off, median (q1-q3) | goal |",
        "|---|---:|---:|---:|---:|---|",
    ]
    labels = {"trec": "TREC 2005 efficiency, file order",
              "distinct": "the same, repeats removed",
              "zipf": f"Zipf(s={report['zipf_s']}) replay over the distinct queries"}
    for name, r in report["streams"].items():
        q = r["on_over_off"]
        goal = "" if r["goal"] is None else f"{r['goal']}: {'met' if r['goal_met'] else '**not met**'}"
        lines.append(f"| {labels[name]} | {r['n']:,} | {r['repeat_share']:.1%} | {r['hit_rate']:.1%} | "
                     f"{q['median']:.3f} ({q['q1']:.3f}-{q['q3']:.3f}) | {goal} |")
    lines += ["", "A repeat whose first occurrence is still in flight (inside the window, not yet embedded) "
              "is a miss: the hit rate is at most the repeat share.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
