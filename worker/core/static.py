"""Static embedding models: a table of one vector per vocabulary token, a text's vector the mean of
its tokens' rows (model2vec; sentence-transformers' StaticEmbedding). No encoder runs.

Two folder formats are read:

- model2vec (`StaticModel.save_pretrained`): config.json with `"model_type": "model2vec"` (or no
  model_type, beside a table under "embeddings") and its `normalize` (default false) and `max_length` (default 512, null: no cut), model.safetensors
  with the table under "embeddings" (and, from vocabulary quantization on, a per-token
  "weights" vector and a token -> row "mapping"), tokenizer.json.
- sentence-transformers: modules.json whose first module is StaticEmbedding (its folder, the model
  folder itself from 6.x on, holds model.safetensors, the table under "embedding.weight" or
  model2vec's "embeddings" with its "mapping" and "weights" folded in as 6.x does, and
  tokenizer.json), optionally followed by Normalize and nothing else.

How each library turns a text into a vector (model2vec 0.10 StaticModel.encode; sentence-
transformers' StaticEmbedding.tokenize/forward), which the worker reproduces:

- both tokenise without special tokens (no [CLS]/[SEP]) and average the rows of the token IDs;
- model2vec cuts the text at max_length x the median token length (characters), the tokens at
  max_length, then drops the tokenizer's unknown token; a row is multiplied by its token's weight
  where the file has weights; a text left with no token is a zero vector; normalise: x / (|x| + 1e-32);
- sentence-transformers keeps the unknown token, cuts only where tokenizer.json's truncation says
  (StaticEmbedding's max_seq_length is infinite), EmbeddingBag's mean, then Normalize if listed.

The worker cuts at `max_seq_length` (model2vec's max_length; else tokenizer.json's truncation;
else STATIC_MAX_TOKENS, far above a keyword's length, where the libraries would not cut).
Nothing here imports torch or tokenizers: the tokenizer.json is read as JSON.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from worker.core.errors import ModelError
from worker.core.st_pipeline import read_json, read_json_object

__all__ = ["STATIC_MAX_TOKENS", "StaticFormat", "StaticSpec", "StaticTable", "load_table", "read_static"]

# "sparse-static": the query route of an inference-free sparse model (worker/core/sparse_static.py),
# one weight per token and no mean; `dim` is then the vocabulary.
StaticFormat = Literal["model2vec", "sentence-transformers", "sparse-static"]
# The cut where neither the model nor its tokenizer states one: beyond any search keyword, and the
# bucketer needs a longest bucket.
STATIC_MAX_TOKENS = 512
_M2V_DEFAULT_MAX_LENGTH = 512  # model2vec's DEFAULT_MAX_LENGTH
_ST_STATIC = "StaticEmbedding"
_TABLE_KEYS = {"model2vec": ("embeddings",), "sentence-transformers": ("embedding.weight", "embeddings")}


@dataclass(frozen=True)
class StaticSpec:
    """What a static model folder states: where its table and tokenizer are and how a text is pooled."""

    format: StaticFormat
    weights_path: Path
    tokenizer_path: Path
    config_path: Path       # model2vec's config.json, or modules.json
    table_key: str          # the table's name in weights_path
    rows: int               # table rows
    dim: int
    vocab: int              # the tokenizer's token IDs: 0 .. vocab - 1
    normalize: bool
    max_tokens: int         # the token cut (see the module's docstring)
    stated_cut: bool        # whether the model states that cut (else STATIC_MAX_TOKENS)
    unk_id: int | None      # model2vec drops this token (None: the tokenizer has none, or the format keeps it)
    weighted: bool          # model2vec's per-token weights
    mapped: bool            # model2vec's vocabulary quantization: token -> row mapping

    @property
    def files(self) -> tuple[Path, ...]:
        """What the vectors depend on (the fingerprint hashes them)."""
        return (self.config_path, self.weights_path, self.tokenizer_path)

    @property
    def sparse(self) -> bool:
        return self.format == "sparse-static"

    def describe(self) -> str:
        if self.sparse:
            return (f"Router query route: SparseStaticEmbedding ({self.rows:,} token weights) -> each distinct "
                    f"token's weight -> sparse")
        weights = ", token weights" if self.weighted else ""
        unk = ", unknown token dropped" if self.unk_id is not None else ""
        norm = "Normalize" if self.normalize else "not normalised"
        return f"Static {self.format} ({self.rows:,} rows x {self.dim}{weights}{unk}) -> mean -> {norm}"


def read_static(model_dir: Path) -> StaticSpec | None:
    """The folder's static model, or None where it is not one (ModelError where it is one that is broken)."""
    config = model_dir / "config.json"
    if config.is_file():
        cfg = read_json_object(config)
        # model2vec's distill writes model_type; a StaticModel saved as constructed writes no
        # model_type at all, and is known by its table (an encoder's tensors have longer names).
        weights = model_dir / "model.safetensors"
        if cfg.get("model_type") == "model2vec" or (
                "model_type" not in cfg and weights.is_file() and "embeddings" in _tensor_shapes(weights)):
            return _model2vec(model_dir, config, cfg)
    modules = model_dir / "modules.json"
    if modules.is_file():
        raw = read_json(modules)
        if isinstance(raw, list) and raw and all(isinstance(m, dict) for m in raw):
            entries = sorted(raw, key=lambda m: m.get("idx", 0) if isinstance(m.get("idx", 0), int) else 0)
            if _type(entries[0]) == _ST_STATIC:
                return _sentence_transformers(model_dir, modules, entries)
    return None


