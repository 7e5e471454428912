"""The PyTorch backend, the pure logic: what it can run, the graph shape per bucket, staging a batch
into the static buffers, the precision candidates, the encoder weights as numpy arrays.

No torch import: everything here is unit-tested without torch or a GPU (tests/unit/worker/backends/test_torch_cuda.py);
worker/backends/torch_cuda.py holds the tensors, streams and CUDA graphs that use it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from worker.core.errors import BackendError
from worker.core.model import ModelInfo
from worker.core.profiles import Profile
from worker.core.st_pipeline import Normalize

# What the forward computes exactly (torch_cuda.py): BERT's encoder (absolute positions, token
# type 0, post-LayerNorm layers, exact GELU), then one of these poolings, then an optional L2
# normalisation. Anything else runs on the backends that run the exporter's graph.
FAMILIES: tuple[str, ...] = ("bert",)
POOLINGS: tuple[str, ...] = ("mean", "cls")
OTHER_BACKENDS = "onnxruntime, openvino or tensorrt"

TorchDtype = Literal["fp16", "bf16", "fp32"]
PAD_ID = 0
# The precisions a card gets, best first: fp16 from Volta on (tensor cores), bf16 from Ampere.
FP16_MIN_CC = (7, 0)
BF16_MIN_CC = (8, 0)


def refusal(model: ModelInfo) -> str | None:
    """Why the torch backend cannot run `model` exactly; None when it can."""
    pipeline = model.pipeline
    if model.sparse:
        # Its forward here is the dense one; the MLM head and SPLADE pooling are in the ONNX graph only.
        return (f"backend 'torch' runs dense BERT encoders; {model.name} ({model.model_dir}) is a sparse (SPLADE) "
                f"model, whose MLM head and pooling are built into the ONNX graph: run it on {OTHER_BACKENDS}")
    problems = []
    if model.model_type not in FAMILIES:
        problems.append(f"model_type {model.model_type!r}")
    modes = pipeline.pooling.modes
    if len(modes) != 1 or modes[0] not in POOLINGS:
        problems.append(f"pooling {'+'.join(modes)}")
    if pipeline.prompt_tokens_excluded:
        problems.append(f"a pooling that leaves the prompt's {pipeline.prompt_tokens_excluded} tokens out")
    if any(not isinstance(step, Normalize) for step in pipeline.steps) or len(pipeline.steps) > 1:
        problems.append(" -> ".join(map(str, pipeline.steps)))
    if not problems:
        return None
    return (f"backend 'torch' runs BERT encoders with {' or '.join(POOLINGS)} pooling and an optional Normalize; "
            f"{model.name} ({model.model_dir}) has {', '.join(problems)}: run it on {OTHER_BACKENDS}")


def check_model(model: ModelInfo) -> None:
    reason = refusal(model)
    if reason is not None:
        raise BackendError(reason)


# ---------------------------------------------------------------------------- graph shapes
@dataclass(frozen=True)
class GraphShape:
    """The static shape of bucket `bucket`'s CUDA graph: its max batch at its bound."""

    bucket: int
    batch: int
    length: int


def graph_shapes(profile: Profile, max_len: int | None = None) -> list[GraphShape]:
    """One static shape per bucket: its max batch at its bound (the overflow bucket included).

    max_batch, not batch_limit: the Bucketer never sends more than batch_limit <= max_batch rows,
    and the monolithic and sorted baselines of the benchmark cut their batches at max_batch.
    `max_len` (the model's max sequence length) caps the bound: a model of 128 positions in a
    profile whose overflow bucket ends at 256 never has more than 128 real tokens, and its
    position table has no row past 127 (`trim_padding` drops the all-padding columns beyond).
    """
    return [GraphShape(i, b.max_batch, min(b.max_len, max_len or b.max_len)) for i, b in enumerate(profile.buckets)]


# The smallest graph a bucket gets: below it a replay is launch-bound (on the H200, 32x8 0.35 ms and
# 256x8 0.94 ms against 1024x8 2.8 ms, benchmarks/results/device/2026-12-04/probe.json), so a
# smaller graph would save little GPU time and cost a capture and a memory pool.
SMALLEST_GRAPH = 64


