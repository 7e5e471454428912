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
from engines.onnx_export.graph import (INPUT_NAMES, OPSET, OUTPUT_NAME, ExportError, Graph, f32, gelu, i64,
                                       read_safetensors, seq_len)
from worker.core.disk_cache import cache_dir, locked, write_atomic
from worker.core.model import FAMILIES, ModelError, ModelInfo, default_model_dir
from worker.core.st_pipeline import Dense

# Bump whenever the emitted graph changes: it is part of the cache key.
EXPORTER_VERSION = "2"
# A fused graph must match the plain graph within this on the self-check batch; float32
# reassociation stays around 1e-6, a broken fusion is off by far more.
FUSED_CHECK_TOL = 1e-4


# Node-name prefixes of the float layers of the pooling and normalisation below (not the
# integer mask's Unsqueeze/Cast, nor the pool_index_* integer and boolean nodes): an FP16
# TensorRT build keeps these, and everything downstream of them (Dense layers included), in
# FP32 (engines.build_engine.keep_pooling_in_fp32), so keep them in step with the names below.
FP32_NODE_PREFIXES: tuple[str, ...] = ("masked_states", "pool_sum", "pool_count", "pooled", "norm_", OUTPUT_NAME)


def _head(g: Graph, info: ModelInfo, dense_weights: list[tuple[np.ndarray, np.ndarray | None]],
          hidden_states: str, attention_mask: str) -> str:
    """sentence-transformers' modules after the encoder: Pooling, then Dense and Normalize in order."""
    pipeline = info.pipeline
    mask = attention_mask
    if pipeline.prompt_tokens_excluded:
        mask = _without_prompt(g, attention_mask, pipeline.prompt_tokens_excluded)
    x = _pool(g, pipeline.pooling.modes, hidden_states, mask, prompt_excluded=bool(pipeline.prompt_tokens_excluded))
    dense = iter(zip(pipeline.dense, dense_weights))
    for i, step in enumerate(pipeline.steps):
        if isinstance(step, Dense):
            layer, (weight, bias) = next(dense)
            x = _dense(g, layer, weight, bias, x, i)
        else:
            x = _normalise(g, x, output=OUTPUT_NAME if i == len(pipeline.steps) - 1 else None)
    if not pipeline.normalized:
        x = g.op("Identity", [x], output=OUTPUT_NAME)
    return x


def _without_prompt(g: Graph, attention_mask: str, n: int) -> str:
    """The mask with its first n positions off: the prompt's tokens (include_prompt false), which
    lead every row (rows are right-padded), are attended to but not pooled."""
    positions = g.op("Range", [g.const("zero_scalar", np.asarray(0, dtype=np.int64)), seq_len(g, attention_mask),
                               g.const("one_scalar", np.asarray(1, dtype=np.int64))], "pool_index_positions")
    after = g.op("GreaterOrEqual", [positions, g.const("prompt_tokens", np.asarray(n, dtype=np.int64))],
                 "pool_index_after_prompt")
    keep = g.op("Cast", [after], "pool_index_keep", to=TensorProto.INT64)
    return g.op("Mul", [attention_mask, keep], "pool_index_mask")  # [B, S] int64


