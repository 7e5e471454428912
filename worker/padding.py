"""The one padding function: token-id rows -> the [B, L] ids and mask arrays a backend takes.

Every batching path uses it: the bucketer (to the bucket bound or the batch's longest), the
offline `Embedder`, and every benchmark policy, so that policies compared against each other
differ in which rows they batch and how far they pad, never in how padding is done.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

PAD_ID = 0  # masked out, so its value never reaches a real token's output


def pad_batch(rows: Sequence[np.ndarray], pad_len: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Right-pads rows of token ids to pad_len (default: the longest row): (input_ids, attention_mask).

    Both int64 [len(rows), pad_len]; the mask is 1 over each row's tokens. A row longer than
    pad_len is a ValueError (it belongs to a longer bucket).
    """
    lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    longest = int(lengths.max()) if len(rows) else 0
    if pad_len is None:
        pad_len = longest
    elif longest > pad_len:
        row = int(np.argmax(lengths))
        raise ValueError(f"pad: row {row} has {longest} tokens, more than pad_len {pad_len}")
    input_ids = np.full((len(rows), pad_len), PAD_ID, dtype=np.int64)
    for i, ids in enumerate(rows):
        input_ids[i, :len(ids)] = ids
    # A row's mask is 1 over its tokens: compare column positions with each row's length.
    mask = (np.arange(pad_len)[None, :] < lengths[:, None]).astype(np.int64)
    return input_ids, mask
