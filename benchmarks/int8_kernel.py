"""The shipped int8 graph against fp32, call by call: alternating pairs on fixed shapes.

    .venv/bin/python -m benchmarks.int8_kernel --json benchmarks/results/int8/int8-kernel.json

Whole-stream passes (benchmarks/int8_study.py) take seconds each, and on a shared 2-core machine
the load changes within a pass; here each pair is two back-to-back calls on the same batch
(order alternating), so the ratio fp32 time / int8 time is paired over milliseconds.
Every token is real (mask all ones); shapes are typical bucketed batches of keywords.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from engines.onnx_export.export import ensure_onnx
from engines.quantize_int8 import ensure_int8_onnx
from worker.backends.onnxruntime import OnnxRuntimeBackend
from worker.benchmark.report import quartiles


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=30)
    ap.add_argument("--shapes", default="64x8,128x12,32x32")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    backends = {"fp32": OnnxRuntimeBackend(ensure_onnx(), intra_op_threads=args.threads),
                "int8": OnnxRuntimeBackend(ensure_int8_onnx(), intra_op_threads=args.threads)}
    results = {}
    for shape in args.shapes.split(","):
        b, length = (int(x) for x in shape.split("x"))
        ids = np.random.default_rng(0).integers(1000, 29000, (b, length))
        ids[:, 0], ids[:, -1] = 101, 102
        mask = np.ones_like(ids)
        for backend in backends.values():
            backend.run(ids, mask)  # warm this shape
        ratios = []
        for i in range(args.pairs):
            took = {}
            for name in (("fp32", "int8") if i % 2 == 0 else ("int8", "fp32")):
                start = time.perf_counter()
                backends[name].run(ids, mask)
                took[name] = time.perf_counter() - start
            ratios.append(took["fp32"] / took["int8"])
        results[shape] = quartiles(ratios)
        q = results[shape]
        print(f"[{shape}] fp32 time / int8 time, {args.pairs} alternating pairs: "
              f"{q['median']:.2f} ({q['q1']:.2f}-{q['q3']:.2f})", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "command": "python " + " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]),
            "pairs": args.pairs, "threads": args.threads, "speedup": results}, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
