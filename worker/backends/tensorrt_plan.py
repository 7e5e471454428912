"""TensorRT backend, the pure logic: I/O dtypes, buffer sizes per optimisation profile, the
bucket -> profile mapping, the plan's shape checks, staging a batch into the pinned host buffers.

No tensorrt or pycuda import: everything here is unit-tested without a GPU
(tests/unit/worker/backends/test_tensorrt.py); worker/backends/tensorrt.py holds the contexts, streams and
the CUDA context that use it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from worker.core.errors import BackendError
from worker.core.profiles import Profile

INPUT_NAMES: tuple[str, ...] = ("input_ids", "attention_mask")
PAD_ID = 0  # masked out, so its value never reaches a real token's output

# TensorRT DataType names -> numpy dtypes (the I/O types this backend can stage).
_TRT_TO_NUMPY: dict[str, np.dtype[Any]] = {
    "INT64": np.dtype(np.int64),
    "INT32": np.dtype(np.int32),
    "FLOAT": np.dtype(np.float32),
    "HALF": np.dtype(np.float16),
    "INT8": np.dtype(np.int8),
    "BOOL": np.dtype(np.bool_),
}


def numpy_dtype(trt_dtype: Any) -> np.dtype[Any]:
    """numpy dtype of a tensorrt.DataType (by its enum name, so this needs no tensorrt import)."""
    name = getattr(trt_dtype, "name", str(trt_dtype)).rsplit(".", 1)[-1]
    try:
        return _TRT_TO_NUMPY[name]
    except KeyError:
        raise BackendError(f"TensorRT tensor type {name} is not supported by this backend "
                           f"(supported: {', '.join(_TRT_TO_NUMPY)})") from None


# ---------------------------------------------------------------------------- pure logic
@dataclass(frozen=True)
class BufferPlan:
    """Sizes of one context's buffers: inputs [max_batch, seq_len], output [max_batch, dim]."""

    profile_index: int
    max_batch: int
    seq_len: int
    input_dtypes: tuple[tuple[str, np.dtype[Any]], ...]
    output_name: str
    output_dtype: np.dtype[Any]
    dim: int

    @property
    def input_shape(self) -> tuple[int, int]:
        return (self.max_batch, self.seq_len)

    @property
    def output_shape(self) -> tuple[int, int]:
        return (self.max_batch, self.dim)

    def input_nbytes(self, name: str) -> int:
        dtype = dict(self.input_dtypes)[name]
        return self.max_batch * self.seq_len * dtype.itemsize

    @property
    def output_nbytes(self) -> int:
        return self.max_batch * self.dim * self.output_dtype.itemsize

    @property
    def total_nbytes(self) -> int:
        """Bytes of one copy of every buffer (pinned host and device each take this much)."""
        return sum(self.input_nbytes(n) for n, _ in self.input_dtypes) + self.output_nbytes


def buffer_plan(profile: Profile, index: int, *, input_dtypes: Mapping[str, Any], output_name: str,
                output_dtype: Any, dim: int) -> BufferPlan:
    """Buffer sizes for context `index`, from the bucket's bound and max batch and the engine's dtypes."""
    b = profile.buckets[profile_index_for_bucket(profile, index)]
    if dim < 1:
        raise BackendError(f"embedding dimension must be positive, got {dim}")
    missing = [n for n in INPUT_NAMES if n not in input_dtypes]
    if missing:
        raise BackendError(f"engine input(s) {missing} missing; the plan must take {list(INPUT_NAMES)}")
    dtypes = tuple((n, np.dtype(input_dtypes[n])) for n in INPUT_NAMES)
    for n, dt in dtypes:
        if dt.kind not in "iu":
            raise BackendError(f"engine input {n!r} has type {dt}; expected an integer tensor")
    return BufferPlan(index, b.max_batch, b.max_len, dtypes, output_name, np.dtype(output_dtype), dim)


