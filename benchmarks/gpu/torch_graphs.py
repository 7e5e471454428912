"""CUDA graphs vs eager PyTorch, bucketed vs monolithic, through the real bucketer (benchmarks/gpu/torch_graphs.sh).

First run on an H200 on 2026-12-04 (benchmarks/results/device/2026-12-04/), with the benchmark's
own PyTorch backend; it now runs the worker's `--backend torch` (worker/backends/torch_cuda.py) in
the precision GRAPHS_PRECISION (fp16), eager (graphs=False) or with one CUDA graph per bucket
shape. The design's claim is that on a GPU the batch's padded size, not kernel launches, is the
cost, so bucketing pays; eager PyTorch measured launch-bound (2-3 ms per forward for any shape),
which hides padding entirely. CUDA graphs (one per bucket shape, captured at start, static input
buffers) take the launches out.

Configurations, each the worker's Bucketer fed through the 4,096-keyword window, in paired
rounds with the order rotated: profiles `mono` (one bucket: 256 x 256, batches of 256, eager
pads to the batch's longest, graphs to 256), `gpu` (8/16/32/64/256) and `cpu` (one bucket per
length 3..12, then 14..256), each eager and with graphs. First, graphs vs eager parity on the
golden rows. Writes $OUT/torch-graphs.json and .md. Needs .device/model (prepare_device.py: the
model folder with its weights stored as float16), or KWE_MODEL_DIR.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.gpu.paired import cosines, embed_through_bucketer, paired_bucketed
from worker.core.profiles import Bucket, Profile, load_profile

ROOT = Path(__file__).resolve().parents[2]
MONO = Profile("mono", (Bucket(256, 256, 256),), 256 * 256, "longest", None, "one bucket: no length bucketing")
PROFILES = ("mono", "gpu", "cpu")
MODES = ("eager", "graphs")


def config_names() -> list[str]:
    return [f"{p}-{m}" for m in MODES for p in PROFILES]


def ratio_pairs() -> list[tuple[str, str]]:
    """Bucketed over monolithic within each mode, and graphs over eager for each profile."""
    within = [(f"{p}-{m}", f"mono-{m}") for m in MODES for p in PROFILES if p != "mono"]
    across = [(f"{p}-graphs", f"{p}-eager") for p in PROFILES]
    return within + across


def render(report: dict[str, Any]) -> str:
    lines = ["# CUDA graphs vs eager, bucketed vs monolithic (PyTorch, real bucketer)", "",
             f"{report['n']} queries, {report['rounds']} paired rounds, {report['device']}.", "",
             "| configuration | keywords/s median (q1-q3) |", "|---|---:|"]
    for name, q in report["bench"]["keywords_per_s"].items():
        lines.append(f"| {name} | {q['median']:,.0f} ({q['q1']:,.0f}-{q['q3']:,.0f}) |")
    lines += ["", "| paired ratio | median (q1-q3) |", "|---|---:|"]
    for name, q in report["bench"]["ratios"].items():
        lines.append(f"| {name} | {q['median']:.2f} ({q['q1']:.2f}-{q['q3']:.2f}) |")
    return "\n".join(lines) + "\n"


def main() -> int:
    import torch

    from worker.backends.torch_cuda import TorchCudaBackend
    from worker.backends.torch_plan import read_weights
    from worker.benchmark.inputs import read_queries
    from worker.core.model import ModelInfo
    from worker.intake.tokenize import KeywordTokenizer

    out = Path(os.environ.get("OUT", "/tmp/kwe-torch-graphs"))
    out.mkdir(parents=True, exist_ok=True)
    info = ModelInfo.from_dir(os.environ.get("KWE_MODEL_DIR") or ROOT / ".device" / "model")
    tok = KeywordTokenizer.from_model(info)
    limit, rounds = int(os.environ.get("GRAPHS_LIMIT", "20000")), int(os.environ.get("GRAPHS_ROUNDS", "5"))
    precision = os.environ.get("GRAPHS_PRECISION", "fp16")
    profiles = {"mono": MONO, "gpu": load_profile("gpu", model_max_len=256), "cpu": load_profile("cpu", model_max_len=256)}
    t0 = time.monotonic()
    weights = read_weights(info)  # once, for the six backends
    backends = {f"{p}-{m}": (TorchCudaBackend(info, prof, precision=precision, graphs=m == "graphs", weights=weights),
                             prof) for m in MODES for p, prof in profiles.items()}
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rounds": rounds,
                              "precision": precision}

    golden = [json.loads(line) for line in (ROOT / "tests/data/golden/dev.jsonl").read_text().splitlines()]
    rows = [e.ids for e in tok.encode([g["text"] for g in golden])]
    ref = np.load(ROOT / "tests/data/golden/dev.npy")
    parity = {}
    for name in ("gpu-eager", "gpu-graphs", "cpu-graphs", "mono-graphs"):
        backend, prof = backends[name]
        parity[name] = float(cosines(embed_through_bucketer(backend, prof, rows), ref).min())
    report["parity_min_cosine_vs_reference"] = parity
    print(parity, flush=True)

    encoded = tok.encode([t for _, t in read_queries(ROOT / "tests/data/queries/terabyte05-20k.tsv", limit)])
    report["n"] = len(encoded)
    report["bench"] = paired_bucketed(encoded, {n: backends[n] for n in config_names()}, rounds, ratio_pairs())
    report["elapsed_s"] = round(time.monotonic() - t0, 1)
    (out / "torch-graphs.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "torch-graphs.md").write_text(render(report))
    print(render(report), flush=True)
    for backend, _ in backends.values():
        backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
