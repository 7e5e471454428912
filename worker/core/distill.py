"""The arithmetic of `keyword-embedder distill-static` (worker/commands/distill_static.py): what
model2vec 0.10's `distill` does to the vocabulary's vectors once the teacher has given them, and
how the result is judged against the teacher. numpy only.

- `zipf_weights`: model2vec's `compute_weights`: a token's frequency estimated from its rank in
  the vocabulary (Zipf's law: p ~ 1 / (rank + 1), ranks from 1), then SIF weighting a / (a + p);
- `pca`: model2vec's `_pca_fit_transform`: the covariance's eigenvectors, largest first, each
  component's sign chosen so that its largest |score| is positive; here in float64;
- `neighbour_recall`: the quality figure: for each text, how many of its k nearest neighbours by
  cosine (itself left out) under the teacher are among its k nearest under the student.
"""

from __future__ import annotations

import re

import numpy as np

SIF_COEFFICIENT = 1e-4  # model2vec's default
REMOVE_PATTERN = r"\[unused\d+\]"  # model2vec's default token_remove_pattern


def token_pattern(text: str) -> re.Pattern[str] | None:
    """--remove-pattern as a regex (None for ""); a ValueError, which argparse reports, if it is not one."""
    try:
        return re.compile(text) if text else None
    except re.error as exc:
        raise ValueError(f"not a regular expression: {exc}") from None


def zipf_weights(n: int, sif: float | None = SIF_COEFFICIENT) -> np.ndarray:
    """The weight of each of `n` tokens in vocabulary order (model2vec's compute_weights)."""
    if sif is None:
        return np.ones(n)
    if not 0 < sif < 1:
        raise ValueError(f"the SIF coefficient must be in (0, 1), got {sif}")
    inv_rank = 1 / np.arange(2, n + 2)
    proba = inv_rank / inv_rank.sum()
    return sif / (sif + proba)


def pca(x: np.ndarray, dim: int) -> np.ndarray:
    """x [n, d] projected on its `dim` principal components (model2vec's _pca_fit_transform with an
    integer n_components): centred, the covariance's eigenvectors largest first, signs fixed."""
    x = np.asarray(x, dtype=np.float64)
    centred = x - x.mean(axis=0)
    cov = centred.T @ centred / (len(x) - 1)
    _, vectors = np.linalg.eigh(cov)
    components = vectors[:, ::-1][:, :dim]
    scores = centred @ components
    signs = np.sign(scores[np.argmax(np.abs(scores), axis=0), np.arange(scores.shape[1])])
    return scores * np.where(signs == 0, 1.0, signs)


def reduce(vectors: np.ndarray, dim: int, sif: float | None = SIF_COEFFICIENT) -> np.ndarray:
    """The static table from the teacher's vocabulary vectors (rows in vocabulary order), as
    model2vec's distill_from_model does without vocabulary quantization: PCA to `dim` (no reduction
    past the vectors' width; none at all where there are no more rows than `dim`), then each row
    times its Zipf/SIF weight."""
    vectors = np.nan_to_num(np.asarray(vectors, dtype=np.float32))
    dim = min(dim, vectors.shape[1])
    table = pca(vectors, dim) if dim < len(vectors) else vectors.astype(np.float64)
    return table * zipf_weights(len(table), sif)[:, None]


def nearest(x: np.ndarray, k: int, chunk: int = 1024) -> np.ndarray:
    """[n, k]: each row's k nearest other rows by cosine, nearest first."""
    x = np.asarray(x, dtype=np.float32)
    x = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), np.float32(1e-12))
    out = np.empty((len(x), k), dtype=np.int64)
    for start in range(0, len(x), chunk):
        sims = x[start:start + chunk] @ x.T
        rows = np.arange(len(sims))
        sims[rows, rows + start] = -np.inf
        part = np.argpartition(-sims, k, axis=1)[:, :k]
        order = np.argsort(-np.take_along_axis(sims, part, axis=1), axis=1, kind="stable")
        out[start:start + chunk] = np.take_along_axis(part, order, axis=1)
    return out


def neighbour_recall(teacher: np.ndarray, student: np.ndarray, k: int = 10) -> float:
    """The mean share of each text's k nearest neighbours under the teacher that the student's k
    nearest include (1.0: the same neighbourhoods)."""
    if teacher.shape[0] != student.shape[0] or len(teacher) <= k:
        raise ValueError(f"neighbour_recall: {len(teacher)} and {len(student)} rows; need the same number, over {k}")
    a, b = nearest(teacher, k), nearest(student, k)
    return float(np.mean([len(np.intersect1d(x, y, assume_unique=True)) for x, y in zip(a, b)]) / k)
