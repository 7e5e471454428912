"""Export a sentence encoder to ONNX without torch: the entry points, and where exports are kept.

`build_model` reads the model folder (worker.core.model.ModelInfo) and writes the graph:
the encoder (encoder.py) -> the model's sentence-transformers modules (head.py). `export_onnx`
adds ORT's offline fusion when asked (fusion.py) and writes the file atomically; `ensure_onnx`
is what the worker calls: the cached export, made first if missing.

Inputs `input_ids` and `attention_mask`: int64 [batch, seq], both dynamic.
Output `sentence_embedding`: float32 [batch, dim] (the pipeline's width), unit L2 norm where the
pipeline normalises (metadata "normalize": "l2", else "none"). A sparse (SPLADE) model's graph
is the encoder, its MLM head (mlm.py) and the SPLADE pooling (splade.py), under the same names:
[batch, vocabulary] non-negative weights, nearly all zero (metadata "sparse": "splade").

Exports are cached under the user cache dir (worker.core.disk_cache), keyed by the weights, the
config and module files (Dense weights included), the prompt tokens a pooling leaves out, the
exporter version and the optimize flag (plus the onnxruntime version for fused graphs, whose
contents depend on the optimizer), and written atomically.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import onnx
from onnx import TensorProto, helper

from engines.onnx_export.encoder import encode, load_weights
from engines.onnx_export.fusion import check_fused, fuse
from engines.onnx_export.graph import INPUT_NAMES, OPSET, OUTPUT_NAME, ExportError, Graph
from engines.onnx_export.head import head, load_dense
from engines.onnx_export.mlm import check_head, decoder, transform
from engines.onnx_export.pooling import without_prompt
from engines.onnx_export.rotary import encode_rotary, load_rotary_weights, single_row_pooling
from engines.onnx_export.splade import splade
from worker.core.disk_cache import cache_dir, locked, write_atomic
from worker.core.fingerprint import file_sha256, hash_file_into
from worker.core.model import FAMILIES, ModelError, ModelInfo, default_model_dir

# Bump whenever the emitted graph changes (any module of this package): it is part of the cache key.
EXPORTER_VERSION = "3"
# One protobuf holds at most 2 GiB. A graph whose weights come near it (Qwen3-Embedding-0.6B in
# float32: 2.4 GB) keeps them in one file beside it, `<file>.data` (ONNX's external data), which
# ONNX Runtime, OpenVINO and TensorRT's parser read from the path; a margin is left for the rest.
EXTERNAL_DATA_BYTES = 2**31 - 2**26


def build_model(model_dir: str | Path | ModelInfo | None = None, *, external_data: Path | None = None,
                external_name: str | None = None) -> onnx.ModelProto:
    """The unfused ONNX graph of the model folder, with metadata_props (in memory, not cached).

    Weights of EXTERNAL_DATA_BYTES or more are written to `external_data`, and the graph refers to
    them as `external_name` (default: that file's name), the file it is to be saved beside; without
    one such a model is an ExportError.
    """
    info = model_info(model_dir)
    if info.static is not None:
        raise ExportError(f"{info.model_dir}: a static model (a table lookup and a mean) has no graph to export; "
                          "the worker and the Embedder run it on the static backend as it is")
    if info.model_type not in FAMILIES:  # ModelInfo refuses these already; a hand-made one may not
        raise ExportError(f"{info.config_path}: model_type {info.model_type!r} is not supported; supported "
                          f"encoder families: {', '.join(FAMILIES)}")
    g = Graph()
    ids, mask = INPUT_NAMES
    if info.rotary is not None:
        if info.pipeline.sparse is not None:
            raise ExportError(f"{info.model_dir}: a sparse (SPLADE) {info.model_type} model is not supported "
                              "(sparse models run on the BERT-like families)")
        weights = load_rotary_weights(info)
        if single_row_pooling(info) is None:
            head(g, info, load_dense(info), encode_rotary(g, weights, info, ids, mask), mask)
        else:
            # The pooling takes one row (cls, lasttoken): the encoder's last layer computes that
            # row alone and hands over the pooled vector.
            excluded = info.pipeline.prompt_tokens_excluded
            pooling_mask = without_prompt(g, mask, excluded) if excluded else mask
            head(g, info, load_dense(info), None, mask,
                 pooled=encode_rotary(g, weights, info, ids, mask, pooling_mask))
    elif info.pipeline.sparse is not None:
        weights = load_weights(info)
        # A SPLADE model: the encoder, its MLM head, then the pooling onto the vocabulary.
        check_head(weights, info)
        hidden = encode(g, weights, info, ids, mask)
        splade(g, info.pipeline.sparse, decoder(weights, info), transform(g, weights, info, hidden), mask)
    else:
        head(g, info, load_dense(info), encode(g, load_weights(info), info, ids, mask), mask)
    external = _move_weights_out(g, info, external_data, external_name)
    graph = helper.make_graph(
        g.nodes, f"{info.name}-{'sparse' if info.sparse else 'sentence'}-encoder",
        inputs=[helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "seq"]) for n in INPUT_NAMES],
        outputs=[helper.make_tensor_value_info(OUTPUT_NAME, TensorProto.FLOAT, ["batch", info.dim])],
        initializer=g.inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="keyword-embedder", producer_version=EXPORTER_VERSION)
    # ir_version 8 keeps the file loadable by older runtimes (TensorRT's parser included).
    model.ir_version = 8
    _set_metadata(model, info, optimize=False)
    if external:  # checked by path once saved beside its data (export_onnx)
        return model
    try:
        onnx.checker.check_model(model, full_check=False)
    except onnx.checker.ValidationError as exc:
        raise ExportError(f"{info.model_dir}: exported graph is invalid ({exc})") from None
    return model


def _move_weights_out(g: Graph, info: ModelInfo, path: Path | None, name: str | None) -> bool:
    """Writes the initializers to `path` as ONNX external data when they come to EXTERNAL_DATA_BYTES."""
    total = sum(len(t.raw_data) for t in g.inits)
    if total < EXTERNAL_DATA_BYTES:
        return False
    if path is None:
        raise ExportError(f"{info.model_dir}: the weights are {total / 2**30:.1f} GiB, over the 2 GiB one protobuf "
                          "holds; export it to a file (export-onnx, or the worker's cached export), which keeps "
                          "them in a .data file beside it")
    from onnx.external_data_helper import set_external_data

    try:
        with open(path, "wb") as f:
            for tensor in g.inits:
                if len(tensor.raw_data) < 1024:
                    continue  # small constants stay in the graph
                offset = f.tell()
                f.write(tensor.raw_data)
                f.write(b"\0" * (-f.tell() % 64))  # aligned, as onnx writes it
                set_external_data(tensor, location=name or path.name, offset=offset, length=len(tensor.raw_data))
                tensor.ClearField("raw_data")
    except OSError as exc:
        raise ExportError(f"{path}: cannot write the ONNX weights ({exc.strerror or exc})") from None
    return True


# ---------------------------------------------------------------- metadata, hashing, cache


def model_info(model_dir: str | Path | ModelInfo | None) -> ModelInfo:
    """The model folder read (None: the default model), or an ExportError naming what is wrong."""
    if isinstance(model_dir, ModelInfo):
        return model_dir  # already read: a start reads the model folder once
    try:
        return ModelInfo.from_dir(default_model_dir() if model_dir is None else model_dir)
    except ModelError as exc:
        raise ExportError(str(exc)) from exc


def weights_hash(info: ModelInfo) -> str:
    # The one file hash (worker/core/fingerprint.py): the fingerprint, this cache key and the
    # metadata share it, so a start hashes the weights once.
    return file_sha256(info.weights_path)


def cache_key(info: ModelInfo, *, optimize: bool) -> str:
    """Hash of everything the exported file depends on."""
    digest = hashlib.sha256()
    digest.update(f"exporter={EXPORTER_VERSION};opset={OPSET};optimize={optimize};".encode())
    if optimize:
        # The fused graph is written by onnxruntime's optimizer: a new version may fuse differently.
        import onnxruntime

        digest.update(f"onnxruntime={onnxruntime.__version__};".encode())
    digest.update(weights_hash(info).encode())
    for extra in (info.config_path, info.model_dir / "sentence_bert_config.json",
                  info.model_dir / "1_Pooling" / "config.json", info.model_dir / "tokenizer_config.json",
                  *info.pipeline.files()):
        digest.update(extra.name.encode())
        if extra.is_file():
            hash_file_into(extra, digest)
    # What the folder alone does not say: the prompt tokens a pooling leaves out (a setting).
    digest.update(f"prompt_tokens_excluded={info.pipeline.prompt_tokens_excluded};".encode())
    return digest.hexdigest()


def _set_metadata(model: onnx.ModelProto, info: ModelInfo, *, optimize: bool) -> None:
    props = {
        "model_name": info.name,
        "dim": str(info.dim),
        "max_seq_length": str(info.max_seq_length),
        "pooling": str(info.pipeline.sparse) if info.pipeline.sparse is not None else info.pooling_mode,
        "normalize": "l2" if info.normalized else "none",
        "pipeline": info.pipeline.describe(),
        "exporter_version": EXPORTER_VERSION,
        "weights_sha256": weights_hash(info),
        "optimized": str(optimize).lower(),
    }
    if info.sparse:
        props["sparse"] = "splade"
    if info.rotary is not None:
        # Read by the fp16 conversion (engines/fp16_onnx.py), which refuses gemma3_text by name.
        # Only the rotary families carry it, so the BERT-likes' files stay byte for byte as before.
        props["model_type"] = info.model_type
    del model.metadata_props[:]
    for key, value in props.items():
        model.metadata_props.add(key=key, value=value)


def default_cache_dir() -> Path:
    return cache_dir("onnx")


# ---------------------------------------------------------------- public API


def export_onnx(model_dir: str | Path | ModelInfo | None, output: str | Path, *, optimize: bool = True) -> Path:
    """Export the model folder to `output` (atomically) and return the path; a graph over the
    protobuf limit keeps its weights in `<output>.data` beside it."""
    info = model_info(model_dir)
    output = Path(output).expanduser()
    data = output.with_name(f"{output.name}.data")
    # The weights go to a temporary file first and take their final name just before the graph
    # takes its own, so a reader that sees the graph finds its weights.
    data_tmp = output.with_name(f".{output.name}.data.tmp")
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        model = build_model(info, external_data=data_tmp, external_name=data.name)
        external = data_tmp.is_file()
        if optimize and external:
            raise ExportError(f"{info.model_dir}: no offline-fused graph of a model over 2 GiB; use the plain graph")
        if optimize:
            fused = fuse(model, info)
            _set_metadata(fused, info, optimize=True)
            check_fused(model, fused, info)
            model = fused

        def write(tmp: Path) -> None:
            if external:
                os.replace(data_tmp, data)
            onnx.save_model(model, str(tmp))

        write_atomic(output, write)
        if external:
            onnx.checker.check_model(str(output))
    except OSError as exc:
        raise ExportError(f"{output}: cannot write the ONNX file ({exc.strerror or exc})") from None
    except onnx.checker.ValidationError as exc:
        raise ExportError(f"{info.model_dir}: exported graph is invalid ({exc})") from None
    finally:
        data_tmp.unlink(missing_ok=True)
    return output


def cached_path(model_dir: str | Path | ModelInfo | None = None, *, optimize: bool = True,
                cache_dir: str | Path | None = None) -> Path:
    """Where ensure_onnx keeps (or would keep) the export of this model folder."""
    info = model_info(model_dir)
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    variant = "fused" if optimize else "plain"
    safe_name = "".join(c if c.isalnum() or c in "-_." else "_" for c in info.name)
    return root / f"{safe_name}-{variant}-{cache_key(info, optimize=optimize)[:20]}.onnx"


def ensure_onnx(model_dir: str | Path | ModelInfo | None = None, *, optimize: bool = False,
                cache_dir: str | Path | None = None) -> Path:
    """The cached ONNX export of the model folder, exported first if missing or stale.

    optimize=False (the default) is the plain graph that ONNX Runtime optimises at load and
    TensorRT parses; the offline-fused variant measured slower on our CPUs
    (benchmarks/results/backends/ort_grid.md).
    """
    path = cached_path(model_dir, optimize=optimize, cache_dir=cache_dir)
    if path.is_file():
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ExportError(f"{path.parent}: cannot create the ONNX cache dir ({exc.strerror or exc})") from None
    # Two workers starting together: the second waits, then finds the first one's export.
    with locked(path.parent / f".{path.name}.lock"):
        if not path.is_file():  # another process may have finished it while we waited
            export_onnx(model_info(model_dir), path, optimize=optimize)
    return path
