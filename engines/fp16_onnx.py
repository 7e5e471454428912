"""The fp16 ONNX graph a strongly typed TensorRT build parses: the exporter's float32 graph with
the encoder in float16 and the pooling and normalisation kept in float32 by Casts.

Why a graph and not a builder flag: TensorRT 11 removed weak typing (`BuilderFlag.FP16`,
`OBEY_PRECISION_CONSTRAINTS`, `ILayer.precision`, `set_output_type`); a network's arithmetic
is the type of its tensors, and TensorRT 10 already rejects those calls on a strongly typed
network. One strongly typed build from this graph therefore runs the same on 10 and 11
(engines/build_engine.py).

What changes, from the ModelProto engines/onnx_export/ builds:
- the fp32 region: the nodes named after the exporter's pooling and normalisation
  (`export_onnx.FP32_NODE_PREFIXES`) and every node downstream of them (Dense layers, the
  output). It stays float32: in half precision the floors 1e-9 (token count) and 1e-12 (norm)
  are 0, and a sum over 256 hidden states loses digits;
- every LayerNormalization stays float32 too (`layernorm_fp32`, the default), and so does every
  node named with rotary.KEEP_FP32_MARK (the RMSNorms and rotary tables of the rotary families:
  x^2 overflows fp16, positions past 2048 are not integers in it): a Cast to float32
  before it and back to float16 after, which is what PyTorch's fp16 LayerNorm computes
  internally and what TensorRT's own warning about fp16 LayerNorm overflow recommends;
- every other float32 initializer becomes float16 (the file halves); one that holds a value
  fp16 cannot (|x| > 65504) stops the conversion instead of becoming inf;
- every `Cast(to=FLOAT)` outside the fp32 region becomes `Cast(to=FLOAT16)` (the attention
  mask's Cast: 0/1 and the -10000 fill are exact in fp16);
- a Cast to float32 wherever a float16 tensor enters the fp32 region (the last hidden state
  before `masked_states`); an fp32 LayerNorm's own output is used there directly, so no value
  makes a lossy fp32 -> fp16 -> fp32 round trip.
The inputs (int64) and the output (float32) keep their types. A gemma3_text graph (metadata
model_type) is refused: EmbeddingGemma's activations overflow fp16, so its plans are FP32.

Written here rather than with onnxruntime.transformers' float16 converter: that one leaves the
graph unsorted (its Casts after their consumers; onnx.checker refuses it) and changes with
ONNX Runtime's versions, and onnxconverter-common's does not retarget existing Casts. The
exporter's graphs use a small, known set of ops, so the rule above is short and exact.

No GPU and no TensorRT here: `parity` runs both graphs in ONNX Runtime on CPU, which is the
check to pass before any TensorRT build (tests/unit/engines/test_fp16_onnx.py: cos >= 0.9999 on the golden
rows).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from engines.onnx_export.graph import OUTPUT_NAME
from engines.onnx_export.head import FP32_NODE_PREFIXES
from engines.onnx_export.rotary import KEEP_FP32_MARK
from worker.core.disk_cache import write_atomic
from worker.core.errors import KeywordEmbedderError

# Recorded in the fp16 graph's metadata (fp16_converter): bump when the conversion changes.
CONVERTER_VERSION = "1"
FP16_MAX = 65504.0
# What an fp16 graph must keep against its fp32 source on the same rows (ONNX Runtime, CPU).
PARITY_MIN_COS = 0.9999


class Fp16Error(KeywordEmbedderError, ValueError):
    """The graph cannot be made fp16 (not the exporter's, or a value fp16 cannot hold)."""


def fp32_region(model: onnx.ModelProto) -> set[str]:
    """Names of the nodes that stay float32: the pooling/normalisation nodes and all downstream."""
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    region: set[str] = set()
    todo = [n for n in model.graph.node if n.name.startswith(FP32_NODE_PREFIXES)]
    while todo:
        node = todo.pop()
        if node.name in region:
            continue
        region.add(node.name)
        for out in node.output:
            todo.extend(consumers.get(out, []))
    return region


def _elem_types(model: onnx.ModelProto) -> dict[str, int]:
    """The element type of every tensor of the graph (ONNX shape inference; the exporter stores none)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    except Exception as exc:  # onnx raises InferenceError and others depending on the failure
        raise Fp16Error(f"ONNX type inference failed on the graph ({exc})") from None
    graph = inferred.graph
    types = {vi.name: vi.type.tensor_type.elem_type for vi in [*graph.value_info, *graph.input, *graph.output]}
    types.update({init.name: init.data_type for init in graph.initializer})
    return types


def to_fp16(model: onnx.ModelProto, *, layernorm_fp32: bool = True) -> onnx.ModelProto:
    """The fp16 graph of an exporter's float32 graph (a new ModelProto; `model` is not changed)."""
    meta = {p.key: p.value for p in model.metadata_props}
    if meta.get("model_type") == "gemma3_text":
        raise Fp16Error("gemma3_text (EmbeddingGemma) is not run in fp16: its activations overflow float16 "
                        "(transformers runs it in float32 or bfloat16 only); build an FP32 plan (--no-fp16)")
    region = fp32_region(model)
    if not region:
        raise Fp16Error("no pooling/normalisation node found by name (" + ", ".join(FP32_NODE_PREFIXES) +
                        "): the ONNX graph was not written by this project's exporter; build an FP32 plan "
                        "(--no-fp16) from it instead")
    types = _elem_types(model)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph

    def keeps_fp32(node: onnx.NodeProto) -> bool:
        # The rotary families' RMSNorms and rotary tables are chains of nodes marked by name.
        return node.name in region or KEEP_FP32_MARK in node.name or (
            layernorm_fp32 and node.op_type == "LayerNormalization")

    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    half: set[str] = set()  # float tensors that are float16 in the new graph
    # A float32 initializer read on both sides keeps its float32 self for the fp32 side and gets a
    # float16 twin for the other (the exporter names each constant once, so this is rare).
    twin: dict[str, str] = {}
    initializers = []
    for init in model.graph.initializer:
        users = consumers.get(init.name, [])
        if init.data_type != TensorProto.FLOAT or not users or all(keeps_fp32(u) for u in users):
            initializers.append(init)
            continue
        values = numpy_helper.to_array(init)
        big = float(np.abs(values).max(initial=0.0))
        if not big <= FP16_MAX:  # NaN too
            raise Fp16Error(f"initializer {init.name!r} holds {big:g}, beyond float16's {FP16_MAX:g}")
        name = init.name
        if any(keeps_fp32(u) for u in users):
            initializers.append(init)
            name = twin[init.name] = f"{init.name}_fp16"
        initializers.append(numpy_helper.from_array(values.astype(np.float16), name))
        half.add(name)
    producer = {name: node for node in model.graph.node for name in node.output}
    fp32_of: dict[str, str] = {}  # an fp32 LayerNorm's output -> its float32 value before the Cast back
    to_fp32: dict[str, str] = {}  # a float16 tensor -> its Cast to float32 (one per tensor)
    nodes: list[onnx.NodeProto] = []
    for node in model.graph.node:
        new = onnx.NodeProto()
        new.CopyFrom(node)
        if keeps_fp32(node):
            for k, name in enumerate(new.input):
                if name in fp32_of:
                    new.input[k] = fp32_of[name]
                elif name in half:
                    if name not in to_fp32:
                        to_fp32[name] = f"{name}_fp32"
                        nodes.append(helper.make_node("Cast", [name], [to_fp32[name]], name=f"{name}_fp32_cast",
                                                      to=TensorProto.FLOAT))
                    new.input[k] = to_fp32[name]
            nodes.append(new)
            if node.name not in region:  # a LayerNorm inside the fp16 encoder: its output goes back to fp16
                value = new.output[0]
                fp32_of[value] = new.output[0] = f"{value}_fp32"
                nodes.append(helper.make_node("Cast", [fp32_of[value]], [value], name=f"{value}_fp16_cast",
                                              to=TensorProto.FLOAT16))
                half.add(value)
            continue
        for k, name in enumerate(new.input):
            if name in twin:
                new.input[k] = twin[name]
        if new.op_type == "Cast":
            for attr in new.attribute:
                if attr.name == "to" and attr.i == TensorProto.FLOAT:
                    attr.i = TensorProto.FLOAT16
        nodes.append(new)
        # Outside the fp32 region a float output follows its float inputs: float16 from here on.
        half.update(name for name in node.output if types.get(name) == TensorProto.FLOAT)
    del graph.node[:]
    graph.node.extend(nodes)
    del graph.initializer[:]
    graph.initializer.extend(initializers)
    del graph.value_info[:]
    if producer.get(OUTPUT_NAME) is not None and producer[OUTPUT_NAME].name not in region:
        raise Fp16Error(f"the output {OUTPUT_NAME!r} is not computed in the fp32 region")
    meta = {p.key: p.value for p in out.metadata_props}
    meta.update(precision="fp16-strong", fp16_converter=CONVERTER_VERSION, layernorm_fp32=str(layernorm_fp32).lower())
    del out.metadata_props[:]
    for key, value in meta.items():
        out.metadata_props.add(key=key, value=value)
    try:
        onnx.checker.check_model(out, full_check=True)
    except onnx.checker.ValidationError as exc:
        raise Fp16Error(f"the fp16 graph is invalid ({exc})") from None
    return out


def check_types(model: onnx.ModelProto) -> dict[str, int]:
    """How many nodes compute in float16 and float32 (the pooling region must be all float32)."""
    types = _elem_types(model)
    region = fp32_region(model)
    counts = {"fp16_nodes": 0, "fp32_nodes": 0}
    for node in model.graph.node:
        kinds = {types.get(name) for name in node.output}
        if node.name in region and TensorProto.FLOAT16 in kinds:
            raise Fp16Error(f"node {node.name!r} of the pooling/normalisation region computes in float16")
        if TensorProto.FLOAT16 in kinds:
            counts["fp16_nodes"] += 1
        elif TensorProto.FLOAT in kinds:
            counts["fp32_nodes"] += 1
    return counts


def parity(fp32: onnx.ModelProto | bytes, fp16: onnx.ModelProto | bytes,
           batches: Iterable[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """Row cosines of the fp16 graph's outputs to the fp32 graph's, both in ONNX Runtime on CPU."""
    import onnxruntime as ort

    sessions = []
    for model in (fp32, fp16):
        opts = ort.SessionOptions()
        opts.log_severity_level = 3  # the fp16 graph's "insert Cast for the CPU" notes are expected
        data = model if isinstance(model, bytes) else model.SerializeToString()
        sessions.append(ort.InferenceSession(data, opts, providers=["CPUExecutionProvider"]))
    cos = []
    for ids, mask in batches:
        feed = {"input_ids": ids.astype(np.int64), "attention_mask": mask.astype(np.int64)}
        a, b = (np.asarray(s.run([OUTPUT_NAME], feed)[0], np.float64) for s in sessions)
        den = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
        cos.append(np.where(den > 0, (a * b).sum(1) / np.where(den > 0, den, 1.0), 1.0))
    return np.concatenate(cos) if cos else np.zeros(0)


def write_fp16_onnx(onnx_path: str | Path, output: str | Path, *, layernorm_fp32: bool = True) -> Path:
    """Writes the fp16 graph of the float32 ONNX file at `onnx_path` to `output` (atomically).

    build_engine writes it beside the plan (`<plan>.fp16.onnx`), so what TensorRT parsed stays
    there to be read; converting takes seconds, a TensorRT build a minute, so nothing is cached.
    """
    try:
        source = onnx.load(str(onnx_path))
    except Exception as exc:  # onnx raises DecodeError, OSError, ... depending on the failure
        raise Fp16Error(f"{onnx_path}: not a readable ONNX model ({exc})") from None
    converted = to_fp16(source, layernorm_fp32=layernorm_fp32)
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(output, lambda tmp: onnx.save_model(converted, str(tmp)))
    return output
