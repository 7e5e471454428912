"""The first TensorRT run, in one script (benchmarks/gpu/trt_check.sh runs it; docs/gpu.md, "First GPU run").

NOT YET RUN ON A GPU: written for the day a GPU with TensorRT 10 and pycuda is lent. Its
logic runs on CPU against the fake tensorrt/pycuda of tests/fakes/gpu.py, in process
(tests/unit/worker/backends/test_tensorrt.py) and as the whole shell script in a subprocess
(tests/unit/benchmarks/gpu/test_gpu_scripts.py), with a failure injected in every stage.

Stages, most valuable first; each has its own deadline inside one total budget that ends
before the wrapper's `timeout`, and a stage whose prerequisite failed is recorded as not run:

1. setup: what the machine has (tensorrt, pycuda, onnxruntime, the GPU), the plain ONNX export
   (of $KWE_MODEL_DIR when set, or $TRT_CHECK_ONNX), the tokenizer, the queries;
2. build: the `gpu` profile's plan, FP16, with a timing cache; its deadline leaves a minute
   for load, buckets and parity;
3. load: the plan deserialised by the TensorRT backend (sidecar checks, I/O, profiles);
4. buckets: every bucket at its largest shape on its own thread and context, as the
   bucketer's dispatchers do, against ONNX Runtime on the same padded rows: finite, the same
   norms (unit for a normalising model), cosine >= 0.999; the 33-64 and 65-256-token batches
   are real queries joined end to end;
5. parity: the golden rows and the long rows through the real bucketer on TensorRT against
   ONNX Runtime on CPU (same ONNX file), the golden rows also against the
   sentence-transformers reference: cosine >= 0.999 (FP16);
6. bench: bucketed vs monolithic vs sorted through the benchmark suite on the plan;
7. mono: bucketed (`gpu` plan) vs a second, one-bucket plan (256 x 256: what a fixed-shape
   engine without bucketing computes) through the real bucketer, paired rounds; last, since
   it builds a second plan.

$OUT/trt-check.json is rewritten before and after every stage: a stage that is running when
the process is killed says "running". Each stage's full result (or its failure: stage,
message, traceback) is in $OUT/trt-<stage>.json. A watchdog thread ends the process with exit
code 3, after writing the JSON, when a stage overruns its deadline (TensorRT builds cannot be
interrupted from Python). `ok` is true only when every stage ran and passed.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from benchmarks.gpu.paired import cosines, embed_through_bucketer, paired_bucketed
from worker.core.profiles import Bucket, Profile, load_profile, load_profiles

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "data" / "golden"
DATA = ROOT / "tests" / "data" / "queries" / "terabyte05-20k.tsv"
MIN_COSINE = 0.999  # FP16 plan vs FP32 reference
# A plan without bucketing: one profile at the model's length, batches of 256, pad to the bound.
MONO = Profile("mono", (Bucket(256, 256, 256),), 256 * 256, "bucket", 8, "one bucket: no length bucketing")
# The wrapper (trt_check.sh) kills Python at 290 s; the budget ends well before, so that the
# watchdog's JSON is always written.
TOTAL_BUDGET_S = 255.0
DEADLINE_EXIT = 3
LONG_RANGES = ((33, 64), (65, 256))  # token lengths no golden row reaches
LONG_ROWS = 8  # rows per long batch (the 256 bucket's max batch)

Status = Literal["pending", "running", "ok", "failed", "timed_out", "skipped", "not_run"]


@dataclass(frozen=True)
class Stage:
    name: str
    fn: Callable[[float], dict[str, Any]]  # gets its deadline (time.monotonic() value)
    max_s: float  # its own deadline, capped by what is left of the total
    needs: tuple[str, ...] = ()
    min_s: float = 0.0  # skipped (not failed) when less than this is left
    reserve_s: float = 0.0  # left for the stages after it (the deadline ends that much before the budget)


class Stages:
    """Runs stages in order under one budget; writes trt-check.json before and after each."""

    def __init__(self, out: Path, budget_s: float, *, exit: Callable[[int], None] = os._exit,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.out, self.budget_s, self._exit, self._clock = out, budget_s, exit, clock
        self.t0 = clock()
        self.summary: dict[str, Any] = {"ok": False, "complete": False, "budget_s": budget_s,
                                        "first_failure": None, "stages": {}}
        self._lock = threading.Lock()  # the watchdog and the main thread both write the summary
        self._current: tuple[str, float] | None = None
        self._finished = threading.Event()
        self._ended = False  # the watchdog ended the process (only a test's `exit` returns)

    def left(self) -> float:
        return self.budget_s - (self._clock() - self.t0)

    # ------------------------------------------------------------------ recording
    def _write(self) -> None:
        self.summary["elapsed_s"] = round(self._clock() - self.t0, 1)
        tmp = self.out / "trt-check.json.tmp"
        tmp.write_text(json.dumps(self.summary, indent=2, default=str) + "\n")
        os.replace(tmp, self.out / "trt-check.json")  # a kill mid-write leaves the previous one

    def _record(self, name: str, status: Status, result: dict[str, Any] | None = None, **extra: Any) -> None:
        entry = self.summary["stages"][name]
        entry.update(status=status, **extra)
        if result is not None:
            if "error" in result:
                entry["message"] = result["error"]["message"]
            (self.out / f"trt-{name}.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
        if status in ("failed", "timed_out") and self.summary["first_failure"] is None:
            self.summary["first_failure"] = {"stage": name, "status": status, "message": entry.get("message", "")}
        self._write()

    # ------------------------------------------------------------------ running
    def run_all(self, stages: Sequence[Stage]) -> dict[str, Any]:
        for s in stages:
            self.summary["stages"][s.name] = {"status": "pending"}
        with self._lock:
            self._write()
        watchdog = threading.Thread(target=self._watch, name="trt-check-watchdog", daemon=True)
        watchdog.start()
        try:
            for s in stages:
                if self._ended:
                    break
                self._run_one(s)
        finally:
            self._finished.set()
        with self._lock:
            if self._ended:
                return self.summary
            statuses = [e["status"] for e in self.summary["stages"].values()]
            self.summary["ok"] = all(st == "ok" for st in statuses)
            self.summary["complete"] = all(st in ("ok", "failed") for st in statuses)
            self._write()
        return self.summary

    def _run_one(self, s: Stage) -> None:
        blocked = [n for n in s.needs if self.summary["stages"][n]["status"] != "ok"]
        if blocked:
            with self._lock:
                self._record(s.name, "not_run", message=f"needs {', '.join(blocked)}, which did not pass")
            return
        left = self.left()
        if left < max(s.min_s, 1.0):
            with self._lock:
                self._record(s.name, "skipped", message=f"{left:.0f} s of the budget left, the stage needs "
                                                         f"{s.min_s:.0f} s")
            return
        allowed = min(s.max_s, left)
        if s.reserve_s:  # unless that would leave it less than its minimum (or nothing)
            allowed = min(allowed, max(left - s.reserve_s, min(left, s.min_s)))
        print(f"== {s.name} (deadline {allowed:.0f} s; {left:.0f} s of the budget left)", flush=True)
        t0 = self._clock()
        with self._lock:
            self._current = (s.name, t0 + allowed)
            self._record(s.name, "running", deadline_s=round(allowed, 1))
        try:
            result = s.fn(t0 + allowed)
        except Exception as exc:  # noqa: BLE001 - one failed stage must not lose the others
            result = {"error": failure(s.name, exc)}
            print(result["error"]["traceback"], flush=True)
        seconds = round(self._clock() - t0, 1)
        result["stage_seconds"] = seconds
        why = result.pop("why", "the stage's checks failed (see its JSON)")  # said only when it failed
        with self._lock:
            self._current = None
            if self._ended:  # the watchdog recorded this stage as timed out
                return
            if "error" in result:
                status: Status = "failed"
            elif "skipped" in result:
                status = "skipped"
            else:
                status = "ok" if result.get("ok", True) else "failed"
            extra = {"seconds": seconds}
            if status == "failed" and "error" not in result:
                extra["message"] = why
            elif status == "skipped":
                extra["message"] = result["skipped"]
            self._record(s.name, status, result, **extra)

    def _watch(self) -> None:
        while not self._finished.wait(0.2):
            with self._lock:
                if self._current is None or self._clock() <= self._current[1]:
                    continue
                name = self._current[0]
                msg = (f"ran past its deadline ({self.summary['stages'][name]['deadline_s']} s); the process "
                       f"was ended so that this JSON is written before the wrapper's timeout")
                self._record(name, "timed_out", {"error": {"stage": name, "type": "Deadline", "message": msg,
                                                           "traceback": _all_stacks()}}, message=msg)
                for n, e in self.summary["stages"].items():
                    if e["status"] == "pending":
                        e.update(status="not_run", message=f"the process was ended in stage {name}")
                self._write()
                print(f"trt_check: stage {name} {msg}", file=sys.stderr, flush=True)
                self._ended = True
                self._exit(DEADLINE_EXIT)
                return


def failure(stage: str, exc: BaseException) -> dict[str, str]:
    """What trt-<stage>.json records of a failed stage."""
    return {"stage": stage, "type": type(exc).__name__, "message": str(exc) or repr(exc),
            "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))}


def _all_stacks() -> str:
    """Where every thread was when a deadline passed (the stuck call is in one of them)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    return "\n".join(f"--- thread {names.get(ident, ident)}\n" + "".join(traceback.format_stack(frame))
                     for ident, frame in sys._current_frames().items())