def _type(entry: dict[str, Any]) -> str:
    return str(entry.get("type", "")).rsplit(".", 1)[-1]


def _model2vec(model_dir: Path, config: Path, cfg: dict[str, Any]) -> StaticSpec:
    normalize = cfg.get("normalize", False)
    if not isinstance(normalize, bool):
        raise ModelError(f"{config}: normalize must be true or false, got {normalize!r}")
    max_length = cfg.get("max_length", _M2V_DEFAULT_MAX_LENGTH)
    if max_length is not None and (not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 1):
        raise ModelError(f"{config}: max_length must be a positive integer or null, got {max_length!r}")
    weights, tokenizer = model_dir / "model.safetensors", model_dir / "tokenizer.json"
    return _spec("model2vec", weights, tokenizer, config, normalize, max_length, keep_unk=False)


def _sentence_transformers(model_dir: Path, modules: Path, entries: list[dict[str, Any]]) -> StaticSpec:
    rest = [_type(e) for e in entries[1:]]
    if rest not in ([], ["Normalize"]):
        raise ModelError(f"{modules}: a StaticEmbedding may be followed by Normalize only; this pipeline has "
                         f"{', '.join(rest)} after it")
    folder = model_dir / str(entries[0].get("path", ""))
    if not folder.resolve().is_relative_to(model_dir.resolve()):
        raise ModelError(f"{modules}: StaticEmbedding's path {entries[0].get('path')!r} leaves the model folder")
    tokenizer = folder / "tokenizer.json"
    return _spec("sentence-transformers", folder / "model.safetensors", tokenizer, modules, rest == ["Normalize"],
                 _tokenizer_cut(tokenizer), keep_unk=True)


def _spec(fmt: StaticFormat, weights: Path, tokenizer: Path, config: Path, normalize: bool,
          max_length: int | None, *, keep_unk: bool) -> StaticSpec:
    for required in (weights, tokenizer):
        if not required.is_file():
            raise ModelError(f"{required}: file not found (needed in a {fmt} static model folder)")
    shapes = _tensor_shapes(weights)
    key = next((k for k in _TABLE_KEYS[fmt] if k in shapes), None)
    if key is None:
        raise ModelError(f"{weights}: no embedding table (expected {' or '.join(map(repr, _TABLE_KEYS[fmt]))}; "
                         f"found {', '.join(sorted(shapes)) or 'nothing'})")
    shape = shapes[key]
    if len(shape) != 2 or min(shape) < 1:
        raise ModelError(f"{weights}: {key!r} must be a [rows, dim] table, got shape {list(shape)}")
    # model2vec's vocabulary quantization; sentence-transformers 6.x folds them in the same way when
    # a StaticEmbedding holds model2vec's "embeddings" (StaticEmbedding._fold_model2vec_weights).
    mapped, weighted = key == "embeddings" and "mapping" in shapes, key == "embeddings" and "weights" in shapes
    tok = read_json_object(tokenizer)
    vocab = _vocab_size(tok)
    if not mapped and shape[0] < vocab:
        raise ModelError(f"{weights}: the table has {shape[0]:,} rows for a tokenizer of {vocab:,} tokens")
    return StaticSpec(fmt, weights, tokenizer, config, key, int(shape[0]), int(shape[1]), vocab, normalize,
                      max_length or STATIC_MAX_TOKENS, max_length is not None,
                      None if keep_unk else _unk_id(tok), weighted, mapped)


def _tokenizer_cut(tokenizer: Path) -> int | None:
    """tokenizer.json's truncation max_length: what StaticEmbedding's tokenizer keeps (None: no cut)."""
    if not tokenizer.is_file():
        return None
    trunc = read_json_object(tokenizer).get("truncation")
    length = trunc.get("max_length") if isinstance(trunc, dict) else None
    return length if isinstance(length, int) and not isinstance(length, bool) and length > 0 else None


def _vocab_size(tok: dict[str, Any]) -> int:
    """One more than the largest token ID the tokenizer gives (its model's vocabulary and added tokens)."""
    model = tok.get("model") or {}
    vocab = model.get("vocab")
    ids = [0]
    if isinstance(vocab, dict):
        ids.append(max((v for v in vocab.values() if isinstance(v, int)), default=-1) + 1)
    elif isinstance(vocab, list):  # Unigram: [[piece, score], ...]
        ids.append(len(vocab))
    ids += [int(t["id"]) + 1 for t in tok.get("added_tokens") or [] if isinstance(t, dict) and "id" in t]
    return max(ids)


