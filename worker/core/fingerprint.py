"""The model fingerprint: one short hash of everything that decides what a vector is.

Two embeddings are comparable only when the same model files, module pipeline, prompt, width,
encoding and normalisation made them. The fingerprint hashes exactly those, so a reader can tell
two outputs apart by it alone (a model swapped under the same name, a prompt, a truncate_dim,
int8 instead of floats), and equal fingerprints mean comparable vectors:

- the content of the model's files, by name within the folder (never its path, so every machine
  agrees): config.json, model.safetensors, tokenizer.json, tokenizer_config.json and
  sentence_bert_config.json (max_seq_length) where present, and every file of the
  sentence-transformers module pipeline (modules.json, the pooling config, each Dense layer's
  config and weights: `ModulePipeline.files`);
- the vector settings: the prompt text, the width written (truncate_dim, or the model's),
  the output encoding and, for int8, its range; whether the vectors are unit length (the
  pipeline's Normalize); the token limit the text is cut at; for a sparse (SPLADE) model
  (encoding "sparse") its top-k and minimum weight, which decide which weights are written.

Not in it: the backend and the arithmetic (fp32, bf16, int8 graph, a TensorRT plan). Those change
a vector only within the parity gate, so their outputs stay comparable; the precision is stated
beside the fingerprint (kwe_model_info, the start log), not inside it.

`FINGERPRINT_VERSION` is the first part of the value ("v1-..."): a change to what is hashed, or how,
bumps it, so an old and a new fingerprint of the same model never look equal by accident.

This module is the one place that hashes model files: the ONNX exporter's cache key
(engines/onnx_export/export.py) reads its file hashes from here too, so a start hashes the weights
once. Computed once per start; the output codec writes the resulting constant.
Pure functions; the file-hash cache is safe to call from any thread (functools.lru_cache).
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

FINGERPRINT_VERSION = 1
# 16 hex characters (64 bits): collisions between the few models a team runs are out of reach,
# and the value stays short enough for a header, a log line and a Prometheus label.
DIGEST_CHARS = 16
# Files of a model folder that decide its vectors, besides the module pipeline's own.
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
               "sentence_bert_config.json")


class _Digest(Protocol):
    def update(self, data: bytes, /) -> None: ...


def hash_file_into(path: Path, digest: _Digest) -> None:
    """Feeds a file's bytes to `digest` in 1 MiB chunks (the exporter's cache key is built so)."""
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file's content, hex; computed once per (path, size, mtime) in a process."""
    st = path.stat()
    return _file_sha256(str(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _file_sha256(path: str, size: int, mtime_ns: int) -> str:
    # Keyed by size and mtime too, so a rewritten file is hashed again; the weights (90 MB and
    # more) are asked for by the fingerprint, the export's cache key and its metadata.
    del size, mtime_ns
    digest = hashlib.sha256()
    hash_file_into(Path(path), digest)
    return digest.hexdigest()


class _Model(Protocol):
    """What the fingerprint reads of a model (worker.core.model.ModelInfo)."""

    @property
    def model_dir(self) -> Path: ...
    @property
    def pipeline(self) -> Any: ...
    @property
    def max_seq_length(self) -> int: ...
    @property
    def normalized(self) -> bool: ...
    @property
    def dim(self) -> int: ...


@dataclass(frozen=True)
class VectorSettings:
    """What besides the model files changes a vector: the settings the output codec is built with."""

    prompt: str = ""  # the text put before each keyword (resolved: a named prompt's text)
    truncate_dim: int = 0  # 0: the model's full width
    encoding: str = "float-list"
    int8_range: tuple[float, float] | None = None  # the int8 encoding's range, as written
    # A sparse model's (encoding "sparse"): which of its non-zero weights are written.
    sparse_top_k: int = 0
    sparse_min_weight: float = 0.0


@dataclass(frozen=True)
class Fingerprint:
    """The fingerprint value ("v1-" and 16 hex characters) and what it was computed from."""

    value: str
    inputs: dict[str, Any] = field(compare=False, repr=False)

    def __str__(self) -> str:
        return self.value


def model_files(model: _Model) -> list[tuple[str, Path]]:
    """(name within the folder, path) of every file the fingerprint hashes, sorted by name."""
    root = model.model_dir
    found: dict[str, Path] = {}
    for path in [root / name for name in MODEL_FILES] + list(model.pipeline.files()):
        if path.is_file():
            try:
                name = path.relative_to(root).as_posix()
            except ValueError:  # a module file outside the folder (a link): its own name
                name = path.name
            found[name] = path
    return sorted(found.items())


def fingerprint_inputs(model: _Model, settings: VectorSettings) -> dict[str, Any]:
    """Everything the fingerprint hashes, as a JSON-ready dict (logged and tested as is)."""
    dim = settings.truncate_dim or model.dim
    int8 = settings.int8_range if settings.encoding == "int8" else None
    return {
        "version": FINGERPRINT_VERSION,
        "files": [[name, file_sha256(path)] for name, path in model_files(model)],
        "prompt": settings.prompt,
        # The width written: truncate_dim equal to the model's is the full vector, as no truncate_dim.
        "dim": dim,
        "encoding": settings.encoding,
        # repr: the shortest text that reads back as the same float, identical on every machine.
        "int8_range": None if int8 is None else [repr(float(int8[0])), repr(float(int8[1]))],
        "normalized": bool(model.normalized),
        "max_seq_length": model.max_seq_length,
    } | ({} if settings.encoding != "sparse" else {
        # Only a sparse model's inputs have these, so a dense model's fingerprint is what it was.
        "sparse_top_k": settings.sparse_top_k, "sparse_min_weight": repr(float(settings.sparse_min_weight))})


def model_fingerprint(model: _Model, settings: VectorSettings = VectorSettings()) -> Fingerprint:
    """The fingerprint of `model`'s vectors under `settings` (reads and hashes the model files)."""
    inputs = fingerprint_inputs(model, settings)
    canonical = json.dumps(inputs, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    digest = hashlib.sha256(canonical.encode("ascii")).hexdigest()[:DIGEST_CHARS]
    return Fingerprint(f"v{FINGERPRINT_VERSION}-{digest}", inputs)