# ---------------------------------------------------------------------------- row selection
def long_rows(pool: Sequence[np.ndarray], lo: int, hi: int, n: int, seed: int = 0) -> list[np.ndarray]:
    """n rows of lo..hi tokens: real ones from `pool` first, then real queries joined end to end.

    Search queries rarely reach 33 tokens, so the long buckets would go untested; joining real
    queries' word pieces between one [CLS] and one [SEP] gives real-vocabulary rows of any
    length. One row is exactly `hi` tokens long (the bucket bound).
    """
    rows = [r for r in pool if lo <= len(r) <= hi][: n - 1]
    rng = np.random.default_rng(seed)
    donors = [r[1:-1] for r in pool if len(r) > 2]
    if not donors:
        raise ValueError("no query with word pieces to build long rows from")
    targets = [hi] + [int(rng.integers(lo, hi + 1)) for _ in range(n - len(rows) - 1)]
    for target in targets:
        body: list[int] = []
        while len(body) < target - 2:
            body.extend(int(t) for t in donors[int(rng.integers(len(donors)))])
        rows.append(np.array([pool[0][0], *body[: target - 2], pool[0][-1]], dtype=np.int64))
    return rows[:n]


def bucket_batches(profile: Profile, pool: Sequence[np.ndarray]) -> list[list[np.ndarray]]:
    """For each bucket, max_batch rows whose lengths fall in it, one of them at its bound.

    Real queries where there are enough of them; joined ones (long_rows) otherwise, which is
    always the case for the long buckets.
    """
    batches = []
    lo = 1
    for i, b in enumerate(profile.buckets):
        n = b.max_batch
        real = [r for r in pool if lo <= len(r) <= b.max_len]
        if len(real) >= n and b.max_len < LONG_RANGES[0][0]:
            rows = real[:n]
            if all(len(r) < b.max_len for r in rows):
                rows = rows[: n - 1] + long_rows(pool, b.max_len, b.max_len, 1, seed=i)
            batches.append(rows)
        else:
            batches.append(long_rows(pool, max(lo, 3), b.max_len, n, seed=i))
        lo = b.max_len + 1
    return batches