def _pool(g: Graph, modes: tuple[str, ...], hidden_states: str, mask: str, *, prompt_excluded: bool) -> str:
    """sentence-transformers' Pooling over the mask, the modes concatenated in their order.

    Each mode is written as sentence-transformers 6.x computes it (Pooling._forward_padded), for
    right-padded rows: mean and mean_sqrt_len_tokens divide the masked sum by the count (clamped
    at 1e-9) or its root; max takes the maximum over masked positions (-inf elsewhere);
    weightedmean weighs position p (from 1) by p; lasttoken takes the last masked position (zeros
    for a row with none); cls takes the first masked position, which is position 0 unless the
    prompt is left out (position 0 for a row with none masked).
    """
    parts: list[str] = []
    cache: dict[str, str] = {}
    single = len(modes) == 1

    def name(mode: str) -> str:
        return "pooled" if single else f"pooled_{mode}"

    def float_mask() -> str:  # [B, S, 1] float32
        if "m" not in cache:
            cache["m"] = g.op("Cast", [g.op("Unsqueeze", [mask, g.const("axis2", i64(2))], "pool_mask_u")],
                              "pool_mask", to=TensorProto.FLOAT)
        return cache["m"]

    def masked_sum_and_count() -> tuple[str, str]:
        if "sum" not in cache:
            m = float_mask()
            cache["sum"] = g.op("ReduceSum", [g.op("Mul", [hidden_states, m], "masked_states"),
                                              g.const("axis1", i64(1))], "pool_sum", keepdims=0)  # [B, H]
            count = g.op("ReduceSum", [m, g.const("axis1", i64(1))], "pool_count", keepdims=0)  # [B, 1]
            cache["count"] = g.op("Max", [count, g.const("count_min", f32(1e-9))], "pool_count_c")
        return cache["sum"], cache["count"]

    def positions() -> tuple[str, str]:  # ([1, S, 1] float32 1..S, [1, S, 1] bool: position 1)
        if "pos" not in cache:
            one = np.asarray(1, dtype=np.int64)
            end = g.op("Add", [seq_len(g, mask), g.const("one_scalar", one)], "pool_index_end")
            steps = g.op("Range", [g.const("one_scalar", one), end, g.const("one_scalar", one)], "pool_index_range")
            steps = g.op("Unsqueeze", [steps, g.const("axes02", i64(0, 2))], "pool_index_range_u")
            cache["pos"] = g.op("Cast", [steps], "pooled_positions", to=TensorProto.FLOAT)
            cache["first"] = g.op("Equal", [steps, g.const("one_scalar", np.asarray(1, dtype=np.int64))],
                                  "pool_index_first")
        return cache["pos"], cache["first"]

    def pick(score: str, select: str | None, mode: str) -> str:
        # The row's one position of highest score, as a one-hot [B, S, 1] weighting (exact: the
        # other positions add zeros); `select` zeroes it where that position must not count.
        best = g.op("ReduceMax", [score], "pooled_best", axes=[1], keepdims=1)
        onehot = g.op("Cast", [g.op("Equal", [score, best], "pool_index_pick")], "pooled_pick", to=TensorProto.FLOAT)
        if select is not None:
            onehot = g.op("Mul", [onehot, select], "pooled_pick_masked")
        return g.op("ReduceSum", [g.op("Mul", [hidden_states, onehot], "pooled_pick_states"),
                                  g.const("axis1", i64(1))], name(mode), keepdims=0)

    for mode in modes:
        if mode == "mean":
            summed, count = masked_sum_and_count()
            # sentence-transformers clamps the count at 1e-9 (an all-padding row gives zeros, not NaN).
            parts.append(g.op("Div", [summed, count], name(mode)))
        elif mode == "mean_sqrt_len_tokens":
            summed, count = masked_sum_and_count()
            parts.append(g.op("Div", [summed, g.op("Sqrt", [count], "pool_count_sqrt")], name(mode)))
        elif mode == "cls" and not prompt_excluded:
            parts.append(g.op("Gather", [hidden_states, g.const("zero_scalar", np.asarray(0, dtype=np.int64))],
                              name(mode), axis=1))
        elif mode == "cls":
            # The first masked position: score S + 1 - p there, 0 on the others, and 0.5 at
            # position 1, so a row with nothing masked takes position 0 as argmax does.
            pos, first = positions()
            span = g.op("Add", [g.op("ReduceMax", [pos], "pooled_span", axes=[1], keepdims=1),
                                g.const("one_f", f32(1.0))], "pooled_span_1")
            score = g.op("Mul", [float_mask(), g.op("Sub", [span, pos], "pooled_from_end")], "pooled_cls_score")
            first_f = g.op("Cast", [first], "pooled_first", to=TensorProto.FLOAT)
            bonus = g.op("Mul", [first_f, g.const("half", f32(0.5))], "pooled_first_half")
            parts.append(pick(g.op("Add", [score, bonus], "pooled_cls_scored"), None, mode))
        elif mode == "lasttoken":
            pos, _ = positions()
            parts.append(pick(g.op("Mul", [float_mask(), pos], "pooled_last_score"), float_mask(), mode))
        elif mode == "max":
            keep = g.op("Cast", [float_mask()], "pool_index_keep_bool", to=TensorProto.BOOL)
            filled = g.op("Where", [keep, hidden_states, g.const("minus_inf", f32(-np.inf))], "pooled_max_fill")
            parts.append(g.op("ReduceMax", [filled], name(mode), axes=[1], keepdims=0))
        elif mode == "weightedmean":
            pos, _ = positions()
            weights = g.op("Mul", [float_mask(), pos], "pooled_weights")  # [B, S, 1]
            total = g.op("ReduceSum", [g.op("Mul", [hidden_states, weights], "pooled_weighted_states"),
                                       g.const("axis1", i64(1))], "pooled_weighted_sum", keepdims=0)
            count = g.op("ReduceSum", [weights, g.const("axis1", i64(1))], "pooled_weight_total", keepdims=0)
            count = g.op("Max", [count, g.const("count_min", f32(1e-9))], "pooled_weight_total_c")
            parts.append(g.op("Div", [total, count], name(mode)))
        else:
            raise ExportError(f"pooling mode {mode!r} is not supported")
    return parts[0] if single else g.op("Concat", parts, "pooled", axis=-1)


