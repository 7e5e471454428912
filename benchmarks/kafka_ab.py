"""Two worker versions through the same broker, paired: is the new one as fast as the old?

    git worktree add /tmp/kwe-old <old commit>
    deploy/local/with-kafka.sh .venv/bin/python -m benchmarks.kafka_ab --baseline-root /tmp/kwe-old \
        --json /tmp/kafka_ab.json

Or one checkout with different settings per side, e.g. exactly-once against at-least-once:

    deploy/local/with-kafka.sh .venv/bin/python -m benchmarks.kafka_ab \
        --new-args="--processing-guarantee exactly-once" --json benchmarks/results/kafka/kafka_eos.json

Each side is one `keyword-embedder run` process (default settings, its own group and topics),
warm and in its group before the first round. A round publishes N keywords to one side and ends
when the last embedding is read back; rounds alternate which side goes first, and the ratio
new/old is paired per round (the box is shared and noisy: only same-run ratios mean anything).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import uuid
from pathlib import Path

from confluent_kafka import Consumer

from benchmarks.host.pipeline_bench import paired_ratios
from benchmarks.kafka_vs_offline import DEFAULT_DATA, FALLBACK_DATA, kafka_bootstrap_from_env, kafka_round
from tests.kafka_tools import WorkerProcess
from worker.formats.keyword_files import read_keywords
from worker.kafka.admin import ensure_topics

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline-root", type=Path, default=ROOT, help="a checkout of the old version (default: "
                    "this one, to compare settings)")
    ap.add_argument("--new-args", default="", help="extra worker arguments of the new side (one string)")
    ap.add_argument("--old-args", default="", help="extra worker arguments of the old side (one string)")
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA if DEFAULT_DATA.exists() else FALLBACK_DATA)
    ap.add_argument("-n", type=int, default=0, help="keywords per round (0: the whole file)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    bootstrap = kafka_bootstrap_from_env()
    rows = list(read_keywords(args.data, limit=args.n or None))
    logdir = Path(tempfile.mkdtemp(prefix="kwe-ab-"))
    sides: dict[str, tuple[WorkerProcess, Consumer, str]] = {}
    try:
        for name, root, extra in (("new", ROOT, args.new_args), ("old", args.baseline_root.resolve(), args.old_args)):
            run = f"ab-{name}-{uuid.uuid4().hex[:6]}"
            topics = (f"{run}-in", f"{run}-out", f"{run}-dlq")
            ensure_topics(bootstrap, {topics[0]: 6, topics[1]: 6, topics[2]: 1})
            worker = WorkerProcess(bootstrap, *topics, run, logdir / f"{name}.log", shlex.split(extra),
                                   root=root).start()
            # earliest: the topics are fresh and keys carry the round's tag; with latest, a reader
            # assigned after the warm-up's outputs were written waited for them forever.
            reader = Consumer({"bootstrap.servers": bootstrap, "group.id": f"{run}-reader",
                               "auto.offset.reset": "earliest", "enable.auto.commit": False, "fetch.wait.max.ms": 5})
            reader.subscribe([topics[1]])
            sides[name] = (worker, reader, topics[0])
        for name, (worker, reader, topic) in sides.items():
            worker.wait_ready(120)
            reader.consume(1, timeout=3.0)
            kafka_round(f"warmup-{name}", rows[:500], bootstrap, topic, reader)
        results = []
        for r in range(args.rounds):
            order = ("new", "old") if r % 2 == 0 else ("old", "new")
            kw = {}
            for name in order:
                _, reader, topic = sides[name]
                kw[name] = len(rows) / kafka_round(f"r{r}", rows, bootstrap, topic, reader)
            results.append({"round": r, "order": list(order), "new_kw_s": kw["new"], "old_kw_s": kw["old"],
                            "ratio": kw["new"] / kw["old"]})
            print(f"round {r}: new {kw['new']:7.0f} kw/s  old {kw['old']:7.0f} kw/s  ratio {kw['new'] / kw['old']:.3f}",
                  flush=True)
    finally:
        for worker, reader, _ in sides.values():
            reader.close()
            worker.stop()
    ratio = paired_ratios([{"order": x["order"], "sides": {"new": {"kw_s": x["new_kw_s"]}, "old": {"kw_s": x["old_kw_s"]}}}
                           for x in results], "new", "old", "kw_s")
    summary = {"dataset": args.data.name, "n": len(rows), "rounds": args.rounds, "cpu_count": os.cpu_count(),
               "new_args": args.new_args, "old_args": args.old_args,
               "ratio_new_over_old": ratio, "rounds_detail": results}
    balanced = f"; order-balanced {ratio['balanced']:.3f}" if "balanced" in ratio else ""
    print(f"new/old: median {ratio['median']:.3f} (q1 {ratio['q1']:.3f}, q3 {ratio['q3']:.3f}){balanced}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