def pad(rows: Sequence[np.ndarray], length: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.zeros((len(rows), length), np.int64)
    mask = np.zeros_like(ids)
    for k, r in enumerate(rows):
        ids[k, : len(r)], mask[k, : len(r)] = r, 1
    return ids, mask


def run_each_bucket(backend: Any, profile: Profile, batches: Sequence[list[np.ndarray]],
                    reference: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> list[dict[str, Any]]:
    """Bucket i at (max_batch_i, bound_i) on its own thread and context, against `reference` on the same rows."""
    results: list[dict[str, Any]] = [{} for _ in profile.buckets]
    arrays = [pad(rows, b.max_len) for rows, b in zip(batches, profile.buckets)]

    def one(i: int) -> None:
        b = profile.buckets[i]
        ids, mask = arrays[i]
        try:
            ctx = backend.create_context(i)
            try:
                ctx.run(ids, mask)  # first run: lazy allocations
                t0 = time.perf_counter()
                out = ctx.run(ids, mask)
                ms = (time.perf_counter() - t0) * 1000
            finally:
                ctx.close()
            results[i] = {"bucket": i, "shape": [b.max_batch, b.max_len], "ms": round(ms, 3),
                          "tokens": [int(mask.sum(1).min()), int(mask.sum(1).max())],
                          "finite": bool(np.isfinite(out).all()),
                          "_out": out}
        except Exception as exc:  # noqa: BLE001 - recorded per bucket, the others still run
            results[i] = {"bucket": i, "error": failure(f"buckets[{i}]", exc)}

    threads = [threading.Thread(target=one, args=(i,), name=f"trt-check-bucket-{i}")
               for i in range(len(profile.buckets))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, r in enumerate(results):
        if "_out" in r:
            out = r.pop("_out")
            ref = reference(*arrays[i])
            cos = cosines(out, ref)
            r["min_cosine_vs_onnxruntime"] = float(np.nan_to_num(cos, nan=-1.0).min())
            r["max_abs_diff"] = float(np.nan_to_num(np.abs(out - ref), nan=np.inf).max())
            # The norms ONNX Runtime gives: unit length for a model that normalises, the model's
            # own scale for one that does not (docs/models.md).
            r["norms_match"] = bool(np.allclose(np.linalg.norm(out, axis=1), np.linalg.norm(ref, axis=1), rtol=1e-2))
            r["ok"] = r["finite"] and r["norms_match"] and r["min_cosine_vs_onnxruntime"] >= MIN_COSINE
        else:
            r["ok"] = False
    return results


# ---------------------------------------------------------------------------- the check
def main(out: Path | None = None, *, onnx: Path | None = None, tokenizer: Path | None = None,
         limit: int = 20000, rounds: int = 3, budget_s: float = TOTAL_BUDGET_S, device: int = 0,
         profiles_file: Path | None = None, exit: Callable[[int], None] = os._exit) -> int:
    """The whole check; 0 when every stage passed.

    `onnx` and `tokenizer` (a tokenizer.json) replace the export and the tokenizer of the model
    folder, for a GPU machine without the model package (the 90 MB weights exceed what can be
    carried there: benchmarks/gpu/prepare_device.py builds both). The plans are built for the
    `gpu` profile of `profiles_file` (default: worker/core/profiles.toml) and for its `mono`
    profile when it has one (else MONO); smaller ones keep the runs on fakes short.
    """
    out = out or Path(os.environ.get("OUT", "/tmp/kwe-trt-check"))
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    gpu = load_profile("gpu", profiles_file, model_max_len=256)
    mono_profile = load_profiles(profiles_file).get("mono", MONO)
    plan = work / "minilm-gpu.plan"
    state: dict[str, Any] = {}

    def setup(_deadline: float) -> dict[str, Any]:
        from worker.benchmark.inputs import read_queries
        from worker.intake.tokenize import KeywordTokenizer

        env = gpu_environment(device)
        print(f"environment: {env}", flush=True)
        model_dir = _model_dir() if onnx is None or tokenizer is None else None
        if onnx is None:
            from engines.onnx_export.export import ensure_onnx

            state["onnx"] = ensure_onnx(model_dir, optimize=False)
        else:
            state["onnx"] = onnx
        if tokenizer is None:
            tok = KeywordTokenizer.from_model_dir(model_dir)  # type: ignore[arg-type]
        else:
            from tokenizers import Tokenizer

            tok = KeywordTokenizer(Tokenizer.from_file(str(tokenizer)), 256, source=str(tokenizer))
        state["golden"] = [json.loads(line) for line in (GOLDEN / "dev.jsonl").read_text().splitlines()]
        state["golden_rows"] = [e.ids for e in tok.encode([g["text"] for g in state["golden"]])]
        state["encoded"] = tok.encode([t for _, t in read_queries(DATA, limit)])
        pool = [e.ids for e in state["encoded"]] + state["golden_rows"]
        state["batches"] = bucket_batches(gpu, pool)
        state["long"] = [row for lo, hi in LONG_RANGES for row in long_rows(pool, lo, hi, LONG_ROWS, seed=hi)]
        return {"environment": env, "onnx": str(state["onnx"]), "model_dir": str(model_dir),
                "tokenizer": str(tokenizer) if tokenizer else "the model folder's", "queries": len(state["encoded"]),
                "golden_rows": len(state["golden_rows"]),
                "bucket_rows": [[int(min(map(len, b))), int(max(map(len, b)))] for b in state["batches"]]}

    def build(_deadline: float) -> dict[str, Any]:
        from engines.build_engine import build_engine

        sidecar = build_engine(state["onnx"], gpu, plan, fp16=True, timing_cache=work / "timing.cache",
                               device=device, log=lambda s: print(s, flush=True))
        return {"sidecar": json.loads(sidecar.to_json())}

    def load(_deadline: float) -> dict[str, Any]:
        from worker.backends.tensorrt import TensorRTBackend

        backend = TensorRTBackend(plan, gpu, onnx_path=state["onnx"], device=device)
        state["backend"] = backend
        return {"gpu": backend.gpu_name, "compute_capability": backend.compute_capability, "dim": backend.dim}

    def ort() -> Any:
        if "ort" not in state:
            from worker.backends.onnxruntime import OnnxRuntimeBackend

            state["ort"] = OnnxRuntimeBackend(state["onnx"])
        return state["ort"]

    def buckets(_deadline: float) -> dict[str, Any]:
        ref = ort().create_context(0)
        try:
            rows = run_each_bucket(state["backend"], gpu, state["batches"], ref.run)
        finally:
            ref.close()
        bad = [r["bucket"] for r in rows if not r["ok"]]
        return {"ok": not bad, "why": f"bucket(s) {bad} failed (error, non-finite, norms off or cosine "
                                      f"< {MIN_COSINE})", "threshold": MIN_COSINE, "buckets": rows}

    def parity(_deadline: float) -> dict[str, Any]:
        golden, ref = state["golden"], np.load(GOLDEN / "dev.npy")
        rows = state["golden_rows"] + state["long"]
        trt_vecs = embed_through_bucketer(state["backend"], gpu, rows)
        ort_vecs = embed_through_bucketer(ort(), load_profile("cpu", model_max_len=256), rows)
        vs_ort, vs_ref = cosines(trt_vecs, ort_vecs), cosines(trt_vecs[: len(golden)], ref)
        worst = int(np.argmin(vs_ort))
        return {"ok": bool(vs_ort.min() >= MIN_COSINE and vs_ref.min() >= MIN_COSINE),
                "why": f"a cosine fell below {MIN_COSINE}", "rows": len(rows), "golden_rows": len(golden),
                "long_rows": len(state["long"]), "min_cosine_vs_onnxruntime": float(vs_ort.min()),
                "min_cosine_vs_reference": float(vs_ref.min()),
                "min_cosine_long_rows_vs_onnxruntime": float(vs_ort[len(golden):].min()),
                "median_cosine_vs_onnxruntime": float(np.median(vs_ort)), "threshold": MIN_COSINE,
                "worst_row": {"id": golden[worst].get("id") if worst < len(golden) else f"long-{worst - len(golden)}",
                              "tokens": len(rows[worst])}}

    def bench(_deadline: float) -> dict[str, Any]:
        from worker.benchmark.suite import BenchConfig, run_benchmark

        cfg = BenchConfig(dataset=DATA.name, profile=gpu, compare_profile=None, rounds=rounds, latency=False,
                          backend_desc={"name": "tensorrt", "plan": plan.name})
        return run_benchmark(state["encoded"], state["backend"], cfg, log=lambda s: print(s, flush=True))

    def mono(deadline: float) -> dict[str, Any]:
        from engines.build_engine import build_engine
        from worker.backends.tensorrt import TensorRTBackend

        mono_plan = work / "minilm-mono.plan"
        build_engine(state["onnx"], mono_profile, mono_plan, fp16=True, timing_cache=work / "timing.cache",
                     device=device, log=lambda s: print(s, flush=True))
        mono_backend = TensorRTBackend(mono_plan, mono_profile, onnx_path=state["onnx"], device=device)
        try:
            return paired_bucketed(state["encoded"], {"monolithic": (mono_backend, mono_profile),
                                                      "bucketed": (state["backend"], gpu)},
                                   rounds, [("bucketed", "monolithic")], deadline=deadline)
        finally:
            mono_backend.close()

    stages = Stages(out, budget_s, exit=exit)
    try:
        summary = stages.run_all([
            # Deadlines: what each stage should need on a GPU, with room. The build (an empty timing
            # cache, five profiles) gets all it can while leaving load, buckets and parity a
            # minute: nothing runs without it, and they are what the run is for.
            Stage("setup", setup, 45),
            Stage("build", build, 200, needs=("setup",), min_s=60, reserve_s=60),
            Stage("load", load, 20, needs=("build",)),
            Stage("buckets", buckets, 30, needs=("load",)),
            Stage("parity", parity, 30, needs=("load",)),
            Stage("bench", bench, 60, needs=("load",), min_s=20),
            Stage("mono", mono, 90, needs=("load",), min_s=45),
        ])
    finally:
        for key in ("backend", "ort"):
            if key in state:
                state[key].close()
    print(json.dumps(summary, indent=2), flush=True)
    return 0 if summary["ok"] else 1


def gpu_environment(device: int) -> dict[str, str]:
    """What the machine has, for the JSON: versions, or why tensorrt/pycuda/onnxruntime do not import."""
    import importlib

    env: dict[str, str] = {"python": sys.version.split()[0]}
    modules: dict[str, Any] = {}
    for name in ("tensorrt", "pycuda.driver", "onnxruntime", "onnx", "tokenizers"):
        try:
            module = modules[name] = importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - ImportError, or OSError from a missing libnvinfer
            env[name] = f"NOT IMPORTABLE: {exc!r}"
        else:
            env[name] = str(getattr(module, "__version__", getattr(module, "VERSION", "importable")))
    if not env["pycuda.driver"].startswith("NOT"):
        try:
            from engines.build_engine import gpu_identity

            name, cc = gpu_identity(modules["pycuda.driver"], device)
            env["gpu"] = f"{name} (sm {cc})"
        except Exception as exc:  # noqa: BLE001 - no driver, no device: said in the JSON, build fails later
            env["gpu"] = f"UNKNOWN: {exc!r}"
    return env


def _model_dir() -> Path:
    from worker.core.model import default_model_dir

    return Path(os.environ["KWE_MODEL_DIR"]) if os.environ.get("KWE_MODEL_DIR") else default_model_dir()


if __name__ == "__main__":
    sys.exit(main(onnx=Path(os.environ["TRT_CHECK_ONNX"]) if os.environ.get("TRT_CHECK_ONNX") else None,
                  tokenizer=Path(os.environ["TRT_CHECK_TOKENIZER"]) if os.environ.get("TRT_CHECK_TOKENIZER") else None,
                  limit=int(os.environ.get("TRT_CHECK_LIMIT", "20000")),
                  rounds=int(os.environ.get("TRT_CHECK_ROUNDS", "3")),
                  budget_s=float(os.environ.get("TRT_CHECK_BUDGET_S", str(TOTAL_BUDGET_S))),
                  profiles_file=Path(os.environ["TRT_CHECK_PROFILES"]) if os.environ.get("TRT_CHECK_PROFILES") else None))
