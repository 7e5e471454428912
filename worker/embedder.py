"""`Embedder`: the offline Python API (texts in, L2-normalised float32 vectors out).

    from worker import Embedder
    vectors = Embedder().embed(["running shoes", "東京 ラーメン"])   # [2, 384] float32

Texts are sorted by token count and cut into batches that are each padded only to their own
longest item, so short queries do not pay for long ones; the rows come back in input order.
The default graph is the plain export run with ONNX Runtime's session-time optimisations
(`optimize=True` picks the offline-fused one; see benchmarks/results/ort_grid.md for why not).
Padding does not change a vector (masked positions get exactly zero attention weight and are
left out of the mean), so the result does not depend on the batch composition.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import cast

import numpy as np

from kwe_core.model import ModelInfo, default_model_dir
from worker.backends.onnxruntime import OnnxRuntimeBackend
from worker.backends.select import open_backend
from worker.padding import pad_batch
from worker.tokenize import Encoded, KeywordTokenizer


class Embedder:
    def __init__(self, model_dir: str | Path | None = None, *, onnx_path: str | Path | None = None,
                 intra_op_threads: int = 0, batch_size: int = 64, token_budget: int = 4096,
                 optimize: bool = False) -> None:
        if batch_size < 1:
            raise ValueError(f"Embedder: batch_size must be >= 1, got {batch_size}")
        if token_budget < 1:
            raise ValueError(f"Embedder: token_budget must be >= 1, got {token_budget}")
        self.info = ModelInfo.from_dir(model_dir if model_dir is not None else default_model_dir())
        self.model_dir = self.info.model_dir
        self.tokenizer = KeywordTokenizer.from_model(self.info)
        # The plain graph by default: with ONNX Runtime's own session-time fusions (level ALL)
        # it measured ~10-15% faster than the offline-fused graph on this project's CPUs
        # (benchmarks/results/ort_grid.md); both match the reference equally.
        self.backend = cast(OnnxRuntimeBackend, open_backend(
            "onnxruntime", self.info, onnx_path=onnx_path, intra_op_threads=intra_op_threads, fused=optimize))
        self.onnx_path = self.backend.path
        self.batch_size = batch_size
        self.token_budget = token_budget
        self._context = self.backend.create_context(0)

    @property
    def dim(self) -> int:
        return self.info.dim

    @property
    def model_name(self) -> str:
        return self.info.name

    @property
    def max_len(self) -> int:
        return self.tokenizer.max_len

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """[N, dim] float32, row i the unit-norm embedding of texts[i]."""
        if isinstance(texts, str):
            raise TypeError("Embedder.embed takes a list of texts, not one string")
        return self.embed_encoded(self.tokenizer.encode(texts))

    def embed_encoded(self, encoded: Sequence[Encoded]) -> np.ndarray:
        out = np.empty((len(encoded), self.dim), dtype=np.float32)
        for rows in self._batches(encoded):
            out[rows] = self._context.run(*pad_batch([encoded[i].ids for i in rows]))
        return out

    def _batches(self, encoded: Sequence[Encoded]) -> list[list[int]]:
        """Row indices per batch: sorted by length, at most batch_size rows and token_budget padded tokens.

        The budget, and the rule that padding may at most double a batch's real tokens, keep one
        long text from dragging a batch of short ones up to its length (attention cost grows
        with the square of the padded length); a text longer than the budget gets a batch of
        its own.
        """
        # Stable sort by length: each batch is padded to its last (longest) item.
        order = sorted(range(len(encoded)), key=lambda i: len(encoded[i].ids))
        batches: list[list[int]] = []
        current: list[int] = []
        real = 0  # real (unpadded) tokens in `current`
        for i in order:
            n = len(encoded[i].ids)
            padded = (len(current) + 1) * n
            if current and (len(current) >= self.batch_size or padded > self.token_budget
                            or padded > 2 * (real + n)):
                batches.append(current)
                current, real = [], 0
            current.append(i)
            real += n
        if current:
            batches.append(current)
        return batches

    def close(self) -> None:
        self._context.close()
        self.backend.close()

    def __enter__(self) -> Embedder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
