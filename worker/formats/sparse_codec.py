"""The output record of a sparse (SPLADE) model: the non-zero vocabulary weights of each keyword.

    {"id": "q-2", "embedding": {"indices": [2109, 3751, ...], "values": [1.53, 2.02, ...]},
     "encoding": "sparse", "dim": 30522, "model": "splade-tiny-msmarco", "tokens": 4, "truncated": false,
     "fingerprint": "v1-..."}

`embedding` is the shape Qdrant, Milvus and OpenSearch's neural sparse ingest a sparse vector in
(indices ascending, values float32, written in their shortest exact form); `dim` is the vocabulary
size. With `sparse_terms`, a `terms` list beside it holds each index's vocabulary token (for
inspection, or for a sink that keys sparse vectors by token: Elasticsearch, OpenSearch).
`fingerprint` (and its kwe-fingerprint header) and `prompt_name` are written as the dense record
writes them; the fingerprint covers sparse_top_k and sparse_min_weight (worker/core/fingerprint.py). The registry formats (Avro, Protobuf,
JSON Schema) write the same fields (worker/formats/registry_schemas/sparse-embedding.*).

`values` writes a batch byte for byte as `value` writes each record, with the fixed fields written
once per codec and the indices and values of the whole batch in one orjson call each
(tests/unit/worker/core/test_sparse.py holds the two against each other).

Runs on the output thread only (like OutputCodec); the codec is immutable.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import orjson

from worker.core.sparse import SparseRow, SparseRows
from worker.formats.messages import (H_DIM, H_ENCODING, H_FINGERPRINT, H_MODEL, H_PROMPT, H_PROMPT_NAME, Headers,
                                     values_one_by_one)
from worker.settings.output_fields import FieldMap, apply_output_fields

ENCODING = "sparse"  # the record's `encoding` and the kwe-encoding header


def _json_lists(arrays: list[np.ndarray]) -> list[bytes]:
    """Each array as orjson writes it alone (the inside of its brackets), from one call: a list of
    numbers holds no bracket, so the whole splits at "],[" (an empty row gives b"")."""
    whole = orjson.dumps(arrays, option=orjson.OPT_SERIALIZE_NUMPY)
    return whole[2:-2].split(b"],[")


@dataclass(frozen=True)
class SparseOutputCodec:
    """Encodes a sparse model's rows (SparseRow / SparseRows) for one model and prompt."""

    model: str
    dim: int  # the vocabulary size
    prompt_name: str | None = None
    prompt: str = ""
    fields: FieldMap = field(default_factory=lambda: FieldMap())  # output_fields (JSON only)
    # The vocabulary's tokens by id, for `terms` (sparse_terms); None: not written.
    vocabulary: tuple[str, ...] | None = None
    # The model fingerprint, computed once at start (codec_choice.output_codec); "": none written.
    fingerprint: str = ""
    encoding: str = field(default=ENCODING, init=False)
    _headers: Headers = field(init=False, repr=False, compare=False)
    _extra: dict[str, object] = field(init=False, repr=False, compare=False)
    _fixed: tuple[bytes, bytes] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.vocabulary is not None and len(self.vocabulary) != self.dim:
            raise ValueError(f"SparseOutputCodec: {len(self.vocabulary)} vocabulary tokens for dim {self.dim}")
        headers: Headers = [(H_MODEL, self.model.encode()), (H_ENCODING, ENCODING.encode()),
                            (H_DIM, str(self.dim).encode())]
        extra: dict[str, object] = {}
        if self.fingerprint:  # a constant of the codec, as the dense record writes it
            headers.append((H_FINGERPRINT, self.fingerprint.encode("ascii")))
            extra["fingerprint"] = self.fingerprint
        if self.prompt:
            headers.append((H_PROMPT, self.prompt.encode("utf-8")))
            extra["prompt_name"] = self.prompt_name
            if self.prompt_name is not None:
                headers.append((H_PROMPT_NAME, self.prompt_name.encode("utf-8")))
        object.__setattr__(self, "_headers", headers)
        object.__setattr__(self, "_extra", extra)
        middle = orjson.dumps({"encoding": ENCODING, "dim": self.dim, "model": self.model})[1:-1]
        tail = (b"," + orjson.dumps(extra)[1:-1] if extra else b"") + b"}"
        object.__setattr__(self, "_fixed", (b"," + middle + b',"tokens":', tail))

    @property
    def headers(self) -> Headers:
        return list(self._headers)

    def terms(self, row: SparseRow) -> list[str]:
        assert self.vocabulary is not None
        vocabulary = self.vocabulary
        return [vocabulary[i] for i in row.indices.tolist()]

    def record(self, qid: str, row: SparseRow, tokens: int, truncated: bool, *,
               raw_bytes: bool = False) -> dict[str, object]:
        """The output record as a dict, before output_fields: the embedding's indices and values as
        numpy arrays (`raw_bytes` is the dense codec's; a sparse record has no byte encoding)."""
        del raw_bytes
        record: dict[str, object] = {"id": qid, "embedding": {"indices": row.indices, "values": row.values}}
        if self.vocabulary is not None:
            record["terms"] = self.terms(row)
        record.update(encoding=ENCODING, dim=self.dim, model=self.model, tokens=tokens, truncated=truncated)
        if self._extra:
            record.update(self._extra)
        return record

    def value(self, qid: str, row: SparseRow, tokens: int, truncated: bool) -> bytes:
        record = self.record(qid, row, tokens, truncated)
        if self.fields:
            record = apply_output_fields(record, self.fields)
        return orjson.dumps(record, option=orjson.OPT_SERIALIZE_NUMPY)

    def values(self, qids: Sequence[str], rows: SparseRows, tokens: Sequence[int],
               truncated: Sequence[bool]) -> list[bytes]:
        """The values of a batch, byte for byte what `value` writes for each row."""
        if self.fields or not len(qids):
            return values_one_by_one(self, qids, rows, tokens, truncated)  # type: ignore[arg-type]
        split = rows.offsets[1:-1]
        indices = _json_lists(np.split(np.ascontiguousarray(rows.indices), split))
        weights = _json_lists(np.split(np.ascontiguousarray(rows.values), split))
        if self.vocabulary is not None:
            vocabulary = self.vocabulary
            terms = [b',"terms":' + orjson.dumps([vocabulary[i] for i in rows.indices[lo:hi].tolist()])
                     for lo, hi in zip(rows.offsets[:-1], rows.offsets[1:])]
        else:
            terms = [b""] * len(qids)
        fixed, tail = self._fixed
        dumps = orjson.dumps
        return [b"".join((b'{"id":', dumps(q), b',"embedding":{"indices":[', i, b'],"values":[', v, b"]}", t, fixed,
                          b"%d" % n, b',"truncated":true' if cut else b',"truncated":false', tail))
                for q, i, v, t, n, cut in zip(qids, indices, weights, terms, tokens, truncated)]

    def sample(self) -> SparseRow:
        """A row to encode at start (the registry formats' check)."""
        return SparseRow(np.asarray([0], dtype=np.int32), np.asarray([1.0], dtype=np.float32))


def decode_sparse(record: dict[str, object]) -> SparseRow:
    """A consumer's view of a sparse output record (JSON, or a registry format's decoded dict)."""
    embedding = record["embedding"]
    assert isinstance(embedding, dict)
    return SparseRow(np.asarray(embedding["indices"], dtype=np.int32), np.asarray(embedding["values"], dtype=np.float32))
