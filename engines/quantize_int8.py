"""int8 variants of the ONNX export, built with ONNX Runtime's quantization tools.

Each `Int8Variant` names one recipe the field uses for BERT-family encoders:
- dynamic: weights quantized offline (per tensor or per output channel), activations
  quantized on the fly per batch (MatMulInteger + DynamicQuantizeLinear);
- static QDQ: activation ranges calibrated on real queries (a CalibrationDataReader over
  tokenized keywords), QuantizeLinear/DequantizeLinear pairs that ONNX Runtime fuses into int8
  kernels at load time;
- exclusions: MatMuls known to be sensitive left in fp32 (`nodes_to_exclude`): the two
  activation x activation products of attention (scores, context), the attention output
  projection, the last layers, the last MatMul before pooling;
- ONNX Runtime's own `quant_pre_process` (symbolic shape inference and graph optimisation)
  before quantizing.

benchmarks/int8_study.py measures every variant against the fp32 graph; this module only
builds them. Nothing here is imported by the worker at run time.
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import onnx

from worker.core.model import ModelInfo
from worker.core.errors import KeywordEmbedderError

Mode = Literal["dynamic", "static"]
Calibration = Literal["minmax", "entropy", "percentile"]
# Which MatMuls stay fp32:
#   none:        quantize every MatMul (both linear layers and attention's activation products)
#   attn-act:    the attention scores (QK^T) and context (PV) products: no weights, both
#                operands activations
#   sensitive:   attn-act + every attention output projection + the last layer's MatMuls
#                (its output dense is the pooling input)
#   sensitive+ffn-out: sensitive + every FFN output projection (GELU output has long tails)
#   measured:    what a one-group-at-a-time sensitivity scan (benchmarks/results/int8/int8.md) found
#                to cost least: only the query, key and attention output projections are int8;
#                value, both FFN projections and attention's activation products stay fp32
Exclusion = Literal["none", "attn-act", "sensitive", "sensitive+ffn-out", "measured"]


class QuantizeError(KeywordEmbedderError, RuntimeError):
    """A variant cannot be built; the message names the variant and the reason."""


@dataclass(frozen=True)
class Int8Variant:
    name: str
    mode: Mode
    per_channel: bool = False
    reduce_range: bool = False
    weight_unsigned: bool = False  # QUInt8 weights (U8U8) instead of QInt8 (U8S8)
    exclude: Exclusion = "none"
    preprocess: bool = False
    calibration: Calibration = "minmax"
    # static only: symmetric int8 activations instead of asymmetric uint8
    activation_signed: bool = False
    extra: dict[str, object] = field(default_factory=dict)


# Families whose layers carry BERT's tensor names, which the exclusion rules match on.
INT8_FAMILIES = ("bert", "roberta", "xlm-roberta")


def matmul_names(model: onnx.ModelProto) -> list[str]:
    return [n.name for n in model.graph.node if n.op_type in ("MatMul", "Gemm")]


def excluded_nodes(model: onnx.ModelProto, rule: Exclusion) -> list[str]:
    """MatMul node names that `rule` leaves in fp32 (matched on the exporter's node names)."""
    if rule == "none":
        return []
    names = matmul_names(model)
    layers = sorted({int(m.group(1)) for n in names if (m := re.search(r"encoder\.layer\.(\d+)\.", n))})
    if not layers:
        raise QuantizeError("cannot find encoder.layer.N MatMuls to exclude (was the graph renamed?)")
    last = layers[-1]
    if rule == "measured":
        keep = (".attention.self.query.", ".attention.self.key.", ".attention.output.dense.")
        return [n for n in names if not any(k in n for k in keep)]
    out: list[str] = []
    for n in names:
        act = bool(re.search(r"\.(qk|ctx)_\d+", n))
        attn_out = ".attention.output.dense." in n
        in_last = f"encoder.layer.{last}." in n
        ffn_out = re.search(r"\.output\.dense\.", n) is not None and not attn_out
        if act or (rule != "attn-act" and (attn_out or in_last)) or (rule == "sensitive+ffn-out" and ffn_out):
            out.append(n)
    return out


def _reader(batches: Sequence[tuple[np.ndarray, np.ndarray]]):  # noqa: ANN202 (ORT's base class)
    """A CalibrationDataReader over pre-tokenized batches: {input_ids, attention_mask} int64."""
    from onnxruntime.quantization import CalibrationDataReader

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self._it: Iterator[tuple[np.ndarray, np.ndarray]] = iter(batches)

        def get_next(self) -> dict[str, np.ndarray] | None:
            nxt = next(self._it, None)
            return None if nxt is None else {"input_ids": nxt[0], "attention_mask": nxt[1]}

    return Reader()


def quantize(fp32_path: str | Path, out_path: str | Path, variant: Int8Variant,
             calibration: Sequence[tuple[np.ndarray, np.ndarray]] | None = None) -> Path:
    """Write the int8 graph of `variant` to out_path; static variants need calibration batches."""
    from onnxruntime.quantization import (CalibrationMethod, QuantFormat, QuantType, quant_pre_process,
                                          quantize_dynamic, quantize_static)

    src = Path(fp32_path)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        if variant.preprocess:
            pre = Path(tmp) / "pre.onnx"
            try:
                # Symbolic shape inference gives up on the exporter's computed Reshape shapes
                # ("Incomplete symbolic shape inference"); ONNX shape inference and ORT's graph
                # optimisation, the other two steps of the pre-processing, still run.
                quant_pre_process(str(src), str(pre), skip_symbolic_shape=True)
            except Exception as exc:
                raise QuantizeError(f"{variant.name}: quant_pre_process failed: {exc}") from None
            src = pre
        model = onnx.load(str(src))
        exclude = excluded_nodes(model, variant.exclude)
        weight_type = QuantType.QUInt8 if variant.weight_unsigned else QuantType.QInt8
        try:
            if variant.mode == "dynamic":
                quantize_dynamic(str(src), str(out), per_channel=variant.per_channel,
                                 reduce_range=variant.reduce_range, weight_type=weight_type,
                                 op_types_to_quantize=["MatMul"], nodes_to_exclude=exclude,
                                 extra_options=dict(variant.extra))
            else:
                if not calibration:
                    raise QuantizeError(f"{variant.name}: static quantization needs calibration batches")
                method = {"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
                          "percentile": CalibrationMethod.Percentile}[variant.calibration]
                reader = _reader(calibration)
                extra = {"CalibTensorRangeSymmetric": False, **variant.extra}
                if variant.activation_signed:
                    extra["ActivationSymmetric"] = True
                quantize_static(str(src), str(out), reader, quant_format=QuantFormat.QDQ,
                                per_channel=variant.per_channel, reduce_range=variant.reduce_range,
                                activation_type=QuantType.QInt8 if variant.activation_signed else QuantType.QUInt8,
                                weight_type=weight_type, op_types_to_quantize=["MatMul"],
                                nodes_to_exclude=exclude, calibrate_method=method,
                                calibration_providers=["CPUExecutionProvider"], extra_options=extra)
        except QuantizeError:
            raise
        except Exception as exc:
            raise QuantizeError(f"{variant.name}: ONNX Runtime quantization failed: {exc}") from None
    return out


def quantized_op_counts(path: str | Path) -> dict[str, int]:
    """How many int8 ops a graph holds (MatMulInteger, QLinearMatMul, DynamicQuantizeLinear, QDQ pairs)."""
    model = onnx.load(str(path))
    counts: dict[str, int] = {}
    for n in model.graph.node:
        if n.op_type in ("MatMulInteger", "QLinearMatMul", "DynamicQuantizeLinear", "QuantizeLinear",
                         "DequantizeLinear", "MatMul"):
            counts[n.op_type] = counts.get(n.op_type, 0) + 1
    return counts


# ---------------------------------------------------------------- the shipped recipe, cached
# Bump when the shipped recipe or this code's output changes: it is part of the cache key.
INT8_VERSION = "1"
# The variant that met the quality gate in benchmarks/results/int8/int8.md (docs/performance.md, int8).
SHIPPED = Int8Variant("dynamic, per-channel, only Q/K/attention-out int8 (measured)", "dynamic", per_channel=True,
                      exclude="measured")


def int8_cached_path(model_dir: str | Path | ModelInfo | None = None, *, cache_dir: str | Path | None = None) -> Path:
    """Where ensure_int8_onnx keeps the int8 graph: beside the fp32 export, keyed by it."""
    import hashlib

    import onnxruntime

    from engines.onnx_export.export import cached_path

    fp32 = cached_path(model_dir, optimize=False, cache_dir=cache_dir)
    digest = hashlib.sha256(f"{fp32.name};int8={INT8_VERSION};{SHIPPED!r};"
                            f"onnxruntime={onnxruntime.__version__}".encode()).hexdigest()[:12]
    return fp32.with_name(f"{fp32.stem}-int8-{digest}.onnx")


def ensure_int8_onnx(model_dir: str | Path | ModelInfo | None = None, *, cache_dir: str | Path | None = None) -> Path:
    """The cached int8 graph (the SHIPPED recipe) of the model folder, quantized first if missing."""
    from engines.onnx_export.export import ensure_onnx, model_info
    from worker.core.disk_cache import locked, write_atomic

    family = model_info(model_dir).model_type
    if family not in INT8_FAMILIES:
        # The recipe picks MatMuls by BERT's tensor names; DistilBERT's and MPNet's differ, and
        # no recipe has been measured for them (benchmarks/results/int8/int8.md).
        raise QuantizeError(f"precision int8 supports the encoder families {', '.join(INT8_FAMILIES)}, "
                            f"not model_type {family!r}; use precision fp32")
    path = int8_cached_path(model_dir, cache_dir=cache_dir)
    if path.is_file():
        return path
    fp32 = ensure_onnx(model_dir, optimize=False, cache_dir=cache_dir)
    with locked(path.parent / f".{path.name}.lock"):
        if not path.is_file():  # another process may have finished it while we waited
            write_atomic(path, lambda tmp: quantize(fp32, tmp, SHIPPED))
    return path
