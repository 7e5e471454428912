"""Prompts, truncate_dim and the int8 / binary output encodings (worker.core.vectors, the codec, the Embedder)."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import numpy as np
import orjson
import pytest

from worker.core.model import ModelError, ModelInfo, Prompt, default_model_dir
from worker.core.vectors import (VectorError, default_int8_range, dequantize_int8, pack_binary, quantize_int8,
                              truncate, unpack_binary)
from tests.unit.worker.formats.test_messages import schema
from worker.formats.codec_choice import output_codec
from worker.embedding_cache import key
from worker.settings.schema import Settings
from worker.formats.messages import (H_INT8_RANGE, H_PROMPT, H_PROMPT_NAME, OutputCodec, decode_embedding,
                                     encode_embedding)
from worker.intake.tokenize import KeywordTokenizer


def _unit_rows(n: int, dim: int, seed: int = 0) -> np.ndarray:
    rows = np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


@pytest.fixture()
def e5_like(tmp_path: Path) -> Path:
    """The default model's folder plus an e5-style config_sentence_transformers.json."""
    folder = tmp_path / "model"
    folder.mkdir()
    for item in default_model_dir().iterdir():
        if item.name != "config_sentence_transformers.json":  # written below: never through a link
            os.symlink(item, folder / item.name)
    (folder / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": {"query": "query: ", "passage": "passage: "}, "default_prompt_name": "query"}))
    return folder


# ------------------------------------------------------------------ truncate_dim


def test_truncate_keeps_the_first_dimensions_and_renormalises() -> None:
    rows = _unit_rows(5, 384)
    short = truncate(rows, 256)
    assert short.shape == (5, 256) and short.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(short, axis=1), 1.0, atol=1e-6)
    # Same direction as the head of the full vector.
    cos = np.sum(short * rows[:, :256], axis=1) / np.linalg.norm(rows[:, :256], axis=1)
    np.testing.assert_allclose(cos, 1.0, atol=1e-6)
    assert truncate(rows, 0) is rows and truncate(rows, 384) is rows


def test_truncate_above_the_model_width_is_refused() -> None:
    with pytest.raises(VectorError, match="above the model's 384"):
        truncate(_unit_rows(1, 384), 385)
    with pytest.raises(ModelError, match="setting 'truncate_dim' 512 is above the model's 384 dimensions"):
        output_codec(Settings(truncate_dim=512), ModelInfo.from_dir(default_model_dir()), Prompt())


# ------------------------------------------------------------------ int8


def test_int8_round_trip_is_within_half_a_step_and_clips_outside_the_range() -> None:
    rows = _unit_rows(50, 384)
    r = default_int8_range(384)
    assert np.abs(rows).max() < r  # the default range holds random unit vectors of this width
    q = quantize_int8(rows, -r, r)
    assert q.dtype == np.int8
    back = dequantize_int8(q, -r, r)
    step = 2 * r / 255
    assert np.abs(back - rows).max() <= step / 2 + 1e-7
    cos = np.sum(back * rows, axis=1) / np.linalg.norm(back, axis=1)
    assert cos.min() > 0.999
    assert quantize_int8(np.array([5.0, -5.0, -r, r]), -r, r).tolist() == [127, -128, -128, 127]


def test_int8_range_must_be_a_range() -> None:
    with pytest.raises(VectorError, match="lo < hi"):
        quantize_int8(np.zeros(3), 0.5, 0.5)


# ------------------------------------------------------------------ binary


def test_binary_packs_sign_bits_first_dimension_high_like_sentence_transformers_ubinary() -> None:
    vec = np.array([0.5, -0.1, 0.2, -0.3, 0.0, -0.1, -0.2, -0.4, 0.9], dtype=np.float32)
    packed = pack_binary(vec)
    # 1 0 1 0 0 0 0 0 | 1 (pad 0000000): zero is not positive.
    assert packed.tolist() == [0b10100000, 0b10000000]
    assert unpack_binary(packed, 9).tolist() == [1, 0, 1, 0, 0, 0, 0, 0, 1]


def test_binary_is_over_30x_smaller_than_the_float_list_in_the_embedding_value() -> None:
    rows = _unit_rows(20, 384)
    sizes = {}
    for encoding in ("float-list", "binary", "int8"):
        codec = output_codec(Settings(output_encoding=encoding), ModelInfo.from_dir(default_model_dir()), Prompt())
        values = [orjson.loads(codec.value("q-000001", row, tokens=5, truncated=False)) for row in rows]
        sizes[encoding] = (np.mean([len(orjson.dumps(v["embedding"], option=orjson.OPT_SERIALIZE_NUMPY))
                                    for v in values]),
                           np.mean([len(codec.value("q-000001", row, 5, False)) for row in rows]))
    float_field, float_record = sizes["float-list"]
    binary_field, binary_record = sizes["binary"]
    assert binary_field == len('""') + 64  # 48 bytes of bits in base64
    assert float_field / binary_field >= 30, sizes
    assert float_record / binary_record >= 20, sizes  # the record's other fields are shared


# ------------------------------------------------------------------ the codec


