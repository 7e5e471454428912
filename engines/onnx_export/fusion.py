"""The offline-fused variant of the graph (`export-onnx --fused`): ONNX Runtime's transformer
optimizer run on the plain graph, then checked twice, since its pattern-matching fails quietly:
every layer's attention must have fused, and the fused graph must give the plain graph's vectors
on a small padded batch.

The plain graph (the default) is what TensorRT parses and what ONNX Runtime fuses itself at load;
this one exists for runtimes that load a graph as it is. MPNet is refused: ORT's attention fusion
has no relative position bias.
"""

from __future__ import annotations

import numpy as np
import onnx

from engines.onnx_export.graph import OUTPUT_NAME, ExportError
from worker.core.model import ModelInfo

# A fused graph must match the plain graph within this on the self-check batch; float32
# reassociation stays around 1e-6, a broken fusion is off by far more.
FUSED_CHECK_TOL = 1e-4


def fuse(model: onnx.ModelProto, info: ModelInfo) -> onnx.ModelProto:
    """ORT's transformer optimizer (offline, opt_level 0: pattern fusions only, no session).

    The fused model keeps the plain one's metadata_props; the caller stamps it as optimized.
    """
    import logging

    from onnxruntime.transformers.optimizer import optimize_model

    if info.rotary is not None:
        raise ExportError(f"{info.model_dir}: no offline-fused graph for model_type {info.model_type!r} (ONNX "
                          "Runtime's BERT fusions do not match rotary attention); use the plain graph, the default, "
                          "which ONNX Runtime optimises at load")
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
    counts = _op_counts(optimized.model)
    if counts.get("Attention", 0) != info.num_layers:
        raise ExportError(f"{info.model_dir}: attention fusion applied to {counts.get('Attention', 0)} "
                          f"of {info.num_layers} layers; the graph layout no longer matches ORT's patterns")
    return optimized.model


def _op_counts(model: onnx.ModelProto) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in model.graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


def check_fused(plain: onnx.ModelProto, fused: onnx.ModelProto, info: ModelInfo) -> None:
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
