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


def test_rows_of_any_length_land_in_their_own_row_in_order() -> None:
    """Views into one buffer (what the compiled tokenizer hands out), empty rows among them: each
    row's IDs at the start of its own row, zeros and a 0 mask after them."""
    rng = np.random.default_rng(7)
    flat = rng.integers(1, 30_000, size=2_000)
    lengths = rng.integers(0, 17, size=97)
    lengths[[0, 50]] = 0
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    rows = [flat[s:s + n] for s, n in zip(starts, lengths)]
    for pad_len in (None, 20):
        ids, mask = pad_batch(rows, pad_len)
        assert ids.shape[1] == (int(lengths.max()) if pad_len is None else pad_len)
        for i, row in enumerate(rows):
            assert ids[i, :len(row)].tolist() == row.tolist() and not ids[i, len(row):].any()
            assert mask[i].tolist() == [1] * len(row) + [0] * (ids.shape[1] - len(row))
