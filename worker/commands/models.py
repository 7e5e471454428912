"""`keyword-embedder models`: the encoder families and pipelines, what was verified for each, and the checks.

Without flags it prints what is on record (worker/families/): the families, the
sentence-transformers pipelines that run (and what is refused), the pipeline each known model
runs, and the installed real models' pipelines read from their folders. `--model DIR` prints
what one model folder runs (or the one line saying why it cannot). `--check` reruns the checks
that need no GPU: each family's fixture export against its transformers vectors, each pipeline
fixture against sentence-transformers' encode (from a source checkout: the fixtures live in
tests/data/), and every real model that is installed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from worker.core.model import ModelInfo

PROG = "keyword-embedder models"
# The fixtures ship with a source checkout, not with the package: looked up from the current folder.
CHECKOUT_FIXTURES = Path("tests") / "data" / "families"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--check", action="store_true",
                        help="Rerun the checks here: fixture parity per family and pooling, each pipeline fixture, "
                             "and every installed real model.")
    parser.add_argument("--fixtures", type=Path, default=None,
                        help="Folder of the family fixtures (default: tests/data/families under the current folder, a "
                             "source checkout's root); the "
                             "pipeline fixtures and real-model references are read beside it.")
    parser.add_argument("--model", type=Path, default=None, metavar="DIR",
                        help="Print what this model folder runs (family, width, pipeline) and exit.")
    parser.add_argument("--path", default=None, metavar="NAME",
                        help="Print the folder of an installed real model (all-MiniLM-L6-v2, all-mpnet-base-v2, "
                             "splade-tiny-msmarco), assembled in the cache first where it comes in parts, and "
                             "exit: what --model-dir takes.")


def main(args: argparse.Namespace) -> int:
    from worker.core.model import FAMILIES
    from worker.core.sparse import ATOL, RTOL
    from worker.core.st_pipeline import POOLING_MODES
    from worker.families import KNOWN_PIPELINES
    from worker.families.dense import FAMILY_STATUS

    if args.model is not None:
        return _describe(args.model)
    if args.path is not None:
        return _path(args.path)
    print(f"Encoder families (config.json model_type): {', '.join(FAMILIES)}; then the model's sentence-transformers "
          f"modules (modules.json); ONNX Runtime on CPU, TensorRT from the same ONNX graph.\n")
    for s in FAMILY_STATUS:
        print(f"{s.family}\n  e.g.        {s.examples}\n  exporter:   {s.specifics}\n"
              f"  backends:   {s.backends}\n  fixture:    {s.fixture}\n  real model: {s.real_model}\n"
              f"  TensorRT:   {s.tensorrt}")
    print("\nPipelines (sentence-transformers modules after the encoder, built into the ONNX graph; docs/models.md)\n"
          f"  runs:     Pooling {', '.join(POOLING_MODES)} (several: concatenated), include_prompt false; Dense with "
          "Identity, Tanh, ReLU, GELU, Sigmoid or SiLU; Normalize only where listed (else the output says "
          "normalized: false)\n"
          "  refused:  any other module type (named, never skipped), Dense weights only in pytorch_model.bin, "
          "Dense use_residual, modules on token embeddings\n"
          "  no modules.json: pooling from 1_Pooling/config.json (mean without it), then L2-normalised\n"
          "  fixtures: tests/data/pipelines, vs sentence-transformers' encode: cos and norm per row "
          "(tests/unit/worker/core/test_st_pipeline.py)")
    print("\nSparse models (sentence-transformers' SparseEncoder, SPLADE; docs/models.md, Sparse models)\n"
          "  runs:     an MLM Transformer (transformer_task fill-mask; 5.x's MLMTransformer) of any family above, "
          "then SpladePooling max or sum, relu or log1p_relu; the MLM head and the pooling in the ONNX graph; "
          "the output is the non-zero vocabulary weights ({\"indices\", \"values\"})\n"
          "  also:     the inference-free Router: its SparseStaticEmbedding query route (a weight per token, no "
          "encoder; sparse_route query) or its document route (sparse_route document)\n"
          "  refused:  SparseAutoEncoder (CSR)\n"
          f"  fixtures: tests/data/sparse, vs SparseEncoder's encode: |diff| <= {RTOL:g} x |ref| + {ATOL:g} per "
          "entry, the same non-zero indices (tests/unit/worker/core/test_sparse.py)")
    from worker.families.static import STATIC_STATUS

    print("\nStatic models (a table lookup, no encoder; docs/models.md, Static models)\n" + STATIC_STATUS)
    print("\nKnown models (the pipeline its modules.json lists; what checked it here)")
    for k in KNOWN_PIPELINES:
        print(f"  {k.model:<38} {k.family:<12} {k.pipeline}\n  {'':<38} {'':<12} checked: {k.checked}")
    print("\nInstalled real models (read from their folders)")
    for name, folder, line in _installed():
        print(f"  {name:<38} {line}" + (f"\n  {'':<38} {folder}" if folder else ""))
    print("\nModel fingerprint (the default model, default settings; docs/cutover.md)")
    print(f"  {_default_fingerprint()}")
    if not args.check:
        print("\nRerun the checks: keyword-embedder models --check; one folder: keyword-embedder models --model DIR")
        return 0
    return _check(args.fixtures or CHECKOUT_FIXTURES)


def _cache() -> Path:
    from worker.core.disk_cache import cache_dir

    return cache_dir("models")


def _installed() -> list[tuple[str, Path | None, str]]:
    from worker.core.model import ModelError, ModelInfo, ModelNotFoundError
    from worker.families.real import REAL_MODELS, real_model_dir

    out: list[tuple[str, Path | None, str]] = []
    for model in REAL_MODELS:
        try:
            folder = real_model_dir(model, _cache(), unpack=False)
            info = ModelInfo.from_dir(folder)
        except ModelNotFoundError as exc:
            out.append((model.name, None, f"not available: {exc} ({model.install})"))
        except ModelError as exc:
            out.append((model.name, None, f"cannot run: {exc}"))
        else:
            width = f"sparse over {info.dim:,} entries" if info.sparse else f"{info.dim}-d"
            out.append((model.name, folder, f"{info.model_type}, {width}, {info.pipeline.describe()}"))
    return out


def _path(name: str) -> int:
    from worker.core.model import ModelNotFoundError
    from worker.families.real import REAL_MODELS, real_model_dir

    model = next((m for m in REAL_MODELS if m.name == name), None)
    if model is None:
        print(f"{PROG}: --path {name!r}: not a real model of this list: {', '.join(m.name for m in REAL_MODELS)}",
              file=sys.stderr)
        return 2
    try:
        print(real_model_dir(model, _cache()))
    except ModelNotFoundError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    return 0


def _describe(folder: Path) -> int:
    from worker.core.model import ModelError, ModelInfo

    try:
        info = ModelInfo.from_dir(folder)
    except ModelError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    prompts = ", ".join(f"{k}={v!r}" for k, v in info.prompts) or "none"
    print(f"{info.name} ({info.model_dir})\n"
          f"  family:     {info.model_type}, {info.num_layers} layers, hidden {info.hidden_size}, "
          f"max {info.max_seq_length} tokens\n"
          + (f"  attention:  {info.rotary.describe(info.num_heads)}\n" if info.rotary is not None else "")
          + f"  pipeline:   {info.pipeline.describe()}\n"
          + (f"  vectors:    sparse: the non-zero of {info.dim:,} vocabulary weights ({{\"indices\", \"values\"}})"
             if info.sparse else
             f"  vectors:    {info.dim}-d, {'unit length (L2-normalised)' if info.normalized else 'not normalised'}")
          + (f"; similarity_fn_name {info.similarity}" if info.similarity else "") + "\n"
          f"  prompts:    {prompts}" + (f" (default {info.default_prompt_name!r})" if info.default_prompt_name else "")
          + f"\n  fingerprint: {fingerprint(info)} "
          f"(default settings: its default prompt, {'every non-zero weight' if info.sparse else 'full width, float-list'})")
    return 0


def fingerprint(info: ModelInfo) -> str:
    """The fingerprint a worker with the default settings writes for this model (the codec's own)."""
    from worker.formats.codec_choice import output_codec
    from worker.core.model import Prompt
    from worker.settings.schema import Settings

    return output_codec(Settings(), info, Prompt.resolve(info)).fingerprint


def _default_fingerprint() -> str:
    from worker.core.model import ModelError, ModelInfo, default_model_dir

    try:
        info = ModelInfo.from_dir(default_model_dir())
    except ModelError as exc:
        return f"not available: {exc}"
    return f"{fingerprint(info)}  {info.name} ({info.model_dir})"


def _check(fixtures: Path) -> int:
    from worker.families import Checkout, check_all
    from worker.families.parity import MIN_COS

    failed = check_all(Checkout(fixtures, _cache()))
    if failed:
        print(f"\n{failed} check(s) below cos {MIN_COS} or off in norm", file=sys.stderr)
    return 1 if failed else 0