@pytest.mark.parametrize("encoding", ["int8", "binary"])
def test_codec_records_validate_and_read_back(encoding: str) -> None:
    info = ModelInfo.from_dir(default_model_dir())
    codec = output_codec(Settings(output_encoding=encoding, truncate_dim=256), info, Prompt("query: ", "query"))
    row = _unit_rows(1, 384)[0]
    obj = orjson.loads(codec.value("q-1", row, tokens=7, truncated=False))
    schema("output").validate(obj)
    assert obj["dim"] == 256 and obj["encoding"] == encoding and obj["prompt_name"] == "query"
    headers = dict(codec.headers)
    assert headers[H_PROMPT] == b"query: " and headers[H_PROMPT_NAME] == b"query"
    short = truncate(row, 256)
    if encoding == "int8":
        lo, hi = (float(x) for x in headers[H_INT8_RANGE].decode().split(","))
        assert obj["int8_range"] == [lo, hi] == [-default_int8_range(256), default_int8_range(256)]
        back = decode_embedding(obj["embedding"], "int8", int8_range=(lo, hi))
        assert np.abs(back - short).max() <= (hi - lo) / 255 / 2 + 1e-7
    else:
        assert H_INT8_RANGE not in headers and "int8_range" not in obj
        bits = decode_embedding(obj["embedding"], "binary", dim=256)
        assert bits.tolist() == (short > 0).astype(np.uint8).tolist()


def test_default_record_has_only_the_fingerprint_besides_the_original_fields_and_headers() -> None:
    codec = output_codec(Settings(), ModelInfo.from_dir(default_model_dir()), Prompt())
    obj = orjson.loads(codec.value("q", _unit_rows(1, 384)[0], 3, False))
    assert set(obj) == {"id", "embedding", "encoding", "dim", "model", "tokens", "truncated", "fingerprint"}
    assert [name for name, _ in codec.headers] == ["kwe-model", "kwe-encoding", "kwe-dim", "kwe-fingerprint"]


def test_int8_needs_its_range() -> None:
    with pytest.raises(ValueError, match="int8_range"):
        OutputCodec(model="m", dim=3, encoding="int8")
    with pytest.raises(ValueError, match="calibration range"):
        encode_embedding(np.zeros(3, np.float32), "int8")


def test_a_literal_prompt_is_recorded_with_a_null_name() -> None:
    codec = output_codec(Settings(prompt="Represent this query: "), ModelInfo.from_dir(default_model_dir()),
                         Prompt("Represent this query: "))
    obj = orjson.loads(codec.value("q", _unit_rows(1, 384)[0], 3, False))
    assert obj["prompt_name"] is None
    assert dict(codec.headers)[H_PROMPT] == "Represent this query: ".encode()
    assert H_PROMPT_NAME not in dict(codec.headers)
    assert base64  # (imported for readers of the encodings below)


# ------------------------------------------------------------------ prompts


def test_prompts_are_read_from_config_sentence_transformers(e5_like: Path) -> None:
    info = ModelInfo.from_dir(e5_like)
    assert info.default_prompt_name == "query" and info.prompt("passage") == "passage: "
    assert Prompt.resolve(info) == Prompt("query: ", "query")  # the default prompt name
    assert Prompt.resolve(info, prompt_name="passage") == Prompt("passage: ", "passage")
    assert Prompt.resolve(info, prompt_name="none") == Prompt()
    assert Prompt.resolve(info, prompt="q: ") == Prompt("q: ", None)
    with pytest.raises(ModelError, match="no prompt named 'doc'.*'query', 'passage'"):
        Prompt.resolve(info, prompt_name="doc")
    with pytest.raises(ModelError, match="both a prompt"):
        Prompt.resolve(info, prompt="q: ", prompt_name="passage")
    assert Prompt.resolve(ModelInfo.from_dir(default_model_dir())) == Prompt()  # no prompts: none


def test_a_bad_default_prompt_name_is_refused(e5_like: Path) -> None:
    (e5_like / "config_sentence_transformers.json").write_text(json.dumps({"prompts": {"query": "q: "},
                                                                           "default_prompt_name": "doc"}))
    with pytest.raises(ModelError, match="default_prompt_name 'doc' is not one of its prompts"):
        ModelInfo.from_dir(e5_like)


def test_the_prompt_is_tokenized_before_the_text_and_keys_the_cache(e5_like: Path) -> None:
    info = ModelInfo.from_dir(e5_like)
    plain = KeywordTokenizer.from_model(info, prompt=Prompt())
    prompted = KeywordTokenizer.from_model(info, prompt=Prompt.resolve(info))
    [with_prompt] = prompted.encode(["running shoes"])
    [spelled_out] = plain.encode(["query: running shoes"])
    [bare] = plain.encode(["running shoes"])
    assert with_prompt.ids.tolist() == spelled_out.ids.tolist()
    assert key(with_prompt.ids) != key(bare.ids)
    # "query: " is 3 tokens ([CLS] query : [SEP] = 4 with the specials): an encoding of no more has no text.
    assert prompted.special_tokens == 4 and plain.special_tokens == 2


def test_embedder_prompt_truncate_dim_and_quantize(e5_like: Path) -> None:
    from worker.embedder import Embedder

    texts = ["running shoes", "東京 ラーメン", "how to fix a flat bicycle tyre"]
    with Embedder(e5_like, cache_bytes=0, prompt_name="none") as plain:
        full = plain.embed(["query: " + t for t in texts])
    with Embedder(e5_like, cache_bytes=0) as e5:  # default_prompt_name: query
        assert e5.prompt == Prompt("query: ", "query")
        np.testing.assert_allclose(e5.embed(texts), full, atol=1e-6)
    with Embedder(e5_like, prompt="query: ", truncate_dim=128) as short:
        got = short.embed(texts)
        assert got.shape == (3, 128) and short.dim == 128
        np.testing.assert_allclose(got, truncate(full, 128), atol=1e-6)
        assert short.quantize(got, "binary").shape == (3, 16)
        assert short.quantize(got, "int8").dtype == np.int8
    with pytest.raises(VectorError, match="above the model's 384"):
        Embedder(e5_like, truncate_dim=400)
