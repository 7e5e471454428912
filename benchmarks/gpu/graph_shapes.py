"""Pure logic of the CUDA-graphs mode of the PyTorch benchmark backend (no torch: tested on CPU).

A CUDA graph replays fixed shapes from fixed buffers, so the graphs mode captures one graph per
bucket of the profile, at (max_batch, bound), when a context starts, and runs a batch by copying
it into the static input buffers of the bucket whose bound covers its length. Rows past the
batch are given one unmasked token: an all-masked row would make the attention softmax 0/0 (NaN)
in a row that is then thrown away, and NaNs are best kept out of a benchmark's buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from worker.core.profiles import Profile


@dataclass(frozen=True)
class GraphShape:
    bucket: int
    batch: int
    length: int


def graph_shapes(profile: Profile) -> list[GraphShape]:
    """One static shape per bucket: its max batch at its bound."""
    return [GraphShape(i, b.max_batch, b.max_len) for i, b in enumerate(profile.buckets)]


def shape_for(shapes: list[GraphShape], profile: Profile, batch: int, length: int) -> GraphShape:
    """The captured shape a [batch, length] batch runs in: the bucket whose bound covers its length."""
    shape = shapes[profile.bucket_for(length)]
    if length > shape.length or batch > shape.batch:
        raise ValueError(f"a [{batch}, {length}] batch fits no captured graph (bucket {shape.bucket} is "
                         f"[{shape.batch}, {shape.length}])")
    return shape


def stage_rows(ids_buf: np.ndarray, mask_buf: np.ndarray, input_ids: np.ndarray, attention_mask: np.ndarray) -> int:
    """Writes a batch into the static [B, L] host buffers (zero padding); returns the batch size."""
    batch, length = input_ids.shape
    ids_buf[:batch, :length] = input_ids
    ids_buf[:batch, length:] = 0
    mask_buf[:batch, :length] = attention_mask
    mask_buf[:batch, length:] = 0
    ids_buf[batch:] = 0
    mask_buf[batch:] = 0
    mask_buf[batch:, 0] = 1  # one visible token per unused row: no 0/0 in its softmax
    return batch
