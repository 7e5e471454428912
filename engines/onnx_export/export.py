"""Export a sentence encoder to ONNX without torch.

The weights are read with safetensors into numpy and the graph is written node by node with the
`onnx` package: embeddings -> N encoder layers -> the model's sentence-transformers modules
(worker.core.st_pipeline: the pooling over the attention mask, any Dense layers, L2 normalisation
where a Normalize module is listed). Sizes come from config.json; the family from its model_type
(worker.core.model.FAMILIES), all post-LayerNorm encoders with exact-GELU feed-forward layers:

- bert: absolute positions 0..S-1, token type 0 added.
- roberta, xlm-roberta: BERT's layers; positions numbered from padding_idx + 1 over the real
  tokens (HF's create_position_ids_from_input_ids, computed here from the attention mask, so
  the pad id the batch uses does not matter); a one-row token type table.
- distilbert: BERT's layers under other names (q_lin, sa_layer_norm, ffn.lin1, ...); no token
  types.
- mpnet: RoBERTa's positions, no token types, and a relative position bias added to every
  layer's attention scores: T5-style buckets (32, max distance 128, as HF MPNetEncoder) of
  key - query, precomputed here as one [2 * max_pos - 1, heads] table indexed by the distance.

The node layout deliberately mirrors what `torch.onnx.export` produces for HF BertModel
(Reshape to [0, 0, heads, head_size], Transpose, MatMul, Div by sqrt(head_size), additive mask
built as (1 - mask) * -10000, Erf GELU, ...). That is the layout ONNX Runtime's transformer
optimizer pattern-matches, so `optimize=True` can fuse it into Attention,
SkipLayerNormalization, BiasGelu and EmbedLayerNormalization. The unfused graph uses only
standard opset-17 operators, which is what TensorRT needs.

Inputs `input_ids` and `attention_mask`: int64 [batch, seq], both dynamic.
Output `sentence_embedding`: float32 [batch, dim] (the pipeline's width), unit L2 norm where the
pipeline normalises (metadata "normalize": "l2", else "none").

Exports are cached under the user cache dir, keyed by the weights, the config and module files
(Dense weights included), the prompt tokens a pooling leaves out, the exporter version and the
optimize flag (plus the onnxruntime version for fused graphs, whose
contents depend on the optimizer), and written atomically.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from engines.onnx_export.encoder import encode, load_weights
from engines.onnx_export.graph import INPUT_NAMES, OPSET, OUTPUT_NAME, ExportError, Graph
from engines.onnx_export.head import head, load_dense
from worker.core.disk_cache import cache_dir, locked, write_atomic
from worker.core.model import FAMILIES, ModelError, ModelInfo, default_model_dir

# Bump whenever the emitted graph changes: it is part of the cache key.
EXPORTER_VERSION = "2"
# A fused graph must match the plain graph within this on the self-check batch; float32
# reassociation stays around 1e-6, a broken fusion is off by far more.
FUSED_CHECK_TOL = 1e-4


def build_model(model_dir: str | Path | ModelInfo | None = None) -> onnx.ModelProto:
    """The unfused ONNX graph of the model folder, with metadata_props (in memory, not cached)."""
    info = model_info(model_dir)
    if info.model_type not in FAMILIES:  # ModelInfo refuses these already; a hand-made one may not
        raise ExportError(f"{info.config_path}: model_type {info.model_type!r} is not supported; supported "
                          f"encoder families: {', '.join(FAMILIES)}")
    weights = load_weights(info)
    dense = load_dense(info)
    g = Graph()
    ids, mask = INPUT_NAMES
    head(g, info, dense, encode(g, weights, info, ids, mask), mask)
    graph = helper.make_graph(
        g.nodes, f"{info.name}-sentence-encoder",
        inputs=[helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "seq"]) for n in INPUT_NAMES],
        outputs=[helper.make_tensor_value_info(OUTPUT_NAME, TensorProto.FLOAT, ["batch", info.dim])],
        initializer=g.inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="keyword-embedder", producer_version=EXPORTER_VERSION)
    # ir_version 8 keeps the file loadable by older runtimes (TensorRT's parser included).
    model.ir_version = 8
    _set_metadata(model, info, optimize=False)
    try:
        onnx.checker.check_model(model, full_check=False)
    except onnx.checker.ValidationError as exc:
        raise ExportError(f"{info.model_dir}: exported graph is invalid ({exc})") from None
    return model


# ---------------------------------------------------------------- metadata, hashing, cache


def model_info(model_dir: str | Path | ModelInfo | None) -> ModelInfo:
    """The model folder read (None: the default model), or an ExportError naming what is wrong."""
    if isinstance(model_dir, ModelInfo):
        return model_dir  # already read: a start reads the model folder once
    try:
        return ModelInfo.from_dir(default_model_dir() if model_dir is None else model_dir)
    except ModelError as exc:
        raise ExportError(str(exc)) from exc


def _hash_file(path: Path, digest: hashlib._Hash) -> None:
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)


def weights_hash(info: ModelInfo) -> str:
    st = info.weights_path.stat()
    return _weights_hash(str(info.weights_path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _weights_hash(path: str, size: int, mtime_ns: int) -> str:
    # Keyed by size and mtime too, so a rewritten file is hashed again (cache key, metadata and
    # ensure_onnx each ask for it; hashing 90 MB three times would be wasted).
    del size, mtime_ns
    digest = hashlib.sha256()
    _hash_file(Path(path), digest)
    return digest.hexdigest()


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
            _hash_file(extra, digest)
    # What the folder alone does not say: the prompt tokens a pooling leaves out (a setting).
    digest.update(f"prompt_tokens_excluded={info.pipeline.prompt_tokens_excluded};".encode())
    return digest.hexdigest()


def _set_metadata(model: onnx.ModelProto, info: ModelInfo, *, optimize: bool) -> None:
    props = {
        "model_name": info.name,
        "dim": str(info.dim),
        "max_seq_length": str(info.max_seq_length),
        "pooling": info.pooling_mode,
        "normalize": "l2" if info.normalized else "none",
        "pipeline": info.pipeline.describe(),
        "exporter_version": EXPORTER_VERSION,
        "weights_sha256": weights_hash(info),
        "optimized": str(optimize).lower(),
    }
    del model.metadata_props[:]
    for key, value in props.items():
        model.metadata_props.add(key=key, value=value)


def default_cache_dir() -> Path:
    return cache_dir("onnx")


# ---------------------------------------------------------------- optimisation


def _fuse(model: onnx.ModelProto, info: ModelInfo) -> onnx.ModelProto:
    """ORT's transformer optimizer (offline, opt_level 0: pattern fusions only, no session)."""
    import logging

    from onnxruntime.transformers.optimizer import optimize_model

    if info.relative_attention_buckets:
        raise ExportError(f"{info.model_dir}: no offline-fused graph for model_type {info.model_type!r} (ONNX "
                          "Runtime's attention fusion has no relative position bias); use the plain graph, "
                          "the default, which ONNX Runtime optimises at load")
    # The optimizer logs each fusion at INFO/WARNING; the counts are checked below instead.
    logging.getLogger("onnxruntime.transformers").setLevel(logging.ERROR)
    try:
        optimized = optimize_model(model, model_type="bert", num_heads=info.num_heads,
                                   hidden_size=info.hidden_size, opt_level=0)
    except Exception as exc:  # the optimizer raises whatever its passes raise
        raise ExportError(f"{info.model_dir}: onnxruntime transformer optimizer failed ({exc})") from exc
    fused = optimized.model
    counts = _op_counts(fused)
    if counts.get("Attention", 0) != info.num_layers:
        raise ExportError(f"{info.model_dir}: attention fusion applied to {counts.get('Attention', 0)} "
                          f"of {info.num_layers} layers; the graph layout no longer matches ORT's patterns")
    _set_metadata(fused, info, optimize=True)
    return fused


