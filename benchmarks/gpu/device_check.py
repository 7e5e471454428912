"""The worker's `--backend torch` on a lent GPU: parity through the worker's own path and the
per-shape forward table (benchmarks/gpu/device_run.sh runs it, then the bucketed/monolithic
comparison and the broker-free host path, and summarises the GPU's utilisation per stage).

    python -m benchmarks.gpu.device_check            # parity and shapes, into $OUT
    python -m benchmarks.gpu.device_check --summary  # stages.json + gpu-util.csv -> summary.md

- parity: the backend as `run` opens it (load_backend: the precision the parity gate picks against
  fp32 ONNX Runtime), every golden row tokenized by the worker's tokenizer and run through the real
  Bucketer into the `gpu` profile's CUDA graphs, against sentence-transformers' vectors
  (tests/data/golden/dev.npy): parity.json. Goal: min cos >= 0.9999.
- shapes: every captured graph of that backend (each bucket's tiers), 20 timed calls after 3
  warm-ups through its context, full batches of real-looking ids: shapes.json (ms per call,
  rows/s, tokens/s).

Each result is written as soon as it is measured, and each stage's start and end go to
stages.json, so a run cut short by its time limit still brings back what it did. Needs
.device/model (python -m benchmarks.gpu.prepare_device) or KWE_MODEL_DIR.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(os.environ.get("OUT", "/tmp/kwe-device-out"))
MODEL = Path(os.environ.get("KWE_MODEL_DIR") or ROOT / ".device" / "model")
GOLDEN = ROOT / "tests" / "data" / "golden"
TIMED_CALLS = int(os.environ.get("DEVICE_SHAPE_CALLS", "20"))  # fewer in the dry run on the fake
WARMUP_CALLS = 3


def record_stage(name: str, started: float, ended: float, ok: bool) -> None:
    """Appends a stage's wall-clock span to stages.json (the utilisation summary reads it)."""
    path = OUT / "stages.json"
    stages = json.loads(path.read_text()) if path.is_file() else []
    stages.append({"stage": name, "start": started, "end": ended, "ok": ok})
    path.write_text(json.dumps(stages, indent=2) + "\n")


