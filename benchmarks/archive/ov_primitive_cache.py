"""oneDNN's primitive cache inside OpenVINO's CPU plugin: RSS against call time, paired.

    .venv/bin/python -m benchmarks.archive.ov_primitive_cache [--rounds 3] [--capacities 256 64] [--json PATH]

The plugin keeps two caches of per-shape state: its own runtime cache (CPU_RUNTIME_CACHE_CAPACITY,
capped by the worker at RUNTIME_CACHE_SHAPES) and oneDNN's global primitive cache (JIT-compiled
kernels; 1,024 entries unless ONEDNN_PRIMITIVE_CACHE_CAPACITY says otherwise, read once per
process). Issue 37's overload on OpenVINO grew the worker's RSS past the 64 MiB goal; this measures
what capping the second cache saves and costs. Each capacity runs in its own process (the variable
is read once), alternating with the default, one bf16 context with one thread:
- trickle: 60 shapes a trickle meets (1-6 rows x 3-12 tokens), each 10 times, after one warm pass;
- walk: 300 distinct shapes of up to 128 rows x 3-12 tokens, shuffled (an overload's batches);
- trickle again after the walk, and the RSS growth from the first call to the end.
Prints each run and, per capacity, the median and quartiles of its time over the default's, paired by round.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.ov_shape_rss import rss_mib
from worker.benchmark.report import quartiles

ROOT = Path(__file__).resolve().parents[2]
VARIABLE = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"


def child(seed: int) -> dict[str, float]:
    import numpy as np

    from engines.onnx_export.export import ensure_onnx
    from worker.backends.openvino import OpenVinoBackend

    context = OpenVinoBackend(ensure_onnx(), precision="bf16").create_context(0)
    start = rss_mib()
    walk = [(b, n) for n in range(3, 13) for b in range(1, 129)]
    random.Random(seed).shuffle(walk)
    trickle = [(b, n) for n in range(3, 13) for b in range(1, 7)]

    def run(shapes: list[tuple[int, int]]) -> float:
        t0 = time.perf_counter()
        for b, n in shapes:
            ids = np.ones((b, n), np.int64)
            context.run(ids, ids)
        return time.perf_counter() - t0

    run(trickle)
    result = {"trickle_s": run(trickle * 10), "walk_s": run(walk[:300]), "trickle_after_walk_s": run(trickle * 10)}
    return {**result, "rss_growth_mib": rss_mib() - start}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--capacities", type=int, nargs="+", default=[256, 64])
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child)))
        return 0
    configs: dict[str, str | None] = {"default": None, **{str(c): str(c) for c in args.capacities}}
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in configs}
    for r in range(args.rounds):
        for name in (list(configs) if r % 2 == 0 else list(reversed(configs))):
            env = {k: v for k, v in os.environ.items() if k != VARIABLE}
            if configs[name] is not None:
                env[VARIABLE] = str(configs[name])
            out = subprocess.run([sys.executable, "-m", __spec__.name, "--child", str(r)], env=env, cwd=ROOT,
                                 capture_output=True, text=True, check=True).stdout
            runs[name].append(json.loads(out.strip().splitlines()[-1]))
            print(r, name, {k: round(v, 2) for k, v in runs[name][-1].items()}, flush=True)
    summary: dict[str, dict[str, object]] = {}
    for name in configs:
        if name == "default":
            continue
        summary[name] = {"rss_growth_mib": [round(x["rss_growth_mib"]) for x in runs[name]]}
        for metric in ("trickle_s", "walk_s", "trickle_after_walk_s"):
            q = quartiles([a[metric] / b[metric] for a, b in zip(runs[name], runs["default"], strict=True)])
            summary[name][metric + "_ratio"] = {k: round(v, 3) for k, v in q.items()}
            print(f"{VARIABLE}={name}: {metric} {q['median']:.3f}x the default (q1 {q['q1']:.3f}, q3 {q['q3']:.3f})")
        print(f"{VARIABLE}={name}: RSS growth {summary[name]['rss_growth_mib']} MiB, default "
              f"{[round(x['rss_growth_mib']) for x in runs['default']]} MiB")
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "summary": summary}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
