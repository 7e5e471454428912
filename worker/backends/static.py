"""The static model backend: a table lookup and a mean in numpy (worker/core/static.py), no graph.

It sits where an inference backend does, behind the bucketer: the intake's token IDs arrive in
padded batches, and each context gathers their rows. Everything around it is the same as for any
model: batching, the embedding cache, the output encodings and truncate_dim, the fingerprint,
delivery guarantees, dead letters (a batch that fails is split by IsolatingBackend as any other).
A gather of a batch's rows costs about a microsecond a keyword (docs/models.md, Static models),
less than what the host path spends on each, so the bucketer's own cost is the one that stays.

Threads: the table is read-only and shared; a context holds nothing, so any number may run at once.
"""

from __future__ import annotations

import numpy as np

from worker.backends.base import BackendError, check_batch
from worker.core.model import ModelInfo
from worker.core.sparse_static import presence_weights
from worker.core.static import StaticTable, load_table, pool

NAME = "static"


class StaticContext:
    def __init__(self, table: StaticTable, sparse: bool) -> None:
        self._table = table
        self._sparse = sparse

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        check_batch(NAME, input_ids, attention_mask)
        if input_ids.size and (input_ids.min() < 0 or input_ids.max() >= self._table.pad):
            raise BackendError(f"{NAME}: token IDs must be in [0, {self._table.pad}); got "
                               f"[{int(input_ids.min())}, {int(input_ids.max())}]")
        if self._sparse:  # the inference-free query route: [B, vocab] weights (worker/core/sparse_static.py)
            return presence_weights(self._table.rows, input_ids, attention_mask)
        return pool(self._table, input_ids, attention_mask)

    def close(self) -> None:
        pass


class StaticBackend:
    """A static model's table, loaded once per process."""

    name = NAME
    max_contexts: int | None = None
    requires_serial_dispatch = False

    def __init__(self, model: ModelInfo) -> None:
        if model.static is None:
            raise BackendError(f"{model.model_dir}: not a static model (the static backend runs only those)")
        self.table = load_table(model.static, model.vocab_size)
        self.sparse = model.static.sparse
        self.dim = model.dim
        self.path = model.static.weights_path  # what the Embedder reports as its model file

    def create_context(self, index: int) -> StaticContext:
        return StaticContext(self.table, self.sparse)

    def close(self) -> None:
        pass
