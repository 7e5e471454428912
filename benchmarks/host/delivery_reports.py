"""What a produced record's delivery callback costs the worker's threads, compiled
(worker/kafka/_reports.c) against its Python form (worker/kafka/reports.py's _PythonSink),
alternated and paired:

    python -m benchmarks.host.delivery_reports --rounds 15 --json benchmarks/results/host/delivery_reports.json

`make`: the output thread's part, a record's callback made as OutputProducer.produce makes it (with
the embedding's acknowledgement, a partial of a list's append, as worker/ledger/acks.py hands it);
`call`: the delivery thread's part, the callback called as confluent-kafka calls it, for a
delivery. Thread CPU time, nanoseconds a record, median (q1-q3) over the rounds, with the
collector off (the worker raises its young-generation threshold to 20,000 allocations:
worker/operations/gc_tuning.py; left on, a young collection over these lists would dominate both).
What neither counts is confluent-kafka's own C work per report (the Message object, copies of the
value, key and headers, the interpreter lock taken for each), the same for both forms.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.host.json_rows import cpu_model, quartiles
from worker.kafka.reports import REPORTS_COMPILED, report_sink


def nothing(*_: Any) -> None:
    pass


def one_round(sink: Any, n: int) -> tuple[float, float]:
    acked: list[int] = []
    start = time.thread_time()
    reports = [sink.report("out", partial(acked.append, i), None) for i in range(n)]
    made = time.thread_time()
    for report in reports:
        report(None, None)
    called = time.thread_time()
    if len(acked) != n or sink.take_delivered() != n:
        raise SystemExit("a report did not acknowledge its record")
    return (made - start) / n * 1e9, (called - made) / n * 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("-n", type=int, default=20000, help="records a round")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not REPORTS_COMPILED:
        raise SystemExit("worker/kafka/_reports.c is not built here: nothing to compare")
    sinks = {"compiled": report_sink(nothing, nothing), "python": report_sink(nothing, nothing, compiled=False)}
    times: dict[str, dict[str, list[float]]] = {form: {"make": [], "call": []} for form in sinks}
    gc.disable()
    try:
        for r in range(args.rounds):
            for form in (list(sinks) if r % 2 == 0 else list(reversed(sinks))):
                make, call = one_round(sinks[form], args.n)
                times[form]["make"].append(make)
                times[form]["call"].append(call)
    finally:
        gc.enable()
    results: dict[str, Any] = {"command": f"python -m benchmarks.host.delivery_reports --rounds {args.rounds} -n {args.n}",
                               "machine": cpu_model(), "ns_per_record": {}}
    for form, parts in times.items():
        results["ns_per_record"][form] = {}
        for part, values in parts.items():
            q1, med, q3 = quartiles(values)
            results["ns_per_record"][form][part] = {"median": med, "q1": q1, "q3": q3, "rounds": values}
            print(f"{form:8s} {part}: {med:6.0f} ns a record ({q1:.0f}-{q3:.0f})")
    saved = [(pm + pc) - (cm + cc) for pm, pc, cm, cc in zip(times["python"]["make"], times["python"]["call"],
                                                            times["compiled"]["make"], times["compiled"]["call"])]
    q1, med, q3 = quartiles(saved)
    results["saved_ns_per_record"] = {"median": med, "q1": q1, "q3": q3}
    print(f"compiled saves {med:.0f} ns a record ({q1:.0f}-{q3:.0f}), paired per round")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
