"""What can run on a GPU host without TensorRT: the ONNX export under ONNX Runtime's CUDA provider.

Run by benchmarks/gpu/device_run.sh on the lent GPU machine (no network, no TensorRT, no
pycuda). It needs only onnxruntime(-gpu) and numpy from the host image; the tokenizer and
tomli come in `.device/pylibs`, the model as `.device/minilm-f16store.onnx` (the plain export
with weights *stored* as float16 and cast to float32 at load, to fit the 64 MiB carry limit;
its cosine to the reference is >= 0.9999994 on every golden row, checked on CPU and again here).

Stages, each written to $OUT as soon as it finishes:
1. parity: every golden row alone on the CUDA provider vs the sentence-transformers reference;
2. bench-gpu: the offline batching benchmark (worker.benchmark, the worker's own Bucketer) on the
   CUDA provider with the `gpu` profile (8/16/32/64 aligned, batches 256/128/64/32), the `cpu`
   profile beside it;
3. bench-cpu16: the same benchmark on the host's CPU cores with the `cpu` profile.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(os.environ.get("OUT", "/tmp/out"))
ONNX = ROOT / ".device" / "minilm-f16store.onnx"
MODEL = ROOT / ".device" / "model"  # the model folder, weights stored as float16 (prepare_device.py)


def onnx_path() -> Path:
    """The carried f16-store export (prepare_device.py --onnx), else the export of .device/model, made here."""
    if ONNX.is_file():
        return ONNX
    from engines.onnx_export.export import ensure_onnx
    from worker.core.model import ModelInfo

    return ensure_onnx(ModelInfo.from_dir(MODEL))


def torch_backend(profile=None, *, graphs: bool = True):  # noqa: ANN001, ANN201
    """The worker's torch backend on .device/model (fp16; one CUDA graph per bucket of `profile`, or eager)."""
    from worker.backends.torch_cuda import TorchCudaBackend
    from worker.core.model import ModelInfo
    from worker.core.profiles import Bucket, Profile

    profile = profile or Profile("any", (Bucket(256, 256, 256),), 256 * 256, "longest")
    return TorchCudaBackend(ModelInfo.from_dir(MODEL), profile, precision=os.environ.get("TORCH_PRECISION", "fp16"),
                            graphs=graphs)
DATA = ROOT / "tests" / "data" / "queries" / "terabyte05-20k.tsv"


