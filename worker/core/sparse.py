"""Sparse vectors: the non-zero entries of a SPLADE model's vocabulary-sized output.

A sparse model's graph gives [B, V] non-negative weights, nearly all zero (15 of 30,522 for a
keyword, on average, for splade-tiny). What leaves the worker, what the embedding cache keeps and
what `Embedder.embed_sparse` returns is only the non-zero entries, indices ascending (as
sentence-transformers' sparse COO tensor gives them):

- `SparseRow`: one vector, int32 indices and float32 values;
- `SparseRows`: a batch in CSR form (all indices, all values, and where each row starts), which
  the output stage indexes like a numpy batch (`rows[i]`, `rows[[2, 0]]`);
- `sparsify`: the dense [B, V] output to SparseRows, with the two settings sentence-transformers
  users know: top-k (its `max_active_dims`) and a minimum weight (this project's; off by default,
  so the default output is exactly the non-zero entries sentence-transformers returns);
- `SparseRowCodec`: a row as bytes for the embedding cache, and back as read-only views;
- `compare`: this project's parity rule against a reference (`rtol * |ref| + atol` per entry,
  on the union of the two supports, an absent entry counting as 0), used by the tests, the
  real-model check and `backend = auto`'s gate.

Why that rule and not "1e-4 relative" alone: a weight is log(1 + relu(logit)) and the logit is a
sum of terms of a few units that nearly cancel where the weight is small, so float32 arithmetic in
another order moves it by a few 1e-6 absolute. Two runs of sentence-transformers itself, batched
and one text at a time, differ by up to 2.4e-3 relative on weights near 1e-3 (6.6e-6 absolute;
tests/data/sparse/versions.json): no run of either side can hold 1e-4 relative there.

Also the cap on a sparse model's batches (`token_budget`), which its logits decide. Nothing here
imports anything but numpy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np

# The parity rule (see the module docstring): |got - ref| <= RTOL * |ref| + ATOL for every entry.
RTOL = 1e-4
ATOL = 1e-5

# The graph materialises a batch's logits, [B, S, V] float32 (engines/onnx_export/splade.py): 4 V
# bytes a token, 122 kB for a 30,522-entry vocabulary. A sparse model's batches are held to this
# many bytes of them (549 tokens for that vocabulary; the cpu profile's 8,192-token budget would
# be 1 GB). The cost per token does not grow smaller beyond ~128 tokens a batch (splade-tiny, ONNX
# Runtime, 1 thread: 137-147 us a token from 256 to 4,096 tokens; docs/models.md, Sparse models).
LOGITS_BYTES = 64 << 20


def token_budget(vocab_size: int, budget: int) -> int:
    """A batch's padded-token budget for a sparse model of this vocabulary: `budget` (a profile's,
    or the Embedder's), cut to what keeps the logits within LOGITS_BYTES."""
    return max(1, min(budget, LOGITS_BYTES // (4 * vocab_size)))

_I = np.dtype("<i4")
_F = np.dtype("<f4")


@dataclass(frozen=True, slots=True)
class SparseRow:
    """One sparse vector: its non-zero entries, indices ascending."""

    indices: np.ndarray  # int32
    values: np.ndarray   # float32, the same length

    def __len__(self) -> int:
        return len(self.indices)

    def to_dense(self, dim: int) -> np.ndarray:
        out = np.zeros(dim, dtype=np.float32)
        out[self.indices] = self.values
        return out


@dataclass(frozen=True, slots=True)
class SparseRows:
    """A batch of sparse vectors in CSR form: row i is indices/values[offsets[i]:offsets[i + 1]]."""

    indices: np.ndarray  # int32 [nnz]
    values: np.ndarray   # float32 [nnz]
    offsets: np.ndarray  # int64 [rows + 1]
    dim: int             # the vocabulary size

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def nnz(self) -> int:
        return int(self.offsets[-1])

    @overload
    def __getitem__(self, key: int) -> SparseRow: ...

    @overload
    def __getitem__(self, key: Sequence[int] | np.ndarray) -> SparseRows: ...

    def __getitem__(self, key: int | Sequence[int] | np.ndarray) -> SparseRow | SparseRows:
        if isinstance(key, (int, np.integer)):
            i = int(key) + (len(self) if key < 0 else 0)
            if not 0 <= i < len(self):
                raise IndexError(f"row {key} of {len(self)}")
            lo, hi = self.offsets[i], self.offsets[i + 1]
            return SparseRow(self.indices[lo:hi], self.values[lo:hi])
        return SparseRows.stack([self[int(i)] for i in np.asarray(key, dtype=np.int64)], self.dim)

    def rows(self) -> list[SparseRow]:
        return [self[i] for i in range(len(self))]

    def to_dense(self) -> np.ndarray:
        """[rows, dim] float32 (sentence-transformers' `.to_dense()` of its sparse tensor)."""
        out = np.zeros((len(self), self.dim), dtype=np.float32)
        rows = np.repeat(np.arange(len(self)), np.diff(self.offsets))
        out[rows, self.indices] = self.values
        return out

    @classmethod
    def stack(cls, rows: Sequence[SparseRow], dim: int) -> SparseRows:
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum([len(r) for r in rows], out=offsets[1:])
        if not rows:
            return cls(np.zeros(0, _I), np.zeros(0, _F), offsets, dim)
        return cls(np.concatenate([r.indices for r in rows]).astype(_I, copy=False),
                   np.concatenate([r.values for r in rows]).astype(_F, copy=False), offsets, dim)


def sparsify(dense: np.ndarray, *, top_k: int = 0, min_weight: float = 0.0) -> SparseRows:
    """The non-zero entries of each row of a [B, V] batch, indices ascending.

    `min_weight` > 0 drops entries whose |weight| is below it; `top_k` > 0 keeps each row's k
    largest |weights| (sentence-transformers' max_active_dims: torch.topk of |x|; its ties are
    broken arbitrarily, here towards the lower index). Both 0: every non-zero entry.
    """
    dense = np.asarray(dense, dtype=np.float32)
    if dense.ndim != 2:
        raise ValueError(f"sparsify: expected a [batch, vocabulary] array, got shape {dense.shape}")
    keep = dense != 0
    if min_weight > 0:
        keep &= np.abs(dense) >= np.float32(min_weight)
    if top_k > 0:
        # Only rows with more than k entries need a choice; keyword rows rarely have many.
        for r in np.flatnonzero(np.count_nonzero(keep, axis=1) > top_k):
            cols = np.flatnonzero(keep[r])
            chosen = cols[np.argsort(-np.abs(dense[r, cols]), kind="stable")[:top_k]]
            keep[r] = False
            keep[r, chosen] = True
    rows, cols = np.nonzero(keep)  # row-major: each row's indices come out ascending
    offsets = np.zeros(len(dense) + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows, minlength=len(dense)), out=offsets[1:])
    return SparseRows(cols.astype(_I), dense[rows, cols], offsets, dense.shape[1])


class SparseRowCodec:
    """How the embedding cache keeps a sparse row: int32 indices then float32 values, in one
    bytes object; handed back as read-only numpy views of it (bit for bit what was put)."""

    def __init__(self, dim: int) -> None:
        self.dim = dim

    def to_bytes(self, row: SparseRow) -> bytes:
        if not isinstance(row, SparseRow) or row.indices.shape != row.values.shape or row.indices.ndim != 1:
            raise ValueError(f"expected a SparseRow of matching indices and values, got {type(row).__name__}")
        return np.ascontiguousarray(row.indices, dtype=_I).tobytes() + np.ascontiguousarray(row.values, dtype=_F).tobytes()

    def from_bytes(self, value: bytes) -> SparseRow:
        n = len(value) // 8
        return SparseRow(np.frombuffer(value, dtype=_I, count=n), np.frombuffer(value, dtype=_F, count=n, offset=4 * n))

    def stack(self, rows: Sequence[SparseRow]) -> SparseRows:
        return SparseRows.stack(rows, self.dim)


@dataclass(frozen=True)
class SparseMatch:
    """How sparse vectors compare with a reference under `|got - ref| <= rtol * |ref| + atol`."""

    rows: int
    worst: float            # the largest |got - ref| / (rtol * |ref| + atol): <= 1 passes
    max_abs: float          # the largest |got - ref|
    max_rel: float          # the largest |got - ref| / |ref| over entries with |ref| >= 1e-3
    support_differs: int    # rows whose non-zero indices are not the reference's (entries of any size)
    rtol: float = RTOL
    atol: float = ATOL

    @property
    def ok(self) -> bool:
        return self.worst <= 1.0

    def line(self) -> str:
        return (f"{self.rows} rows: worst {self.worst:.3f} of the tolerance ({self.rtol:g} relative + "
                f"{self.atol:g}), max |diff| {self.max_abs:.2e}, max relative {self.max_rel:.2e} on weights >= "
                f"1e-3, {self.support_differs} rows with other non-zero indices")


def compare(got: np.ndarray | SparseRows, ref: np.ndarray | SparseRows, *, rtol: float = RTOL,
            atol: float = ATOL, chunk: int = 256) -> SparseMatch:
    """`got` against `ref`, row for row (dense [N, V] arrays or SparseRows of the same shape)."""
    if len(got) != len(ref):
        raise ValueError(f"compare: {len(got)} rows against {len(ref)}")
    worst = max_abs = max_rel = 0.0
    differs = 0
    for start in range(0, len(ref), chunk):
        part = slice(start, min(start + chunk, len(ref)))
        a = _dense(got, part)
        b = _dense(ref, part)
        if a.shape != b.shape:
            raise ValueError(f"compare: rows of width {a.shape[1]} against {b.shape[1]}")
        diff = np.abs(a.astype(np.float64) - b)
        worst = max(worst, float((diff / (rtol * np.abs(b) + atol)).max(initial=0.0)))
        max_abs = max(max_abs, float(diff.max(initial=0.0)))
        big = np.abs(b) >= 1e-3
        max_rel = max(max_rel, float((diff[big] / np.abs(b[big])).max(initial=0.0)))
        differs += int(np.count_nonzero(((a != 0) != (b != 0)).any(axis=1)))
    return SparseMatch(len(ref), worst, max_abs, max_rel, differs, rtol, atol)


def _dense(rows: np.ndarray | SparseRows, part: slice) -> np.ndarray:
    if isinstance(rows, SparseRows):
        return rows[list(range(len(rows)))[part]].to_dense()
    return np.asarray(rows[part], dtype=np.float32)
