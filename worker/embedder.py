"""`Embedder`: the offline Python API (texts in, float32 vectors out, as sentence-transformers' encode).

    from worker import Embedder
    vectors = Embedder().embed(["running shoes", "東京 ラーメン"])   # [2, 384] float32

Texts are sorted by token count and cut into batches that are each padded only to their own
longest item, so short queries do not pay for long ones; the rows come back in input order.
The default graph is the plain export run with ONNX Runtime's session-time optimisations
(`optimize=True` picks the offline-fused one; see benchmarks/results/backends/ort_grid.md for why not).
Padding does not change a vector (masked positions get exactly zero attention weight and are
left out of the pooling), so the result does not depend on the batch composition. The vectors
are unit length where the model's pipeline ends in a Normalize module (`normalized`), as every
packaged model's does; a dot-product model's are not (docs/models.md).

`cache_bytes` (default: worker.settings.schema.DEFAULT_CACHE_BYTES, 0 turns it off) keeps the vectors of
texts already embedded, keyed by their token IDs after truncation: a repeat, in the same call or
a later one, is not run again, and gets bit for bit the vector computed the first time.
`backend` (default "auto"): ONNX Runtime fp32, or OpenVINO where it measured faster on this machine
and passed the fp32 parity gate (worker/backend_choice/auto.py, cached as the worker's choice is);
"onnxruntime" or "openvino" (with `openvino_precision`, the openvino extra) as given.
`precision="int8"` runs the quantized graph (engines/quantize_int8.py, cached beside the fp32
export; its quality against fp32 is in benchmarks/results/int8/int8.md).

A sparse (SPLADE) model (docs/models.md, Sparse models) gives each text its non-zero vocabulary
weights: `embed_sparse` returns them as SparseRows (worker/core/sparse.py: CSR, indices ascending;
`rows[i].indices`, `rows[i].values`), with `sparse_top_k` and `sparse_min_weight` as the worker's
settings of the same names; `embed` gives the same rows dense, [N, vocabulary] (what
sentence-transformers' `.to_dense()` gives: 122 kB a text for a 30,522-entry vocabulary).

    splade = Embedder(splade_dir)
    rows = splade.embed_sparse(["running shoes"])      # rows[0].indices, rows[0].values

Prompts and smaller vectors, as the Kafka worker's settings of the same names:

    e5 = Embedder(model_dir, prompt_name="query")     # or prompt="query: "; default: the model's default_prompt_name
    short = Embedder(truncate_dim=256).embed(texts)    # [N, 256], renormalised (normalised models)
    bits = Embedder().quantize(vectors, "binary")      # uint8 [N, dim / 8], packed sign bits
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Literal, get_args

import numpy as np

from worker.backend_choice.auto import CpuChoice
from worker.backend_choice.select import check_sparse_precision, choose_cpu, open_backend
from worker.backends.base import OvPrecision
from worker.backends.onnxruntime import OnnxRuntimeBackend
from worker.backends.openvino import OpenVinoBackend
from worker.backends.static import StaticBackend
from worker.batching.padding import length_batches, pad_batch
from worker.core.errors import KeywordEmbedderError
from worker.core.fingerprint import VectorSettings, model_fingerprint
from worker.core.model import PROMPT_AUTO, ModelInfo, Prompt, default_model_dir
from worker.core.sparse import SparseRow, SparseRows, sparsify
from worker.core.sparse_static import ROUTES
from worker.core.sparse_static import Route as SparseRoute
from worker.core.sparse import token_budget as sparse_token_budget
from worker.core.vectors import check_truncate_dim, default_int8_range, pack_binary, quantize_int8, truncate
from worker.embedding_cache import EmbeddingCache, key
from worker.intake.tokenize import Encoded, KeywordTokenizer
from worker.names import OutputEncoding
from worker.settings.schema import DEFAULT_CACHE_BYTES, BackendSetting, Precision, Settings


class EmbedderError(KeywordEmbedderError, ValueError):
    """An option the Embedder cannot take; the message names it and what it may be."""


class Embedder:
    def __init__(self, model_dir: str | Path | None = None, *, onnx_path: str | Path | None = None,
                 intra_op_threads: int = 0, batch_size: int = 64, token_budget: int = 4096,
                 optimize: bool = False, cache_bytes: int = DEFAULT_CACHE_BYTES,
                 precision: Precision = "fp32", prompt: str | None = None, prompt_name: str = PROMPT_AUTO,
                 truncate_dim: int | None = None, backend: BackendSetting = "auto",
                 openvino_precision: OvPrecision = "bf16", sparse_top_k: int = 0,
                 sparse_min_weight: float = 0.0, sparse_route: SparseRoute = "query") -> None:
        if batch_size < 1:
            raise EmbedderError(f"Embedder: batch_size must be >= 1, got {batch_size}")
        if token_budget < 1:
            raise EmbedderError(f"Embedder: token_budget must be >= 1, got {token_budget}")
        if precision not in get_args(Precision):
            raise EmbedderError(f"Embedder: precision must be one of {', '.join(get_args(Precision))}, got {precision!r}")
        if backend in ("tensorrt", "torch"):
            raise EmbedderError("Embedder runs on CPU: backend must be 'auto', 'onnxruntime' or 'openvino' "
                                f"({'TensorRT' if backend == 'tensorrt' else 'torch'} runs in the worker, with a "
                                "bucket profile)")
        if backend not in get_args(BackendSetting):
            raise EmbedderError(f"Embedder: backend must be one of auto, onnxruntime, openvino; got {backend!r}")
        if precision == "int8" and (onnx_path is not None or optimize):
            raise EmbedderError("Embedder: precision='int8' picks its own graph; it does not combine with "
                             "onnx_path or optimize")
        if sparse_route not in ROUTES:
            raise EmbedderError(f"Embedder: sparse_route must be one of {', '.join(ROUTES)}; got {sparse_route!r}")
        self.info = ModelInfo.from_dir(model_dir if model_dir is not None else default_model_dir(),
                                       sparse_route=sparse_route)
        self.model_dir = self.info.model_dir
        if sparse_top_k < 0 or sparse_min_weight < 0:
            raise EmbedderError(f"Embedder: sparse_top_k and sparse_min_weight must be >= 0, got {sparse_top_k}, "
                                f"{sparse_min_weight}")
        if self.info.sparse and truncate_dim is not None:
            raise EmbedderError(f"Embedder: truncate_dim is for dense vectors; {self.info.name} is a sparse model "
                                "(sparse_top_k keeps its largest weights)")
        if not self.info.sparse and (sparse_top_k or sparse_min_weight):
            raise EmbedderError(f"Embedder: sparse_top_k and sparse_min_weight are for sparse models; "
                                f"{self.info.name} is dense")
        self.sparse_top_k = sparse_top_k
        self.sparse_min_weight = sparse_min_weight
        if self.info.sparse:
            # The graph holds a batch's [B, S, vocabulary] logits: batches stay within LOGITS_BYTES.
            token_budget = sparse_token_budget(self.info.vocab_size, token_budget)
        if truncate_dim is not None:
            check_truncate_dim(truncate_dim, self.info.dim, source="Embedder: truncate_dim")
        self.truncate_dim = truncate_dim or 0
        self.prompt = Prompt.resolve(self.info, prompt=prompt, prompt_name=prompt_name)
        self.tokenizer = KeywordTokenizer.from_model(self.info, prompt=self.prompt)
        # A pooling with include_prompt false leaves the prompt's tokens out: the graph is built for them.
        self.info = self.info.with_prompt(self.tokenizer.prompt_tokens)
        # The plain graph by default: with ONNX Runtime's own session-time fusions (level ALL)
        # it measured ~10-15% faster than the offline-fused graph on this project's CPUs
        # (benchmarks/results/backends/ort_grid.md); both match the reference equally.
        self.backend_choice: CpuChoice | None = None
        self.backend: OnnxRuntimeBackend | OpenVinoBackend | StaticBackend
        if self.info.static is not None:  # a table lookup in numpy: no graph to choose (docs/models.md)
            opened = open_backend("onnxruntime" if backend == "auto" else backend, self.info,
                                  onnx_path=onnx_path, precision=precision)
            assert isinstance(opened, StaticBackend)
            self.backend = opened
        elif backend == "auto":
            if optimize and onnx_path is None:
                from engines.onnx_export.export import ensure_onnx

                onnx_path = ensure_onnx(self.info, optimize=True)
            settings = Settings(onnx_path=str(onnx_path or ""), precision=precision, dispatchers=1,
                                intra_op_threads=intra_op_threads, ort_allow_spinning=True)
            self.backend_choice, chosen = choose_cpu(settings, self.info, threads=intra_op_threads)
            assert isinstance(chosen, (OnnxRuntimeBackend, OpenVinoBackend))
            self.backend = chosen
        else:
            check_sparse_precision(self.info, backend, openvino_precision)
            opened = open_backend(backend, self.info, onnx_path=onnx_path, intra_op_threads=intra_op_threads,
                                  fused=optimize, precision=precision, openvino_precision=openvino_precision)
            assert isinstance(opened, (OnnxRuntimeBackend, OpenVinoBackend))
            self.backend = opened
        self.onnx_path = self.backend.path
        self.batch_size = batch_size
        self.token_budget = token_budget
        self._context = self.backend.create_context(0)
        self.cache: EmbeddingCache | None = (EmbeddingCache(cache_bytes, self.info.dim, sparse=self.info.sparse)
                                              if cache_bytes else None)

    @property
    def dim(self) -> int:
        """The width of what embed returns: truncate_dim when set, else the model's."""
        return self.truncate_dim or self.info.dim

    @property
    def sparse(self) -> bool:
        """A sparse (SPLADE) model: `embed_sparse` gives its rows (non-zero vocabulary weights)."""
        return self.info.sparse

    @property
    def normalized(self) -> bool:
        """Whether embed's rows are unit length (the model's pipeline ends in Normalize)."""
        return self.info.normalized

    @property
    def int8_range(self) -> tuple[float, float]:
        """The calibration range quantize(..., "int8") uses by default (the worker's default int8_range).

        It assumes unit vectors: for a model that does not normalise, pass quantize an int8_range.
        """
        if not self.normalized:
            raise EmbedderError(f"Embedder: {self.model_name} gives vectors that are not normalised (no Normalize "
                             f"module); the default int8 range 6/sqrt(dim) is for unit vectors: pass "
                             f"quantize(..., int8_range=(lo, hi))")
        r = default_int8_range(self.dim)
        return (-r, r)

    def fingerprint(self, encoding: OutputEncoding = "float-list", *,
                    int8_range: tuple[float, float] | None = None) -> str:
        """The model fingerprint of these vectors written with `encoding` (worker/core/fingerprint.py):
        what a worker with the same model, prompt and truncate_dim writes on its records, so a query
        embedded here can be checked against the documents it searches (docs/cutover.md). A sparse
        model's is its records' (encoding "sparse", with this Embedder's sparse_top_k and
        sparse_min_weight), whatever `encoding` says."""
        if self.sparse:
            return model_fingerprint(self.info, VectorSettings(
                prompt=self.prompt.text, encoding="sparse", sparse_top_k=self.sparse_top_k,
                sparse_min_weight=self.sparse_min_weight)).value
        if encoding == "int8":
            int8_range = int8_range or self.int8_range
        return model_fingerprint(self.info, VectorSettings(prompt=self.prompt.text, truncate_dim=self.truncate_dim,
                                                           encoding=encoding, int8_range=int8_range)).value

    def quantize(self, vectors: np.ndarray, encoding: Literal["int8", "binary"], *,
                 int8_range: tuple[float, float] | None = None) -> np.ndarray:
        """int8 [N, dim] over `int8_range` (default: the `int8_range` property), or uint8
        [N, ceil(dim / 8)] packed sign bits (worker.core.vectors)."""
        if encoding == "int8":
            return quantize_int8(vectors, *(int8_range or self.int8_range))
        if encoding == "binary":
            return pack_binary(vectors)
        raise EmbedderError(f"Embedder.quantize: encoding must be 'int8' or 'binary', got {encoding!r}")

    @property
    def model_name(self) -> str:
        return self.info.name

    @property
    def max_len(self) -> int:
        return self.tokenizer.max_len

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """[N, dim] float32, row i the embedding of texts[i] (unit norm where `normalized`)."""
        if isinstance(texts, str):
            raise TypeError("Embedder.embed takes a list of texts, not one string")
        if self.sparse:
            return self.embed_sparse(texts).to_dense()
        return truncate(self.embed_encoded(self.tokenizer.encode(texts)), self.truncate_dim,
                        renormalise=self.normalized)

    def embed_sparse(self, texts: Sequence[str]) -> SparseRows:
        """A sparse model's rows: the non-zero vocabulary weights of texts[i], indices ascending (after
        sparse_top_k and sparse_min_weight), as SparseRows."""
        if isinstance(texts, str):
            raise TypeError("Embedder.embed_sparse takes a list of texts, not one string")
        if not self.sparse:
            raise EmbedderError(f"Embedder.embed_sparse: {self.model_name} is a dense model; use embed")
        return self.embed_sparse_encoded(self.tokenizer.encode(texts))

    def embed_sparse_encoded(self, encoded: Sequence[Encoded]) -> SparseRows:
        """embed_sparse of already tokenized texts; repeats (this call's and the cache's) run once."""
        rows: list[SparseRow | None] = [None] * len(encoded)
        first: dict[bytes, int] = {}
        copies: list[tuple[int, int]] = []
        misses: list[int] = []
        keys = [key(enc.ids) for enc in encoded] if self.cache is not None else []
        for i, k in enumerate(keys):
            if k in first:
                copies.append((i, first[k]))
                continue
            first[k] = i
            row = self.cache.get(k) if self.cache is not None else None
            if row is None:
                misses.append(i)
            else:
                rows[i] = row  # type: ignore[assignment]
        if self.cache is None:
            misses = list(range(len(encoded)))
        for batch in self._batches([encoded[i] for i in misses]):
            dense = self._context.run(*pad_batch([encoded[misses[j]].ids for j in batch]))
            found = sparsify(dense, top_k=self.sparse_top_k, min_weight=self.sparse_min_weight)
            for j, row in zip(batch, found.rows()):
                i = misses[j]
                # put() returns the row already cached if another thread got there first.
                rows[i] = self.cache.put(keys[i], row) if self.cache is not None else row  # type: ignore[assignment]
        for i, j in copies:
            rows[i] = rows[j]
        return SparseRows.stack(rows, self.info.dim)  # type: ignore[arg-type]

    def embed_encoded(self, encoded: Sequence[Encoded]) -> np.ndarray:
        """[N, model dim] float32 of already tokenized texts (not truncated: the cache keeps full rows;
        a sparse model's rows dense, with no cache: embed_sparse_encoded is its form)."""
        if self.sparse:
            out = np.empty((len(encoded), self.info.dim), dtype=np.float32)
            self._run(encoded, out)
            return out
        out = np.empty((len(encoded), self.info.dim), dtype=np.float32)
        if self.cache is None:
            self._run(encoded, out)
            return out
        # Each distinct key is looked up once and, on a miss, run once; its repeats in this call
        # copy the first one's row.
        first: dict[bytes, int] = {}
        copies: list[tuple[int, int]] = []
        misses: list[int] = []
        keys = [key(enc.ids) for enc in encoded]
        for i, k in enumerate(keys):
            if k in first:
                copies.append((i, first[k]))
                continue
            first[k] = i
            row = self.cache.get(k)
            if row is None:
                misses.append(i)
            else:
                out[i] = row
        if misses:
            computed = np.empty((len(misses), self.info.dim), dtype=np.float32)
            self._run([encoded[i] for i in misses], computed)
            for i, row in zip(misses, computed):
                # put() returns the vector already cached if another thread got there first.
                out[i] = self.cache.put(keys[i], row)
        for i, j in copies:
            out[i] = out[j]
        return out

    def _run(self, encoded: Sequence[Encoded], out: np.ndarray) -> None:
        for rows in self._batches(encoded):
            out[rows] = self._context.run(*pad_batch([encoded[i].ids for i in rows]))
        return out

    def _batches(self, encoded: Sequence[Encoded]) -> list[list[int]]:
        """Row indices per batch: sorted by length, at most batch_size rows and token_budget padded
        tokens (worker/batching/padding.py's `length_batches`)."""
        return length_batches([len(e.ids) for e in encoded], self.batch_size, self.token_budget)

    def close(self) -> None:
        self._context.close()
        self.backend.close()

    def __enter__(self) -> Embedder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