def stage(name: str):  # noqa: ANN201
    def wrap(fn):  # noqa: ANN001, ANN202
        def run(*a):  # noqa: ANN002, ANN202
            t0 = time.time()
            print(f"== {name}", flush=True)
            try:
                result = fn(*a)
            except Exception:  # noqa: BLE001 - one failed stage must not lose the others
                result = {"error": traceback.format_exc()}
                print(result["error"], flush=True)
            result["stage_seconds"] = round(time.time() - t0, 1)
            (OUT / f"{name}.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
            return result
        return run
    return wrap


def tokenizer():  # noqa: ANN201
    from tokenizers import Tokenizer

    from worker.intake.tokenize import KeywordTokenizer

    return KeywordTokenizer(Tokenizer.from_file(str(ROOT / ".device" / "tokenizer.json")), 256)


def backend(providers: list[str], threads: int = 0):  # noqa: ANN201
    from worker.backends.onnxruntime import OnnxRuntimeBackend

    return OnnxRuntimeBackend(onnx_path(), intra_op_threads=threads, providers=providers)


def golden_alone(ctx) -> tuple[list, np.ndarray, np.ndarray, np.ndarray]:  # noqa: ANN001
    """Every golden row embedded alone on ctx: (encoded, vectors, reference, cosines)."""
    from worker.batching.padding import pad_batch

    rows = [json.loads(line) for line in (ROOT / "tests/data/golden/dev.jsonl").read_text().splitlines()]
    ref = np.load(ROOT / "tests/data/golden/dev.npy")
    enc = tokenizer().encode([r["text"] for r in rows])
    alone = np.concatenate([ctx.run(*pad_batch([e.ids])) for e in enc])
    return enc, alone, ref, (alone * ref).sum(1) / np.linalg.norm(ref, axis=1)


@stage("parity")
def parity(providers: list[str]) -> dict:
    from worker.batching.padding import pad_batch

    be = backend(providers)
    ctx = be.create_context(0)
    enc, alone, ref, cos = golden_alone(ctx)
    padded = np.concatenate([ctx.run(*pad_batch([e.ids for e in enc[i:i + 8]], 64)) for i in range(0, len(enc), 8)
                             if max(len(e.ids) for e in enc[i:i + 8]) <= 64] or [alone[:0]])
    return {"providers": be.providers, "rows": len(enc), "min_cosine": float(cos.min()),
            "max_abs_diff": float(np.abs(alone - ref).max()),
            "padded_to_64_rows": int(len(padded))}


@stage("parity-torch")
def torch_parity() -> dict:
    from worker.batching.padding import pad_batch

    be = torch_backend(graphs=False)  # one eager context for every shape (a 256 x 256 bucket)
    ctx = be.create_context(0)
    enc, alone, ref, cos = golden_alone(ctx)
    short = [e for e in enc if len(e.ids) <= 64][:64]
    in64 = ctx.run(*pad_batch([e.ids for e in short], 64))
    alone64 = np.concatenate([ctx.run(*pad_batch([e.ids])) for e in short])
    return {"backend": be.providers, "rows": len(enc), "min_cosine": float(cos.min()),
            "median_cosine": float(np.median(cos)), "max_abs_diff": float(np.abs(alone - ref).max()),
            "padding_invariance_max_abs_diff_alone_vs_padded_to_64": float(np.abs(in64 - alone64).max())}


def bench(name: str, providers: list[str], profile: str, compare: str, *, limit: int, rounds: int,
          latency_s: float, dispatchers: int = 1) -> dict:
    from worker.benchmark.inputs import read_queries
    from worker.benchmark.policies import BucketerOptions
    from worker.benchmark.report import render_markdown
    from worker.benchmark.suite import BenchConfig, run_benchmark
    from worker.core.profiles import load_profile

    tok = tokenizer()
    if providers == ["torch"]:
        # The worker's torch backend, CUDA graphs of the profile's buckets (pinned buffers always).
        be = torch_backend(load_profile(profile, model_max_len=256))
    else:
        be = backend(providers)
    rows = read_queries(DATA, limit)
    encoded = tok.encode([t for _, t in rows])
    cfg = BenchConfig(dataset=DATA.name, profile=load_profile(profile, model_max_len=256),
                      # A bucket-bound backend (torch: a graph per bucket) runs one profile only.
                      compare_profile=None if providers == ["torch"] else load_profile(compare, model_max_len=256),
                      rounds=rounds,
                      latency=latency_s > 0, latency_seconds=latency_s,
                      options=BucketerOptions(dispatchers=dispatchers),
                      backend_desc={"name": be.name, "providers": be.providers})
    report = run_benchmark(encoded, be, cfg, log=lambda s: print(s, flush=True))
    cmd = f"benchmarks/gpu/device_run.sh ({name})"
    (OUT / f"{name}.md").write_text(render_markdown(report, cmd))
    return report


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    import onnxruntime as ort

    avail = ort.get_available_providers()
    env = {"python": sys.version, "onnxruntime": ort.__version__, "providers": avail, "cpu_count": os.cpu_count()}
    print(env, flush=True)
    (OUT / "env.json").write_text(json.dumps(env, indent=2) + "\n")
    # DEVICE_SMOKE=1: a tiny local rehearsal of every stage on CPU before spending device time.
    smoke = os.environ.get("DEVICE_SMOKE") == "1"
    gpu = ["CUDAExecutionProvider", "CPUExecutionProvider"] if "CUDAExecutionProvider" in avail else None
    if smoke:
        gpu = ["CPUExecutionProvider"]
    n_gpu, n_cpu, rounds = (300, 300, 1) if smoke else (20000, 10000, 3)
    only = set(filter(None, os.environ.get("DEVICE_STAGES", "").split(",")))
    try:
        import torch

        has_torch_cuda = torch.cuda.is_available() and not smoke
    except ImportError:
        has_torch_cuda = False
    if has_torch_cuda and (not only or "torch" in only):
        torch_parity()
        tag = "" if os.environ.get("TORCH_PIN", "1") == "1" else "-nopin"
        stage(f"bench-torch-gpu{tag}")(lambda: bench(f"bench-torch-gpu{tag}", ["torch"], "gpu", "cpu", limit=20000,
                                                     rounds=3, latency_s=4 if not tag else 0))()
        if tag:
            return 0
        stage("bench-torch-gpu-2disp")(lambda: bench("bench-torch-gpu-2disp", ["torch"], "gpu", "cpu",
                                                     limit=20000, rounds=3, latency_s=0, dispatchers=2))()
    if only and "cpu16" not in only:
        return 0
    if gpu:
        parity(gpu)
        stage("bench-gpu")(lambda: bench("bench-gpu", gpu, "gpu", "cpu", limit=n_gpu, rounds=rounds,
                                         latency_s=1 if smoke else 4))()
        stage("bench-gpu-2disp")(lambda: bench("bench-gpu-2disp", gpu, "gpu", "cpu", limit=n_gpu, rounds=rounds,
                                               latency_s=0, dispatchers=2))()
    stage("bench-cpu16")(lambda: bench("bench-cpu16", ["CPUExecutionProvider"], "cpu", "cpu-aligned",
                                       limit=n_cpu, rounds=rounds, latency_s=0))()
    return 0


if __name__ == "__main__":
    sys.exit(main())