def batch_tiers(max_batch: int, smallest: int = SMALLEST_GRAPH) -> list[int]:
    """The batch sizes one bucket's graphs are captured at, ascending: its max batch, and each half
    of it down to `smallest`. A partial batch (the deadline flushed it) replays the smallest graph
    that holds it, so a large max batch costs a partial batch no padded rows beyond 2x."""
    tiers = [max_batch]
    while tiers[-1] % 2 == 0 and tiers[-1] // 2 >= smallest:
        tiers.append(tiers[-1] // 2)
    return sorted(tiers)


def bucket_graphs(shape: GraphShape, smallest: int = SMALLEST_GRAPH) -> list[GraphShape]:
    """The graphs of `shape`'s bucket (its max batch at its bound), one per batch tier, ascending."""
    return [GraphShape(shape.bucket, b, shape.length) for b in batch_tiers(shape.batch, smallest)]


def tier_for(graphs: Sequence[GraphShape], batch: int) -> int:
    """The index of the smallest of a bucket's graphs (ascending) that holds `batch` rows."""
    for i, g in enumerate(graphs):
        if batch <= g.batch:
            return i
    return len(graphs) - 1  # too large for every one: check_fits says so against the largest


def trim_padding(shape: GraphShape, input_ids: np.ndarray, attention_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The batch without the columns past the graph's length, when those are all padding (a batch
    padded to a bucket bound beyond the model's max length); otherwise as it is."""
    if input_ids.ndim == 2 and input_ids.shape[1] > shape.length and not attention_mask[:, shape.length:].any():
        return input_ids[:, :shape.length], attention_mask[:, :shape.length]
    return input_ids, attention_mask


def shape_for(shapes: Sequence[GraphShape], profile: Profile, batch: int, length: int) -> GraphShape:
    """The captured shape a [batch, length] batch runs in: the bucket whose bound covers its length."""
    shape = shapes[profile.bucket_for(length)]
    check_fits(shape, batch, length)
    return shape


def check_fits(shape: GraphShape, batch: int, length: int) -> None:
    if batch < 1 or length < 1:
        raise BackendError(f"torch: empty batch [{batch}, {length}]")
    if length > shape.length or batch > shape.batch:
        raise BackendError(f"torch: a [{batch}, {length}] batch fits no captured graph of bucket {shape.bucket} "
                           f"([{shape.batch}, {shape.length}]); it belongs to another bucket")


def stage_rows(ids_buf: np.ndarray, mask_buf: np.ndarray, input_ids: np.ndarray, attention_mask: np.ndarray) -> int:
    """Writes a batch into the static [B, L] host buffers, padded with id 0 and mask 0; returns its size.

    Rows past the batch are given one visible token: an all-masked row would make its attention
    softmax 0/0 (NaN) and its mean 0/1e-9; the row is thrown away, but NaNs are best kept out.
    Masked positions change neither a real token's attention nor the masked mean pooling, so a
    batch padded to the graph's length gives what it gives unpadded.
    """
    if input_ids.ndim != 2 or input_ids.shape != attention_mask.shape:
        raise BackendError(f"torch: input_ids {input_ids.shape} and attention_mask {attention_mask.shape} must be "
                           "the same [batch, length] shape")
    batch, length = input_ids.shape
    if batch > ids_buf.shape[0] or length > ids_buf.shape[1]:
        raise BackendError(f"torch: a [{batch}, {length}] batch does not fit the [{ids_buf.shape[0]}, "
                           f"{ids_buf.shape[1]}] buffers")
    ids_buf[:batch, :length] = input_ids
    ids_buf[:batch, length:] = PAD_ID
    mask_buf[:batch, :length] = attention_mask
    mask_buf[:batch, length:] = 0
    ids_buf[batch:] = PAD_ID
    mask_buf[batch:] = 0
    mask_buf[batch:, 0] = 1
    return batch


# ---------------------------------------------------------------------------- precision
def precision_candidates(requested: str, capability: tuple[int, int]) -> tuple[list[TorchDtype], list[str]]:
    """The precisions to try, in order, for the torch_precision setting on a card of this capability,
    and why others are not tried.

    auto: fp16, then bf16 (only where fp16 fails the gate, and the card has bf16 units), then fp32.
    fp16 first: on Ampere and Hopper both run the tensor cores at the same rate, and fp16's three
    more mantissa bits pass a cos >= 0.9999 gate more easily; bf16 only helps where fp16's range
    overflows. fp32 last: it is the reference's arithmetic and the fallback that always exists.
    """
    notes: list[str] = []
    cc = f"{capability[0]}.{capability[1]}"
    if requested == "fp32":
        return ["fp32"], notes
    if requested == "bf16":
        if capability < BF16_MIN_CC:
            raise BackendError(f"torch_precision bf16: the GPU has compute capability {cc}; bf16 needs 8.0 or "
                               "later (Ampere); use fp16 or auto")
        return ["bf16"], notes
    if requested == "fp16":
        return ["fp16"], notes
    found: list[TorchDtype] = []
    if capability >= FP16_MIN_CC:
        found.append("fp16")
    else:
        notes.append(f"compute capability {cc} has no fp16 tensor cores: fp16 not tried")
    if capability >= BF16_MIN_CC:
        found.append("bf16")
    else:
        notes.append(f"compute capability {cc} < 8.0: bf16 not tried")
    return [*found, "fp32"], notes


# ---------------------------------------------------------------------------- weights
@dataclass(frozen=True)
class LayerWeights:
    qkv_w: np.ndarray  # [3H, H]: query, key and value stacked, one GEMM instead of three
    qkv_b: np.ndarray
    out_w: np.ndarray
    out_b: np.ndarray
    ln1_w: np.ndarray
    ln1_b: np.ndarray
    ffn_in_w: np.ndarray
    ffn_in_b: np.ndarray
    ffn_out_w: np.ndarray
    ffn_out_b: np.ndarray
    ln2_w: np.ndarray
    ln2_b: np.ndarray


@dataclass(frozen=True)
class EncoderWeights:
    """A BERT encoder's weights, float32, in torch.nn.functional.linear's [out, in] layout."""

    word: np.ndarray
    position: np.ndarray
    token_type0: np.ndarray  # the row of token type 0: single-sentence input
    emb_ln_w: np.ndarray
    emb_ln_b: np.ndarray
    layers: tuple[LayerWeights, ...]


def read_weights(model: ModelInfo) -> EncoderWeights:
    """The encoder weights of a BERT model folder, read from model.safetensors as the exporter reads them.

    The same file and the same names as engines/onnx_export/encoder.py: an XxxForYyy checkpoint's "bert."
    prefix dropped, old TF ports' LayerNorm gamma/beta read as weight/bias; every shape checked
    against config.json; float16 or bfloat16 storage widened to float32 (cast to the run's dtype on
    the GPU).
    """
    from safetensors.numpy import load_file

    check_model(model)
    try:
        raw = load_file(str(model.weights_path))
    except Exception as exc:  # safetensors raises SafetensorError / OSError variants
        raise BackendError(f"{model.weights_path}: cannot read safetensors weights ({exc})") from None
    tensors = {}
    for key, value in raw.items():
        name = key.removeprefix("bert.").replace("LayerNorm.gamma", "LayerNorm.weight")
        tensors[name.replace("LayerNorm.beta", "LayerNorm.bias")] = value
    h, inter = model.hidden_size, model.intermediate_size

    def get(name: str, shape: tuple[int, ...]) -> np.ndarray:
        value = tensors.get(name)
        if value is None:
            raise BackendError(f"{model.weights_path}: missing tensor {name!r} (config.json says model_type "
                               f"{model.model_type!r})")
        if value.shape != shape:
            raise BackendError(f"{model.weights_path}: tensor {name!r} has shape {value.shape}, config.json "
                               f"implies {shape}")
        return np.array(value, dtype=np.float32, order="C", copy=True)  # writable: torch.from_numpy wants that

    layers = []
    for i in range(model.num_layers):
        p = f"encoder.layer.{i}."
        att = p + "attention.self."
        layers.append(LayerWeights(
            qkv_w=np.concatenate([get(att + n + ".weight", (h, h)) for n in ("query", "key", "value")]),
            qkv_b=np.concatenate([get(att + n + ".bias", (h,)) for n in ("query", "key", "value")]),
            out_w=get(p + "attention.output.dense.weight", (h, h)), out_b=get(p + "attention.output.dense.bias", (h,)),
            ln1_w=get(p + "attention.output.LayerNorm.weight", (h,)),
            ln1_b=get(p + "attention.output.LayerNorm.bias", (h,)),
            ffn_in_w=get(p + "intermediate.dense.weight", (inter, h)), ffn_in_b=get(p + "intermediate.dense.bias", (inter,)),
            ffn_out_w=get(p + "output.dense.weight", (h, inter)), ffn_out_b=get(p + "output.dense.bias", (h,)),
            ln2_w=get(p + "output.LayerNorm.weight", (h,)), ln2_b=get(p + "output.LayerNorm.bias", (h,))))
    types = tensors.get("embeddings.token_type_embeddings.weight")
    token_type0 = np.zeros(h, np.float32) if types is None else np.array(types[0], dtype=np.float32, copy=True)
    return EncoderWeights(
        word=get("embeddings.word_embeddings.weight", (model.vocab_size, h)),
        position=get("embeddings.position_embeddings.weight", (model.max_position_embeddings, h)),
        token_type0=token_type0,
        emb_ln_w=get("embeddings.LayerNorm.weight", (h,)), emb_ln_b=get("embeddings.LayerNorm.bias", (h,)),
        layers=tuple(layers))
