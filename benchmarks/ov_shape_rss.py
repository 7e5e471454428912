"""RSS of one context of the worker's OpenVINO backend (bf16, one thread) fed distinct (batch, length)
shapes, shuffled.

    .venv/bin/python -m benchmarks.ov_shape_rss [--cache-capacity N] [--shapes 400]

Issue 37's overload on `--backend auto` grew the worker's RSS by 526 MiB; this isolates the
per-shape state of the CPU plugin (--cache-capacity sets CPU_RUNTIME_CACHE_CAPACITY; default:
the worker's RUNTIME_CACHE_SHAPES; 5000 is the plugin's own). Prints the growth every 100 distinct
shapes and after repeating 100 of them.
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
    ap.add_argument("--cache-capacity", type=int, default=None,
                    help="CPU_RUNTIME_CACHE_CAPACITY (default: the worker's; 5000: the plugin's)")
    ap.add_argument("--shapes", type=int, default=400)
    args = ap.parse_args()
    from worker.backends.openvino import RUNTIME_CACHE_SHAPES, OpenVinoBackend

    from engines.onnx_export.export import ensure_onnx

    path = args.onnx or ensure_onnx()
    capacity = RUNTIME_CACHE_SHAPES if args.cache_capacity is None else args.cache_capacity
    context = OpenVinoBackend(path, precision="bf16", runtime_cache_shapes=capacity).create_context(0)
    shapes = [(b, n) for n in LENGTHS for b in range(1, 129)]
    random.Random(0).shuffle(shapes)
    start, growth = rss_mib(), []
    for i, (b, n) in enumerate(shapes[: args.shapes]):
        ids = np.ones((b, n), np.int64)
        context.run(ids, ids)
        if i % 100 == 99:
            growth.append(round(rss_mib() - start))
    for b, n in shapes[:100]:
        ids = np.ones((b, n), np.int64)
        context.run(ids, ids)
    print(f"cache capacity {capacity}: RSS {start:.0f} MiB at the start; growth every 100 "
          f"distinct shapes {growth} MiB; after 100 repeated shapes {round(rss_mib() - start)} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
