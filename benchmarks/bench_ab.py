"""The offline benchmark (`keyword-embedder bench`) of this checkout against an older one, paired.

    git worktree add /tmp/kwe-old <old commit>
    .venv/bin/python -m benchmarks.bench_ab --baseline-root /tmp/kwe-old --pairs 6 \
        --json /tmp/bench_ab.json

Each run is one `python -m worker.cli bench` process in that checkout (`python -m` imports from the
working directory), the bucketed policy only (no latency levels, no second profile); the pairs
alternate which side goes first and the ratio new/old of bucketed keywords/s is paired per pair
(the box is shared and noisy: only same-run ratios mean anything). The offline benchmark calls the
backend directly, so no embedding cache is involved and repeating the queries measures no cache.

Or one checkout with different arguments per side, e.g. the auto backend against ONNX Runtime fp32:

    .venv/bin/python -m benchmarks.bench_ab --new-args="--backend auto" --old-args="--backend onnxruntime" \
        --bench-args="--threads 1 --dispatchers 2" --label offline --json benchmarks/results/backends/backends_offline.json
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.kafka_vs_offline import DEFAULT_DATA, FALLBACK_DATA
from worker.benchmark.report import quartiles

ROOT = Path(__file__).resolve().parents[1]


def bucketed_kw_s(root: Path, data: Path, limit: int, rounds: int, extra: list[str]) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        subprocess.run([sys.executable, "-m", "worker.cli", "bench", str(data), "--limit", str(limit),
                        "--rounds", str(rounds), "--no-latency", "--compare-profile", "", "--quiet",
                        "--json", str(out), *extra], cwd=root, check=True, stdout=subprocess.DEVNULL)
        return float(json.loads(out.read_text())["policies"]["bucketed"]["keywords_per_s"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline-root", type=Path, default=ROOT, help="a checkout of the old version (default: "
                    "this one, with --new-args / --old-args telling the sides apart)")
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA if DEFAULT_DATA.exists() else FALLBACK_DATA)
    ap.add_argument("--limit", type=int, default=6000, help="queries per bench run")
    ap.add_argument("--rounds", type=int, default=2, help="rounds inside each bench run")
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--bench-args", default="", help="extra `bench` arguments for both sides")
    ap.add_argument("--new-args", default="", help="extra `bench` arguments of the new side (one string)")
    ap.add_argument("--old-args", default="", help="extra `bench` arguments of the old side (one string)")
    ap.add_argument("--label", default="", help="the bar's label in docs/img plots")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    extra = args.bench_args.split()
    side_args = {"new": extra + args.new_args.split(), "old": extra + args.old_args.split()}
    sides = {"new": ROOT, "old": args.baseline_root.resolve()}
    pairs = []
    for i in range(args.pairs):
        order = ("new", "old") if i % 2 == 0 else ("old", "new")
        kw = {name: bucketed_kw_s(sides[name], args.data, args.limit, args.rounds, side_args[name]) for name in order}
        pairs.append({"pair": i, "order": list(order), "new_kw_s": kw["new"], "old_kw_s": kw["old"],
                      "ratio": kw["new"] / kw["old"]})
        print(f"pair {i}: new {kw['new']:7.0f} kw/s  old {kw['old']:7.0f} kw/s  ratio {kw['new'] / kw['old']:.3f}",
              flush=True)
    ratio = quartiles([p["ratio"] for p in pairs])
    print(f"new/old bucketed: median {ratio['median']:.3f} (q1 {ratio['q1']:.3f}, q3 {ratio['q3']:.3f})")
    if args.json:
        args.json.write_text(json.dumps({"dataset": args.data.name, "limit": args.limit, "rounds": args.rounds,
                                         "bench_args": args.bench_args, "baseline": str(args.baseline_root),
                                         "new_args": args.new_args, "old_args": args.old_args, "label": args.label,
                                         "ratio_new_over_old": ratio, "pairs": pairs}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
