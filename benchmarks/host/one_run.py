"""One broker-free run of the whole worker: `keyword-embedder run`'s pipeline, as `build_pipeline`
assembles it from the settings, with the model and the broker taken out (benchmarks/host/doubles.py).

Every stage is the worker's own: decode and validate, offset tracking, tokenize, the cache lookup,
the bucketer, output encoding, the produce call and its delivery callback, commit bookkeeping.
Prints one JSON object: keywords/s, the process's CPU per keyword, and each thread's.

    python -m benchmarks.host.one_run --n 20000 [--setting output_encoding=binary ...]

Imports only what an older checkout has too (`worker.app.build_pipeline`, `wire_pipeline`,
`worker.backend_choice.select.open_backend`), so pipeline_bench.py runs it against a baseline.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import orjson

from .doubles import AckingProducer, MemoryConsumer, NullBackend, partitioned

TOPIC = "host-in"


def read_texts(path: Path, limit: int, skip: int = 0) -> list[tuple[str, str]]:
    """`limit` (id, text) rows of a TSV, from row `skip` on, wrapping around (the IDs stay unique
    per run; with the cache off a repeated text costs what a new one does)."""
    rows = []
    with path.open(encoding="utf-8", newline="") as fh:
        for line in fh:
            qid, _, text = line.rstrip("\r\n").partition("\t")
            if text.strip():
                rows.append((qid, text))
    if not rows:
        raise SystemExit(f"{path}: no keywords")
    return [rows[(skip + i) % len(rows)] for i in range(limit)]


def thread_cpu() -> dict[int, float]:
    """CPU seconds of each thread of this process, by native thread id (/proc/self/task)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(task.name)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def parse_setting(text: str, settings: Any) -> tuple[str, Any]:
    name, _, raw = text.partition("=")
    current = getattr(settings, name)
    value: Any = raw
    if isinstance(current, bool):
        value = raw.lower() in ("1", "true", "yes")
    elif isinstance(current, int):
        value = int(raw)
    elif isinstance(current, float):
        value = float(raw)
    return name, value


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--n", type=int, default=100000,
                    help="keywords after the first --warmup (those done after --warmup-s are measured)")
    ap.add_argument("--warmup", type=int, default=3000)
    ap.add_argument("--warmup-s", type=float, default=1.5,
                    help="and at least this long from the first acknowledgement: flow control starts at "
                         "its smallest in-flight bound (256) and sets it from the rate measured over its "
                         "first second, so a shorter warm-up measures start-up, not the steady state")
    ap.add_argument("--partitions", type=int, default=6)
    ap.add_argument("--poll-records", type=int, default=0,
                    help="at most this many records a consume (a live stream's small fetches; 0: a backlog's)")
    ap.add_argument("--skip", type=int, default=0, help="start at this row of the data (wrapping around)")
    ap.add_argument("--setting", action="append", default=[], metavar="NAME=VALUE",
                    help="a worker setting (default: the worker's defaults, the embedding cache off)")
    ap.add_argument("--backend", default="null", help="null (no model) or a real backend name")
    ap.add_argument("--null-vectors", choices=("unit", "random"), default="unit",
                    help="what the null backend answers: one-hot unit vectors, or random unit vectors (what a "
                         "real model's cost to encode as JSON)")
    ap.add_argument("--hold-cpu", type=int, default=-1,
                    help="once the pipeline runs, hold its poll thread and kwe-* threads on this CPU (what "
                         "interpreter_cpu does, done here so that a checkout from before it is held the same "
                         "way); -1: not held")
    args = ap.parse_args(argv)

    from worker import app
    from worker.backend_choice import select
    from worker.settings.schema import Settings

    settings = Settings(input_topic=TOPIC, output_topic="host-out", dead_letter_topic="host-dlq",
                        group_id="host", backend="onnxruntime" if args.backend == "null" else args.backend,
                        cache_bytes=0)
    overrides = dict(parse_setting(s, settings) for s in args.setting)
    settings = dataclasses.replace(settings, **overrides)

    rows = read_texts(args.data, args.warmup + args.n, args.skip)
    records = [(f"k{i}-{qid}".encode(), orjson.dumps({"id": f"k{i}-{qid}", "text": text}))
               for i, (qid, text) in enumerate(rows)]
    logs = partitioned(TOPIC, records, args.partitions)
    clients: dict[str, Any] = {}

    if os.environ.get("DEVICE_DRY_RUN"):  # a fake GPU library on a machine without /dev/nvidia* (the dry run)
        load_backend = select.load_backend

        def with_gpu(*a: Any, **kw: Any) -> Any:
            return load_backend(*a, **{**kw, "has_gpu": lambda: True})
        select.load_backend = with_gpu  # type: ignore[assignment]
    if args.backend == "null":
        def null_backend(kind: Any, model: Any, profile: Any = None, **_: Any) -> NullBackend:
            return NullBackend(model.dim, vectors=args.null_vectors)
        select.open_backend = null_backend  # type: ignore[assignment]

    wire = app.wire_pipeline

    def wire_in_memory(*a: Any, **kw: Any) -> Any:
        kw["consumer_factory"] = lambda config: clients.setdefault("consumer", MemoryConsumer(config, logs, TOPIC,
                                                                                    per_poll=args.poll_records))
        kw["producer_factory"] = lambda config: clients.setdefault("producer", AckingProducer(config))
        return wire(*a, **kw)

    app.wire_pipeline = wire_in_memory  # type: ignore[assignment]
    assembled = app.build_pipeline(settings)
    pipeline = assembled.pipeline
    try:  # what `keyword-embedder run` does after start-up (a checkout older than it lacks it)
        from worker.operations.gc_tuning import settle_for_steady_state
    except ImportError:
        pass
    else:
        settle_for_steady_state()
    producer: AckingProducer = clients["producer"]
    total = len(records)
    marks: dict[str, Any] = {}

    def watch() -> None:
        while producer.acked == 0:
            time.sleep(0.0005)
        if args.hold_cpu >= 0:  # every thread has started by the first acknowledgement
            held = [threading.main_thread().native_id] + [t.native_id for t in threading.enumerate()
                                                          if t.name.startswith("kwe-") and t.native_id is not None]
            for tid in held:
                os.sched_setaffinity(tid, {args.hold_cpu})
        started = time.perf_counter()
        while producer.acked < args.warmup or time.perf_counter() - started < args.warmup_s:
            time.sleep(0.0005)
        if producer.acked >= total:
            marks["short"] = True
            pipeline.request_stop()
            return
        marks["acked0"] = producer.acked
        marks["t0"], marks["cpu0"], marks["threads0"] = time.perf_counter(), time.process_time(), thread_cpu()
        while producer.acked < total:
            time.sleep(0.0005)
        marks["t1"], marks["cpu1"], marks["threads1"] = time.perf_counter(), time.process_time(), thread_cpu()
        marks["names"] = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
        pipeline.request_stop()

    watcher = threading.Thread(target=watch, name="host-watch", daemon=True)
    watcher.start()
    code = pipeline.run()
    watcher.join(5)
    assembled.close()
    if marks.get("short"):
        raise SystemExit(f"all {total} keywords were done within the warm-up: raise --n")
    if "t1" not in marks:
        raise SystemExit(f"the pipeline stopped (exit {code}) after {producer.acked} of {total} acknowledgements")
    names = marks["names"]
    names[threading.main_thread().native_id] = "poll"
    n = total - marks["acked0"]  # the keywords acknowledged after the warm-up
    wall = marks["t1"] - marks["t0"]
    per_thread: dict[str, float] = {}
    for tid, after in marks["threads1"].items():
        name = names.get(tid, "other")
        name = "dispatchers" if name.startswith("kwe-dispatch") else name
        if name == "host-watch":
            continue
        spent = after - marks["threads0"].get(tid, 0.0)
        per_thread[name] = per_thread.get(name, 0.0) + spent * 1e6 / n
    result = {"n": n, "keywords_per_s": n / wall, "cpu_us_per_keyword": (marks["cpu1"] - marks["cpu0"]) * 1e6 / n,
              "threads_us_per_keyword": {k: round(v, 2) for k, v in sorted(per_thread.items())},
              "produced_value_bytes": producer.value_bytes, "exit": code, "backend": args.backend,
              "settings": overrides, "hold_cpu": args.hold_cpu}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