def _dense(g: Graph, layer: Dense, weight: np.ndarray, bias: np.ndarray | None, x: str, i: int) -> str:
    """sentence-transformers' Dense: activation(x W^T + b) on the [B, in] embedding."""
    p = f"dense_{i}"
    y = g.op("MatMul", [x, g.const(f"{p}.weight", weight.T.copy())], f"{p}.matmul")
    if bias is not None:
        y = g.op("Add", [y, g.const(f"{p}.bias", bias)], f"{p}.add")
    act = layer.activation
    if act == "tanh":
        return g.op("Tanh", [y], f"{p}.tanh")
    if act == "relu":
        return g.op("Relu", [y], f"{p}.relu")
    if act == "sigmoid":
        return g.op("Sigmoid", [y], f"{p}.sigmoid")
    if act == "silu":
        return g.op("Mul", [y, g.op("Sigmoid", [y], f"{p}.silu_gate")], f"{p}.silu")
    if act == "gelu":  # torch.nn.GELU(): the exact erf form, as the encoder's
        return gelu(g, y, p)
    if act == "identity":
        return y
    raise ExportError(f"{layer.config_path}: activation {act!r} is not supported")


def _normalise(g: Graph, x: str, *, output: str | None) -> str:
    # torch.nn.functional.normalize: x / max(||x||, 1e-12).
    norm = g.op("ReduceL2", [x], "norm", axes=[1], keepdims=1)
    norm = g.op("Max", [norm, g.const("norm_min", f32(1e-12))], "norm_c")
    return g.op("Div", [x, norm], "norm_div", output=output)


def _load_dense(info: ModelInfo) -> list[tuple[np.ndarray, np.ndarray | None]]:
    """The (weight [out, in], bias [out] or None) of each Dense layer, float32."""
    out = []
    for layer in info.pipeline.dense:
        raw = read_safetensors(layer.weights_path)
        expect = {"linear.weight": (layer.out_features, layer.in_features)}
        if layer.bias:
            expect["linear.bias"] = (layer.out_features,)
        for key, shape in expect.items():
            if key not in raw:
                raise ExportError(f"{layer.weights_path}: missing tensor {key!r}")
            if raw[key].shape != shape:
                raise ExportError(f"{layer.weights_path}: tensor {key!r} has shape {raw[key].shape}, "
                                  f"{layer.config_path.name} implies {shape}")
        bias = np.ascontiguousarray(raw["linear.bias"], dtype=np.float32) if layer.bias else None
        out.append((np.ascontiguousarray(raw["linear.weight"], dtype=np.float32), bias))
    return out


def build_model(model_dir: str | Path | ModelInfo | None = None) -> onnx.ModelProto:
    """The unfused ONNX graph of the model folder, with metadata_props (in memory, not cached)."""
    info = model_info(model_dir)
    if info.model_type not in FAMILIES:  # ModelInfo refuses these already; a hand-made one may not
        raise ExportError(f"{info.config_path}: model_type {info.model_type!r} is not supported; supported "
                          f"encoder families: {', '.join(FAMILIES)}")
    weights = load_weights(info)
    dense = _load_dense(info)
    g = Graph()
    ids, mask = INPUT_NAMES
    _head(g, info, dense, encode(g, weights, info, ids, mask), mask)
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
