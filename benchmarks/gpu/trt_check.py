"""The first TensorRT run, in one script (benchmarks/gpu/trt_check.sh runs it; under 5 minutes on a GPU).

NOT YET RUN ON A GPU: written for the day a GPU with TensorRT 10 and pycuda is lent; its logic
runs on CPU in tests/test_gpu_scripts.py against the fake tensorrt/pycuda of
tests/test_tensorrt_logic.py. Stages, each written to $OUT/trt-<stage>.json when it ends (a
failed stage records its traceback and the next one still runs, unless it needs the plan):

1. build: the `gpu` profile's plan from the ONNX export, FP16, with a timing cache;
2. buckets: every bucket once at its largest shape, each on its own thread and context, as
   the bucketer's dispatchers do;
3. parity: every golden row through the real bucketer on TensorRT against ONNX Runtime on CPU
   (same ONNX file) and against the sentence-transformers reference: cosine >= 0.999 (FP16);
4. bench: bucketed vs monolithic vs sorted through the benchmark suite on the plan (the
   bucketed policy is the real bucketer; the baselines run on the context whose profile covers
   each batch), paired rounds;
5. mono: bucketed (`gpu` plan) vs monolithic through the real bucketer on a second, one-bucket
   plan (256 x 256: what a fixed-shape engine without bucketing computes), paired rounds;
   skipped when the time budget is spent.

$OUT/trt-check.json sums it up, with `ok` false when a stage failed or parity missed.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.gpu.paired import cosines, embed_through_bucketer, paired_bucketed  # noqa: E402
from kwe_core.profiles import Bucket, Profile, load_profile  # noqa: E402

GOLDEN = ROOT / "tests" / "data" / "golden"
DATA = ROOT / "tests" / "data" / "queries" / "terabyte05-20k.tsv"
MIN_COSINE = 0.999  # FP16 plan vs FP32 reference
# A plan without bucketing: one profile at the model's length, batches of 256, pad to the bound.
MONO = Profile("mono", (Bucket(256, 256, 256),), 256 * 256, "bucket", 8, "one bucket: no length bucketing")


def run_each_bucket(backend: Any, profile: Profile) -> list[dict[str, Any]]:
    """Bucket i once at (max_batch_i, bound_i) on its own thread and context; wall ms of the second run."""
    results: list[dict[str, Any]] = [{} for _ in profile.buckets]

    def one(i: int, b: Bucket) -> None:
        try:
            ctx = backend.create_context(i)
            try:
                rng = np.random.default_rng(i)
                ids = rng.integers(1000, 30000, size=(b.max_batch, b.max_len), dtype=np.int64)
                ids[:, 0], ids[:, -1] = 101, 102
                mask = np.ones_like(ids)
                ctx.run(ids, mask)  # first run: lazy allocations
                t0 = time.perf_counter()
                out = ctx.run(ids, mask)
                ms = (time.perf_counter() - t0) * 1000
                results[i] = {"bucket": i, "shape": [b.max_batch, b.max_len], "ms": round(ms, 3),
                              "finite": bool(np.isfinite(out).all()),
                              "unit_norm": bool(np.allclose(np.linalg.norm(out, axis=1), 1.0, atol=1e-2))}
            finally:
                ctx.close()
        except Exception as exc:  # noqa: BLE001 - recorded per bucket, the others still run
            results[i] = {"bucket": i, "error": repr(exc)}

    threads = [threading.Thread(target=one, args=(i, b)) for i, b in enumerate(profile.buckets)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


class Stages:
    """Runs stages in order, each recorded to $OUT as it ends; a failure is recorded, not raised."""

    def __init__(self, out: Path, budget_s: float) -> None:
        self.out, self.budget_s, self.t0 = out, budget_s, time.monotonic()
        self.summary: dict[str, Any] = {"ok": True, "stages": {}}

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.t0)

    def run(self, name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        print(f"== {name} ({self.left():.0f} s of budget left)", flush=True)
        t0 = time.monotonic()
        try:
            result = fn()
        except Exception:  # noqa: BLE001 - one failed stage must not lose the others
            result = {"error": traceback.format_exc()}
            print(result["error"], flush=True)
        result["stage_seconds"] = round(time.monotonic() - t0, 1)
        ok = "error" not in result and result.get("ok", True)
        self.summary["stages"][name] = {"ok": ok, "seconds": result["stage_seconds"]}
        self.summary["ok"] = self.summary["ok"] and ok
        (self.out / f"trt-{name}.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
        return None if "error" in result else result


def main(out: Path | None = None, *, onnx: Path | None = None, limit: int = 20000, rounds: int = 3,
         budget_s: float = 270.0, device: int = 0) -> int:
    from engines.build_engine import build_engine
    from worker.backends.tensorrt import TensorRTBackend
    from worker.benchmark.inputs import read_queries
    from worker.benchmark.suite import BenchConfig, run_benchmark
    from worker.tokenize import KeywordTokenizer

    out = out or Path(os.environ.get("OUT", "/tmp/kwe-trt-check"))
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    stages = Stages(out, budget_s)
    gpu = load_profile("gpu", model_max_len=256)
    if onnx is None:
        from engines.export_onnx import ensure_onnx

        onnx = ensure_onnx(optimize=False)
    plan = work / "minilm-gpu.plan"
    built = stages.run("build", lambda: {"sidecar": json.loads(build_engine(
        onnx, gpu, plan, fp16=True, timing_cache=work / "timing.cache", device=device).to_json())})
    if built is None:
        (out / "trt-check.json").write_text(json.dumps(stages.summary, indent=2) + "\n")
        return 1
    backend = TensorRTBackend(plan, gpu, onnx_path=onnx, device=device)
    try:
        def buckets() -> dict[str, Any]:
            rows = run_each_bucket(backend, gpu)
            return {"ok": all("error" not in r and r["finite"] for r in rows), "buckets": rows}

        stages.run("buckets", buckets)

        def parity() -> dict[str, Any]:
            from worker.backends.onnxruntime import OnnxRuntimeBackend

            golden = [json.loads(line) for line in (GOLDEN / "dev.jsonl").read_text().splitlines()]
            ref = np.load(GOLDEN / "dev.npy")
            tok = KeywordTokenizer.from_model_dir(_model_dir())
            rows = [e.ids for e in tok.encode([g["text"] for g in golden])]
            trt_vecs = embed_through_bucketer(backend, gpu, rows)
            ort = OnnxRuntimeBackend(onnx)
            try:
                ort_vecs = embed_through_bucketer(ort, load_profile("cpu", model_max_len=256), rows)
            finally:
                ort.close()
            vs_ort, vs_ref = cosines(trt_vecs, ort_vecs), cosines(trt_vecs, ref)
            worst = int(np.argmin(vs_ort))
            return {"ok": bool(vs_ort.min() >= MIN_COSINE and vs_ref.min() >= MIN_COSINE), "rows": len(rows),
                    "min_cosine_vs_onnxruntime": float(vs_ort.min()), "min_cosine_vs_reference": float(vs_ref.min()),
                    "median_cosine_vs_onnxruntime": float(np.median(vs_ort)), "threshold": MIN_COSINE,
                    "worst_row": {"id": golden[worst].get("id"), "tokens": len(rows[worst])}}

        stages.run("parity", parity)
        tok = KeywordTokenizer.from_model_dir(_model_dir())
        encoded = tok.encode([t for _, t in read_queries(DATA, limit)])

        def bench() -> dict[str, Any]:
            cfg = BenchConfig(dataset=DATA.name, profile=gpu, compare_profile=None, rounds=rounds, latency=False,
                              backend_desc={"name": "tensorrt", "plan": plan.name})
            return run_benchmark(encoded, backend, cfg, log=lambda s: print(s, flush=True))

        stages.run("bench", bench)

        def mono() -> dict[str, Any]:
            if stages.left() < 90:
                return {"skipped": f"{stages.left():.0f} s of the budget left"}
            mono_plan = work / "minilm-mono.plan"
            build_engine(onnx, MONO, mono_plan, fp16=True, timing_cache=work / "timing.cache", device=device)
            mono_backend = TensorRTBackend(mono_plan, MONO, onnx_path=onnx, device=device)
            try:
                return paired_bucketed(encoded, {"monolithic": (mono_backend, MONO), "bucketed": (backend, gpu)},
                                       rounds, [("bucketed", "monolithic")])
            finally:
                mono_backend.close()

        stages.run("mono", mono)
    finally:
        backend.close()
    stages.summary["elapsed_s"] = round(time.monotonic() - stages.t0, 1)
    (out / "trt-check.json").write_text(json.dumps(stages.summary, indent=2) + "\n")
    print(json.dumps(stages.summary, indent=2), flush=True)
    return 0 if stages.summary["ok"] else 1


def _model_dir() -> Path:
    from kwe_core.model import default_model_dir

    return Path(os.environ["KWE_MODEL_DIR"]) if os.environ.get("KWE_MODEL_DIR") else default_model_dir()


if __name__ == "__main__":
    sys.exit(main(onnx=Path(os.environ["TRT_CHECK_ONNX"]) if os.environ.get("TRT_CHECK_ONNX") else None,
                  limit=int(os.environ.get("TRT_CHECK_LIMIT", "20000")),
                  rounds=int(os.environ.get("TRT_CHECK_ROUNDS", "3"))))