def _op_counts(model: onnx.ModelProto) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in model.graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


def _check_fused(plain: onnx.ModelProto, fused: onnx.ModelProto, info: ModelInfo) -> None:
    """Runs both graphs on a small padded batch; a fusion that changed the maths is an error."""
    import onnxruntime as ort

    rng = np.random.default_rng(0)
    lengths = [3, 7, 12]
    ids = np.zeros((len(lengths), max(lengths)), dtype=np.int64)
    mask = np.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, :n] = rng.integers(1, info.vocab_size, n)
        mask[row, :n] = 1
    outs = []
    for model in (plain, fused):
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        outs.append(sess.run([OUTPUT_NAME], {"input_ids": ids, "attention_mask": mask})[0])
    diff = float(np.abs(outs[0] - outs[1]).max())
    if not diff <= FUSED_CHECK_TOL:
        raise ExportError(f"{info.model_dir}: fused graph differs from the plain graph by {diff:.3g} "
                          f"(> {FUSED_CHECK_TOL}); not using it")


# ---------------------------------------------------------------- public API


def export_onnx(model_dir: str | Path | ModelInfo | None, output: str | Path, *, optimize: bool = True) -> Path:
    """Export the model folder to `output` (atomically) and return the path."""
    info = model_info(model_dir)
    model = build_model(info)
    if optimize:
        fused = _fuse(model, info)
        _check_fused(model, fused, info)
        model = fused
    if model.ByteSize() >= 2**31:
        # One protobuf cannot exceed 2 GiB; external-data export is not implemented (BERT-large is 1.3 GB).
        raise ExportError(f"{info.model_dir}: the graph is {model.ByteSize() / 2**30:.1f} GiB, over the 2 GiB "
                          "protobuf limit (external-data export is not supported)")
    output = Path(output).expanduser()
    try:
        write_atomic(output, lambda tmp: onnx.save_model(model, str(tmp)))
    except OSError as exc:
        raise ExportError(f"{output}: cannot write the ONNX file ({exc.strerror or exc})") from None
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
    (benchmarks/results/ort_grid.md).
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