def run_stage(name: str, body: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    started = time.time()
    print(f"== {name}", flush=True)
    try:
        result = body()
        ok = "error" not in result
    except Exception:  # noqa: BLE001 - a failed stage must not lose the next ones
        result, ok = {"error": traceback.format_exc()}, False
        print(result["error"], flush=True)
    result["stage_seconds"] = round(time.time() - started, 1)
    (OUT / f"{name}.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    record_stage(name, started, time.time(), ok)
    return result


def open_backend() -> Any:
    """The torch backend as `keyword-embedder run --backend torch` opens it: gate first."""
    from worker.backend_choice.select import gpu_present, load_backend
    from worker.settings.schema import Settings

    # KWE_PROFILES_FILE: the dry run's small profiles (tests/unit/benchmarks/gpu/test_gpu_scripts.py); on the GPU, the
    # shipped ones. DEVICE_DRY_RUN: the fake torch has a GPU, the machine no /dev/nvidia* node.
    has_gpu = (lambda: True) if os.environ.get("DEVICE_DRY_RUN") else gpu_present
    return load_backend(Settings(backend="torch", model_dir=str(MODEL),
                                 profiles_file=os.environ.get("KWE_PROFILES_FILE", "")), has_gpu=has_gpu)


def parity(loaded: Any) -> dict[str, Any]:
    from benchmarks.gpu.paired import cosines, embed_through_bucketer
    from worker.intake.tokenize import KeywordTokenizer

    texts = [json.loads(line)["text"] for line in (GOLDEN / "dev.jsonl").read_text(encoding="utf-8").splitlines()]
    rows = [e.ids for e in KeywordTokenizer.from_model(loaded.model).encode(texts)]
    got = embed_through_bucketer(loaded.backend, loaded.profile, rows)
    golden = np.load(GOLDEN / "dev.npy").astype(np.float32)
    if golden.shape == got.shape:  # the default model: sentence-transformers' own vectors
        reference, against = golden, "sentence-transformers (tests/data/golden/dev.npy)"
    else:  # another model (the dry run's tiny one): its fp32 ONNX export in ONNX Runtime
        from worker.backend_choice.torch_choice import reference_rows

        reference, against = reference_rows(loaded.model, rows), "the model's fp32 ONNX export in ONNX Runtime"
    cos = cosines(got, reference)
    return {"rows": len(rows), "reference": against, "min_cos": float(cos.min()), "mean_cos": float(cos.mean()),
            "goal": 0.9999, "passed": bool(cos.min() >= 0.9999), "precision": loaded.settings.torch_precision,
            "reason": loaded.reason, "device": getattr(loaded.backend, "device_name", ""),
            "profile": loaded.profile.name}


def shapes(loaded: Any) -> dict[str, Any]:
    from worker.backends.torch_plan import bucket_graphs

    backend, rng = loaded.backend, np.random.default_rng(0)
    table = []
    for shape in backend.shapes:
        ctx = backend.create_context(shape.bucket)
        try:
            for graph in bucket_graphs(shape):
                # Word pieces from the vocabulary's middle (a real query's, not special tokens).
                vocab = loaded.model.vocab_size
                ids = rng.integers(min(1000, vocab // 2), vocab, size=(graph.batch, graph.length))
                ids[:, 0], ids[:, -1] = 101, 102
                mask = np.ones_like(ids)
                for _ in range(WARMUP_CALLS):
                    ctx.run(ids, mask)
                times = []
                for _ in range(TIMED_CALLS):
                    t0 = time.perf_counter()
                    ctx.run(ids, mask)
                    times.append(time.perf_counter() - t0)
                ms = float(np.median(times)) * 1000
                table.append({"bucket": shape.bucket, "batch": graph.batch, "len": graph.length, "ms": round(ms, 3),
                              "rows_per_s": round(graph.batch / ms * 1000),
                              "tokens_per_s": round(graph.batch * graph.length / ms * 1000)})
                print(f"  {graph.batch:>5} x {graph.length:<4} {ms:8.3f} ms  {graph.batch / ms * 1000:>10,.0f} rows/s",
                      flush=True)
        finally:
            ctx.close()
    return {"device": getattr(backend, "device_name", ""), "precision": loaded.settings.torch_precision,
            "calls_per_shape": TIMED_CALLS, "note": "through the context: staging, copies in and out, the replay",
            "shapes": table}


def summary() -> int:
    """summary.md: what each stage wrote, and the GPU's utilisation while it ran (gpu-util.csv)."""
    stages = json.loads((OUT / "stages.json").read_text()) if (OUT / "stages.json").is_file() else []
    samples: list[tuple[float, float, float]] = []
    if (OUT / "gpu-util.csv").is_file():
        for row in csv.reader((OUT / "gpu-util.csv").read_text().splitlines()):
            try:  # timestamp (YYYY/MM/DD HH:MM:SS.mmm), utilization.gpu [%], memory.used [MiB]
                t = time.mktime(time.strptime(row[0].strip().split(".")[0], "%Y/%m/%d %H:%M:%S"))
                samples.append((t + float("0." + row[0].strip().split(".")[1]), float(row[1]), float(row[2])))
            except (IndexError, ValueError):
                continue
    lines = ["# Device run", "", "| stage | seconds | ok | GPU utilisation mean (max) | memory max, MiB |",
             "|---|---:|---|---:|---:|"]
    for s in stages:
        inside = [x for x in samples if s["start"] <= x[0] <= s["end"]]
        util = (f"{np.mean([x[1] for x in inside]):.0f}% ({max(x[1] for x in inside):.0f}%)" if inside else "-")
        mem = f"{max(x[2] for x in inside):,.0f}" if inside else "-"
        lines.append(f"| {s['stage']} | {s['end'] - s['start']:.0f} | {'yes' if s['ok'] else 'NO'} | {util} | {mem} |")
    (OUT / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--summary", action="store_true", help="summarise stages.json and gpu-util.csv, and exit")
    ap.add_argument("--stage", help="record one stage run by the shell script: NAME START END OK", nargs=4)
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    if args.summary:
        return summary()
    if args.stage:
        name, start, end, ok = args.stage
        record_stage(name, float(start), float(end), ok == "0")
        return 0
    holder: dict[str, Any] = {}

    def opened() -> dict[str, Any]:
        t0 = time.monotonic()
        holder["loaded"] = open_backend()
        loaded = holder["loaded"]
        return {"seconds": round(time.monotonic() - t0, 1), "precision": loaded.settings.torch_precision,
                "reason": loaded.reason, "profile": loaded.profile.name,
                "graphs_per_bucket": [len(t) for t in getattr(loaded.backend, "_slots", [])]}

    run_stage("open", opened)
    if "loaded" not in holder:
        return 1
    try:
        run_stage("parity", lambda: parity(holder["loaded"]))
        run_stage("shapes", lambda: shapes(holder["loaded"]))
    finally:
        holder["loaded"].backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
