"""The one padding function every batching path uses (bucketer, Embedder, benchmark policies)."""

from __future__ import annotations

import numpy as np
import pytest

from worker.batching.padding import length_batches, pad_batch


def test_pads_to_a_given_length_with_a_mask_over_the_tokens() -> None:
    rows = [np.array([101, 7, 102]), np.array([101, 102])]
    ids, mask = pad_batch(rows, 5)
    assert ids.dtype == np.int64 and mask.dtype == np.int64
    assert ids.tolist() == [[101, 7, 102, 0, 0], [101, 102, 0, 0, 0]]
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]]


def test_default_length_is_the_longest_row() -> None:
    ids, mask = pad_batch([np.array([5]), np.array([1, 2, 3, 4]), np.array([9, 9], dtype=np.int32)])
    assert ids.shape == mask.shape == (3, 4)
    assert ids[2].tolist() == [9, 9, 0, 0] and mask.sum(1).tolist() == [1, 4, 2]


def test_a_row_longer_than_the_length_is_refused() -> None:
    with pytest.raises(ValueError, match="row 1 has 3 tokens, more than pad_len 2"):
        pad_batch([np.array([1]), np.array([1, 2, 3])], 2)


def test_no_rows() -> None:
    ids, mask = pad_batch([], 8)
    assert ids.shape == mask.shape == (0, 8)


@pytest.mark.parametrize(("lengths", "max_rows", "budget", "expected"), [
    ([3, 1, 2], 8, None, [[1, 2, 0]]),  # sorted by length, stable
    ([2, 2, 2, 2, 2], 2, None, [[0, 1], [2, 3], [4]]),  # at most max_rows
    ([4, 4, 4], 8, 8, [[0, 1], [2]]),  # at most the padded-token budget
    ([1, 1, 9], 8, None, [[0, 1], [2]]),  # padding may at most double the real tokens
    ([20, 1], 8, 10, [[1], [0]]),  # a row longer than the budget runs alone
    ([], 4, None, []),
])
def test_length_batches(lengths: list[int], max_rows: int, budget: int | None, expected: list[list[int]]) -> None:
    assert length_batches(lengths, max_rows, budget) == expected
