"""RSS of one OpenVINO CPU infer request (bf16, one stream) fed distinct (batch, length) shapes, shuffled.

    .venv/bin/python benchmarks/ov_shape_rss.py [--cache-capacity N] [--shapes 400]

Issue 37's overload on `--backend auto` grew the worker's RSS by 526 MiB; this isolates the
per-shape state of the CPU plugin (--cache-capacity sets CPU_RUNTIME_CACHE_CAPACITY; default:
the plugin's own). Prints the growth every 100 distinct shapes and after repeating 100 of them.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import numpy as np

LENGTHS = (3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 14, 16, 20, 24, 32, 48)


def rss_mib() -> float:
    return int(Path("/proc/self/status").read_text().split("VmRSS:")[1].split()[0]) / 1024


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--onnx", type=Path, default=None, help="the ONNX export (default: the worker's MiniLM export)")
    ap.add_argument("--cache-capacity", default=None, help="CPU_RUNTIME_CACHE_CAPACITY (default: the plugin's)")
    ap.add_argument("--shapes", type=int, default=400)
    args = ap.parse_args()
    import openvino as ov

    path = args.onnx or next((Path.home() / ".cache" / "keyword-embedder" / "onnx").glob("all-MiniLM-L6-v2-plain-*.onnx"))
    cfg = {"INFERENCE_PRECISION_HINT": "bf16", "NUM_STREAMS": "1", "INFERENCE_NUM_THREADS": "1"}
    if args.cache_capacity is not None:
        cfg["CPU_RUNTIME_CACHE_CAPACITY"] = args.cache_capacity
    request = ov.Core().compile_model(str(path), "CPU", cfg).create_infer_request()
    shapes = [(b, n) for n in LENGTHS for b in range(1, 129)]
    random.Random(0).shuffle(shapes)
    start, growth = rss_mib(), []
    for i, (b, n) in enumerate(shapes[: args.shapes]):
        ids = np.ones((b, n), np.int64)
        request.infer({"input_ids": ids, "attention_mask": ids})
        if i % 100 == 99:
            growth.append(round(rss_mib() - start))
    for b, n in shapes[:100]:
        ids = np.ones((b, n), np.int64)
        request.infer({"input_ids": ids, "attention_mask": ids})
    print(f"cache capacity {args.cache_capacity or 'default'}: RSS {start:.0f} MiB at the start; growth every 100 "
          f"distinct shapes {growth} MiB; after 100 repeated shapes {round(rss_mib() - start)} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
