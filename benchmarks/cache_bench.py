"""What the embedding cache gives and costs, through the worker's bucketed path offline.

    .venv/bin/python -m benchmarks.cache_bench --json benchmarks/results/cache/cache.json \
        --markdown benchmarks/results/cache/cache.md

Three streams, tokenized once up front (outside the timings):
- trec:     the TREC 2005 efficiency queries in file order (repeats as they come);
- distinct: the same with every repeat removed (the cache can only cost: goal <= 2%);
- zipf:     as many draws as trec, from the distinct queries with Zipf(s=1.0) popularity
            (rank r drawn with probability proportional to 1/r, ranks a seeded shuffle).
Each stream runs through `worker.benchmark.policies.run_bucketed` (the worker's Bucketer, the `cpu`
profile, the max_in_flight window) in up to three modes, rotating their order each round:
- off: no cache;
- lru: the cache in front (get/put; a fresh, empty one of the default cache_bytes per run): a
  hit is answered at once and skips the bucketer and the model; a repeat whose first
  occurrence is still in flight misses and is computed again;
- single-flight: the same cache with lookup/complete: such a repeat joins the computation
  in flight and gets its vector.
The ratios to `off` are paired per round (median, q1-q3). Hit rates are the cache's own
counters (hits plus joins, over lookups). The distinct stream has no repeats, so it runs off
and single-flight only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from engines.onnx_export.export import ensure_onnx
from worker.core.model import default_model_dir
from worker.core.profiles import load_profile
from worker.backends.onnxruntime import OnnxRuntimeBackend
from worker.embedding_cache import EmbeddingCache, key
from worker.settings.schema import DEFAULT_CACHE_BYTES
from worker.benchmark.inputs import read_queries
from worker.benchmark.policies import BucketerOptions, run_bucketed
from worker.benchmark.report import quartiles
from worker.intake.tokenize import KeywordTokenizer

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_QUERIES = ROOT.parent / "shared" / "data" / "queries" / "terabyte05-efficiency.tsv"
GOALS = {"distinct": ("cost <= 2%", lambda r: r >= 0.98), "zipf": (">= 2x", lambda r: r >= 2.0)}
MODES = {"trec": ("off", "lru", "single-flight"), "distinct": ("off", "single-flight"),
         "zipf": ("off", "lru", "single-flight")}


def zipf_replay(texts: list[str], n: int, s: float, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    ranked = [texts[i] for i in rng.permutation(len(texts))]
    p = 1.0 / np.arange(1, len(ranked) + 1) ** s
    draws = rng.choice(len(ranked), size=n, p=p / p.sum())
    return [ranked[i] for i in draws]


def cache_cost_us(encoded: list[Any], dim: int, repeats: int = 5) -> float:
    """Median microseconds per keyword of what the cache adds on a miss: key, lookup, complete.

    Timed alone (no model), so the noise of a shared machine's inference does not drown it; the
    share of the pipeline's per-keyword time it takes is this over the model's time per keyword.
    """
    row = np.ones(dim, dtype=np.float32)
    times = []
    for _ in range(repeats):
        cache: EmbeddingCache[int] = EmbeddingCache(DEFAULT_CACHE_BYTES, dim)
        start = time.perf_counter()
        for i, enc in enumerate(encoded):
            k = key(enc.ids)
            if cache.lookup(k, i).outcome == "miss":
                cache.complete(k, row)
        times.append((time.perf_counter() - start) / len(encoded) * 1e6)
    return float(np.median(times))


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
    ap.add_argument("--cost-only", action="store_true",
                    help="only the cache's own CPU cost per keyword on the distinct stream (no model runs)")
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
    if args.cost_only:
        # The cache's CPU cost per keyword against the model path's time per keyword (a bucketed
        # run without the cache on the same queries), alternated and paired per round.
        enc = tokenizer.encode(distinct)
        run_bucketed(enc[:1000], profile, backend, options=BucketerOptions(dispatchers=args.dispatchers))  # warm-up
        shares, costs, model_us = [], [], []
        for _ in range(args.rounds):
            cost = cache_cost_us(enc, backend.dim, repeats=3)
            per_kw = 1e6 / run_bucketed(enc[:2000], profile, backend, options=BucketerOptions(dispatchers=args.dispatchers)).keywords_per_s
            costs.append(cost)
            model_us.append(per_kw)
            shares.append(cost / per_kw)
            print(f"cache {cost:.1f} us/keyword, model path {per_kw:.0f} us/keyword: {cost / per_kw:.2%}", flush=True)
        out = {"command": "python " + " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]), "n": len(enc),
               "cache_us_per_keyword": costs, "model_path_us_per_keyword": model_us,
               "cost_share": quartiles(shares)}
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
        return 0
    run_bucketed(tokenizer.encode(trec[:1000]), profile, backend, options=BucketerOptions(dispatchers=args.dispatchers))  # warm-up

    results: dict[str, Any] = {}
    for name in wanted:
        encoded = tokenizer.encode(streams[name])
        modes = MODES[name]
        kws: dict[str, list[float]] = {m: [] for m in modes}
        hit_rates: dict[str, list[float]] = {m: [] for m in modes if m != "off"}
        evictions: dict[str, list[int]] = {m: [] for m in modes if m != "off"}
        for r in range(args.rounds):
            # Plain rotation: each mode takes each position equally often (rotating and then
            # reversing every other round, as worker.benchmark does for three or more policies,
            # would keep two modes in the same order every round).
            k = r % len(modes)
            order = list(modes[k:] + modes[:k])
            for mode in order:
                cache = EmbeddingCache(args.cache_bytes, backend.dim) if mode != "off" else None
                run = run_bucketed(encoded, profile, backend, options=BucketerOptions(dispatchers=args.dispatchers), cache=cache,
                                   coalesce=mode == "single-flight")
                kws[mode].append(run.keywords_per_s)
                if cache is not None:
                    st = cache.stats()
                    hit_rates[mode].append(st.hit_rate)
                    evictions[mode].append(st.evictions)
                print(f"{name} round {r + 1}/{args.rounds} {mode:>13}: {run.keywords_per_s:8,.0f} kw/s"
                      + (f"  {cache.stats().line()}" if cache is not None else ""), flush=True)
        goal = GOALS.get(name)
        ratios = {m: quartiles([a / b for a, b in zip(kws[m], kws["off"])]) for m in modes if m != "off"}
        results[name] = {
            "n": len(encoded), "repeat_share": 1 - len(set(streams[name])) / len(streams[name]),
            "keywords_per_s": kws, "over_off": ratios,
            "hit_rate": {m: float(np.median(v)) for m, v in hit_rates.items()}, "evictions": evictions,
            "goal": goal[0] if goal else None,
            "goal_met": {m: goal[1](q["median"]) for m, q in ratios.items()} if goal else None,
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
        f"the start of each run) in front of the bucketer; the modes rotate their order, {report['rounds']} rounds, "
        f"ratio paired per round. {report['host']['cpus']} shared cores: absolute speeds drift, read the ratios.",
        "",
        "| stream | keywords | repeats | mode | hit rate | vs cache off, median (q1-q3) | goal |",
        "|---|---:|---:|---|---:|---:|---|",
    ]
    labels = {"trec": "TREC 2005 efficiency, file order",
              "distinct": "the same, repeats removed",
              "zipf": f"Zipf(s={report['zipf_s']}) replay over the distinct queries"}
    for name, r in report["streams"].items():
        for mode, q in r["over_off"].items():
            goal = "" if r["goal"] is None else f"{r['goal']}: {'met' if r['goal_met'][mode] else '**not met**'}"
            lines.append(f"| {labels[name]} | {r['n']:,} | {r['repeat_share']:.1%} | {mode} | "
                         f"{r['hit_rate'][mode]:.1%} | {q['median']:.3f} ({q['q1']:.3f}-{q['q3']:.3f}) | {goal} |")
    lines += ["", "Hit rate: lookups the model did not run for (hits, plus joins for single-flight) over all "
              "lookups; at most the repeat share. With `lru`, a repeat whose first occurrence is still in "
              "flight (within the 4,096-keyword window, not yet embedded) misses and is computed again.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
