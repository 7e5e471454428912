"""Shorter and smaller vectors: Matryoshka truncation, int8 and binary quantisation.

Pure numpy, shared by the Kafka output codec and the offline Embedder, with the inverse of
each encoding for readers and tests.

- truncate: keep the first `dim` components and, for a model whose vectors are unit length,
  renormalise (sentence-transformers' `truncate_dim` followed by its normalisation); a model
  that does not normalise keeps its scale (truncate_dim alone). Only meaningful for models
  trained for it (Matryoshka losses); other models lose accuracy quickly.
- int8: each component x in the calibration range [lo, hi] maps to one of 256 steps,
  q = clip(floor((x - lo) / step), 0, 255) - 128 with step = (hi - lo) / 255: exactly
  sentence-transformers' `quantize_embeddings(precision="int8", ranges=...)` (6.x), with one
  range for every dimension (a stream has no batch to calibrate on). A reader dequantises to
  the middle of the step, x ~ lo + (q + 128.5) * step; the range travels with every record.
- binary: one sign bit per dimension (x > 0 -> 1), packed 8 to a byte with np.packbits'
  default bit order (the first dimension is the most significant bit of byte 0), i.e.
  sentence-transformers' "ubinary"; a last partial byte is padded with zero bits. Compare with
  Hamming distance.
"""

from __future__ import annotations

import math

import numpy as np

from worker.core.errors import KeywordEmbedderError

INT8_LEVELS = 255


class VectorError(KeywordEmbedderError, ValueError):
    """A truncation or quantisation the vectors cannot take; the message says why."""


def check_truncate_dim(truncate_dim: int, model_dim: int, *, source: str = "truncate_dim") -> None:
    if truncate_dim < 0:
        raise VectorError(f"{source} {truncate_dim} is negative")
    if truncate_dim > model_dim:
        raise VectorError(f"{source} {truncate_dim} is above the model's {model_dim} dimensions")


def truncate(vectors: np.ndarray, dim: int, *, renormalise: bool = True) -> np.ndarray:
    """The first `dim` components of each row (a new float32 array), renormalised to unit L2 norm
    unless `renormalise` is off (the vectors of a model that does not normalise).

    `dim` 0 or the full width returns the rows unchanged (the same array, no copy).
    """
    if dim == 0 or dim == vectors.shape[-1]:
        return vectors
    check_truncate_dim(dim, vectors.shape[-1])
    head = np.array(vectors[..., :dim], dtype=np.float32)
    if renormalise:
        norms = np.linalg.norm(head, axis=-1, keepdims=True)
        head /= np.maximum(norms, 1e-12)  # torch.nn.functional.normalize's clamp
    return head


def default_int8_range(dim: int) -> float:
    """Half-width of the symmetric int8 range when none is set: 6 / sqrt(dim), at most 1.

    A unit vector's components have a standard deviation near 1 / sqrt(dim); all-MiniLM-L6-v2's
    largest component over the golden set is 0.275 at 384 dimensions (6 / sqrt(384) = 0.306)
    and 0.487 after truncation to 64 (0.75). For unit vectors only: a model that does not
    normalise has no such bound, and the worker asks for an explicit int8_range.
    """
    return min(1.0, 6.0 / math.sqrt(dim))


def int8_step(lo: float, hi: float) -> float:
    if not (math.isfinite(lo) and math.isfinite(hi) and hi > lo):
        raise VectorError(f"int8 range [{lo}, {hi}] is not a finite range with lo < hi")
    return (hi - lo) / INT8_LEVELS


def quantize_int8(vectors: np.ndarray, lo: float, hi: float) -> np.ndarray:
    step = int8_step(lo, hi)
    q = np.floor((np.asarray(vectors, dtype=np.float32) - np.float32(lo)) / np.float32(step))
    return (np.clip(q, 0, 255) - 128).astype(np.int8)


def dequantize_int8(q: np.ndarray, lo: float, hi: float) -> np.ndarray:
    step = int8_step(lo, hi)
    return (np.float32(lo) + (q.astype(np.float32) + np.float32(128.5)) * np.float32(step)).astype(np.float32)


def pack_binary(vectors: np.ndarray) -> np.ndarray:
    """uint8 [..., ceil(dim / 8)]: the sign bits (x > 0) packed, first dimension in the high bit."""
    return np.packbits(np.asarray(vectors) > 0, axis=-1)


def unpack_binary(packed: np.ndarray, dim: int) -> np.ndarray:
    """uint8 bits [..., dim] (0 or 1) of `pack_binary`'s output."""
    return np.unpackbits(np.asarray(packed, dtype=np.uint8), axis=-1, count=dim)
