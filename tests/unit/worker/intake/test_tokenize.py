"""The tokenizer wrapper: reference tokenisation, truncation only at 256, untruncated lengths."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tokenizers import Tokenizer

from worker.core.model import ModelError, default_model_dir
from worker.intake.tokenize import KeywordTokenizer
from tests.conftest import DATA

GOLDEN = DATA / "golden"
CLS, SEP = 101, 102


@pytest.fixture(scope="module")
def tok() -> KeywordTokenizer:
    return KeywordTokenizer.from_model_dir(default_model_dir())


@pytest.fixture(scope="module")
def raw() -> Tokenizer:
    """The packaged tokenizer with truncation and padding off: the untruncated reference."""
    t = Tokenizer.from_file(str(default_model_dir() / "tokenizer.json"))
    t.no_truncation()
    t.no_padding()
    return t


def test_max_len_is_the_models_256(tok: KeywordTokenizer) -> None:
    # tokenizer.json itself says 128 (and pads to 128): the wrapper must not keep either.
    assert tok.max_len == 256


def test_golden_token_counts(tok: KeywordTokenizer) -> None:
    rows = [json.loads(line) for line in (GOLDEN / "dev.jsonl").read_text(encoding="utf-8").splitlines()]
    encoded = tok.encode([r["text"] for r in rows])
    assert [e.length for e in encoded] == [r["tokens"] for r in rows]
    assert [r["id"] for r, e in zip(rows, encoded, strict=True) if e.truncated] == ["edge:300-words"]
    for e in encoded:
        assert e.ids.dtype == np.int64
        assert len(e.ids) == min(e.length, 256)
        assert e.ids[0] == CLS and e.ids[-1] == SEP


def test_no_fixed_padding(tok: KeywordTokenizer) -> None:
    (e,) = tok.encode(["a"])
    assert e.ids.tolist() == [CLS, 1037, SEP] and e.length == 3 and not e.truncated


def test_truncation_keeps_first_tokens_and_sep(tok: KeywordTokenizer, raw: Tokenizer) -> None:
    text = " ".join(["a"] * 300)
    (e,) = tok.encode([text])
    full = raw.encode(text).ids
    assert len(full) == 302
    assert e.length == 302 and e.truncated
    # What sentence-transformers feeds the model: [CLS] + the first 254 word tokens + [SEP].
    assert e.ids.tolist() == full[:255] + [SEP]


@pytest.mark.parametrize(("words", "truncated"), [(254, False), (255, True), (2000, True)])
def test_truncation_boundary_and_untruncated_length(tok: KeywordTokenizer, raw: Tokenizer,
                                                    words: int, truncated: bool) -> None:
    text = " ".join(["hello"] * words)  # one token per word
    (e,) = tok.encode([text])
    assert e.length == len(raw.encode(text).ids) == words + 2
    assert e.truncated is truncated
    assert len(e.ids) == min(words + 2, 256)


def test_multi_token_words_and_long_sentence(tok: KeywordTokenizer, raw: Tokenizer) -> None:
    texts = ["İstanbul", "naïve résumé", "😀 emoji query 🚀", "北京烤鸭 做法 " * 60]
    for text, e in zip(texts, tok.encode(texts), strict=True):
        full = raw.encode(text).ids
        assert e.length == len(full)
        assert e.ids.tolist() == (full if len(full) <= 256 else full[:255] + [SEP])


def test_custom_max_len(raw: Tokenizer) -> None:
    short = KeywordTokenizer.from_model_dir(default_model_dir(), max_len=8)
    (e,) = short.encode(["one two three four five six seven eight"])
    assert short.max_len == 8 and len(e.ids) == 8 and e.length == 10 and e.truncated
    with pytest.raises(ModelError, match="max_len 600 must be in"):
        KeywordTokenizer.from_model_dir(default_model_dir(), max_len=600)
    with pytest.raises(ModelError, match="max_len 2 must be in"):
        KeywordTokenizer.from_model_dir(default_model_dir(), max_len=2)


def test_empty_batch_and_empty_text(tok: KeywordTokenizer) -> None:
    assert tok.encode([]) == []
    (e,) = tok.encode([""])
    assert e.ids.tolist() == [CLS, SEP] and e.length == 2
