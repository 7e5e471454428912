"""The static fixtures' tables, made from a formula rather than stored: the same float32 values
wherever numpy runs (to far within the parity tolerance), and no binary table in the repository.
Read by make_fixtures.py (the references) and by the tests (the folders they run)."""

from __future__ import annotations

import numpy as np


def table(rows: int, dim: int, salt: float) -> np.ndarray:
    """[rows, dim] float32, every row different and of a different norm."""
    i = np.arange(rows, dtype=np.float64)[:, None]
    j = np.arange(dim, dtype=np.float64)[None, :]
    return (np.sin(i * 0.7071 + j * 1.618 + salt) * (1.0 + 0.5 * np.cos(i * 0.013 * (j + 1.0)))).astype(np.float32)


def token_weights(vocab: int) -> np.ndarray:
    """model2vec's per-token weights (vocabulary quantization writes them): positive, uneven."""
    return (0.25 + np.abs(np.sin(np.arange(vocab, dtype=np.float64) * 0.3))).astype(np.float32)


def token_mapping(vocab: int, rows: int) -> np.ndarray:
    """model2vec's token -> row mapping: many tokens share a row."""
    return ((np.arange(vocab, dtype=np.int64) * 7919) % rows).astype(np.int64)