def _unk_id(tok: dict[str, Any]) -> int | None:
    """model2vec's _get_unk_token_id: the model's unk_token's ID (WordPiece, BPE, WordLevel), or Unigram's unk_id."""
    model = tok.get("model") or {}
    if model.get("type") == "Unigram":
        unk = model.get("unk_id")
        return unk if isinstance(unk, int) else None
    token = model.get("unk_token")
    if not isinstance(token, str):
        return None
    for added in tok.get("added_tokens") or []:
        if isinstance(added, dict) and added.get("content") == token:
            return int(added["id"])
    vocab = model.get("vocab")
    found = vocab.get(token) if isinstance(vocab, dict) else None
    return found if isinstance(found, int) else None


def _tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """The tensors' shapes from the safetensors header (8-byte length, then JSON), without reading them."""
    try:
        with path.open("rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            if not 2 <= size <= 100_000_000:
                raise ModelError(f"{path}: not a safetensors file (header length {size})")
            header = json.loads(fh.read(size))
    except (OSError, ValueError) as exc:
        raise ModelError(f"{path}: cannot read the safetensors header ({exc})") from None
    return {k: tuple(v.get("shape", ())) for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)}


@dataclass(frozen=True)
class StaticTable:
    """The table as the worker gathers it: row i is token i's vector times its weight (model2vec's
    mapping and weights folded in), and one extra row of zeros at index `pad` that padding points
    to; `count[i]` is 1 for a token the mean counts, 0 for the pad row and a dropped unknown token
    (whose row is zero too)."""

    rows: np.ndarray   # [vocab + 1, dim] float32, read-only ([vocab + 1] weights for "sparse-static")
    count: np.ndarray  # [vocab + 1] float32, read-only
    normalize: bool

    @property
    def pad(self) -> int:
        return self.rows.shape[0] - 1

    @property
    def dim(self) -> int:
        return int(self.rows.shape[1])


def load_table(spec: StaticSpec, vocab_size: int) -> StaticTable:
    """The table of `spec` for token IDs below `vocab_size`, as float32 (a float16 or int8 table is
    widened: model2vec averages int8 rows in float32 too)."""
    from safetensors import safe_open

    try:
        with safe_open(str(spec.weights_path), framework="numpy") as fh:
            table = fh.get_tensor(spec.table_key)
            mapping = fh.get_tensor("mapping") if spec.mapped else None
            weights = fh.get_tensor("weights") if spec.weighted else None
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own untyped errors
        raise ModelError(f"{spec.weights_path}: cannot read the table ({exc})") from None
    table = np.asarray(table, dtype=np.float32)
    if spec.sparse:  # one weight per token: a [vocab + 1] vector, the pad entry 0
        rows = np.zeros(vocab_size + 1, dtype=np.float32)
        rows[:vocab_size] = table.reshape(-1)[:vocab_size]
        rows.setflags(write=False)
        return StaticTable(rows, rows, False)
    if mapping is not None:
        mapping = np.asarray(mapping).astype(np.int64).reshape(-1)
        if len(mapping) < vocab_size or mapping.min() < 0 or mapping.max() >= len(table):
            raise ModelError(f"{spec.weights_path}: 'mapping' must give a row below {len(table):,} for each of "
                             f"{vocab_size:,} tokens")
        table = table[mapping[:vocab_size]]
    rows = np.zeros((vocab_size + 1, spec.dim), dtype=np.float32)
    rows[:vocab_size] = table[:vocab_size]
    if weights is not None:
        weights = np.asarray(weights, dtype=np.float32).reshape(-1)
        if len(weights) < vocab_size:
            raise ModelError(f"{spec.weights_path}: 'weights' has {len(weights):,} entries for {vocab_size:,} tokens")
        rows[:vocab_size] *= weights[:vocab_size, None]
    count = np.ones(vocab_size + 1, dtype=np.float32)
    count[vocab_size] = 0.0
    if spec.unk_id is not None and 0 <= spec.unk_id < vocab_size:
        rows[spec.unk_id] = 0.0
        count[spec.unk_id] = 0.0
    rows.setflags(write=False)
    count.setflags(write=False)
    return StaticTable(rows, count, spec.normalize)


def pool(table: StaticTable, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
    """[B, L] ids and mask in, [B, dim] float32 out: the mean of each row's tokens' rows (normalised
    where the model says). Padding points at the zero row; a row with nothing counted is zeros."""
    ids = np.where(attention_mask != 0, input_ids, table.pad)
    rows = table.rows
    if ids.shape[1] == 0:
        return np.zeros((ids.shape[0], table.dim), dtype=np.float32)
    # Column by column: one [B, dim] gather added in place per position. Summing a gathered
    # [B, L, dim] block along its middle axis cost two to three times as much (numpy's reduction
    # runs an inner loop of L, a few tokens, per output element).
    columns = ids.T
    out = rows.take(columns[0], axis=0)
    for column in columns[1:]:
        out += rows.take(column, axis=0)
    out /= np.maximum(table.count.take(ids).sum(axis=1), np.float32(1.0))[:, None]
    if table.normalize:
        out /= (np.sqrt(np.einsum("ij,ij->i", out, out)) + np.float32(1e-32))[:, None]
    return out