def profile_index_for_bucket(profile: Profile, bucket_index: int) -> int:
    """The optimisation profile that bucket `bucket_index` runs on: the same index.

    build_engine adds the profiles in bucket order, and the sidecar check guarantees the plan
    was built for exactly these buckets, so the mapping is the identity; this is the one place
    that says so, and it rejects an index that names no bucket.
    """
    n = len(profile.buckets)
    if not 0 <= bucket_index < n:
        raise BackendError(f"context {bucket_index} requested, but profile {profile.name!r} has {n} buckets "
                           f"(contexts 0..{n - 1})")
    return bucket_index


def check_engine_profiles(profile: Profile, shapes: Sequence[Mapping[str, Sequence[Sequence[int]]]]) -> None:
    """Checks the plan's own profile shapes against the buckets (belt and braces after the sidecar).

    `shapes[i][name]` is `engine.get_tensor_profile_shape(name, i)`: [min, opt, max].
    """
    if len(shapes) != len(profile.buckets):
        raise BackendError(f"the plan has {len(shapes)} optimisation profiles, profile {profile.name!r} has "
                           f"{len(profile.buckets)} buckets")
    for i, (b, per_input) in enumerate(zip(profile.buckets, shapes)):
        for name in INPUT_NAMES:
            mn, _opt, mx = (tuple(int(d) for d in s) for s in per_input[name])
            if mn[1] != b.max_len or mx[1] != b.max_len or mx[0] < b.max_batch or mn[0] > 1:
                raise BackendError(
                    f"plan profile {i} input {name!r} admits min {mn} .. max {mx}, but bucket {i} sends "
                    f"[1..{b.max_batch}, {b.max_len}]; the plan was built for other buckets")


def check_batch(plan: BufferPlan, input_ids: np.ndarray, attention_mask: np.ndarray) -> tuple[int, int]:
    """(batch, length) of a batch that fits context `plan`, or BackendError saying why not."""
    if input_ids.ndim != 2 or input_ids.shape != attention_mask.shape:
        raise BackendError(f"input_ids {input_ids.shape} and attention_mask {attention_mask.shape} must be "
                           "the same [batch, length] shape")
    batch, length = input_ids.shape
    if batch < 1 or length < 1:
        raise BackendError(f"empty batch {input_ids.shape}")
    if batch > plan.max_batch:
        raise BackendError(f"batch of {batch} exceeds profile {plan.profile_index}'s max batch {plan.max_batch}")
    if length > plan.seq_len:
        raise BackendError(f"batch length {length} exceeds profile {plan.profile_index}'s bound {plan.seq_len}: "
                           "it belongs to a later bucket")
    return batch, length


def stage_batch(plan: BufferPlan, host: Mapping[str, np.ndarray], input_ids: np.ndarray,
                attention_mask: np.ndarray) -> int:
    """Copies a batch into the [max_batch, seq_len] host buffers, padded to seq_len; returns the batch size.

    Only the first `batch` rows are written (and later copied to the device): rows past the
    batch are never read by TensorRT, since the input shape is set to (batch, seq_len).
    """
    batch, length = check_batch(plan, input_ids, attention_mask)
    for name, src in (("input_ids", input_ids), ("attention_mask", attention_mask)):
        dst = host[name]
        if dst.shape != plan.input_shape:
            raise BackendError(f"host buffer {name!r} is {dst.shape}, expected {plan.input_shape}")
        # The buffer has the engine's input dtype (int64 from our export); assignment converts
        # an int32 batch, should a caller send one.
        dst[:batch, :length] = src
        if length < plan.seq_len:
            dst[:batch, length:] = PAD_ID
    return batch


def shared_memory_size(per_profile: Sequence[int]) -> int:
    """Bytes of the one device-memory block shared by all contexts: the largest profile's need."""
    if not per_profile:
        raise BackendError("the plan has no optimisation profiles")
    return max(int(n) for n in per_profile)
