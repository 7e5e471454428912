"""The WordPiece fast path (worker/intake/wordpiece.py) gives exactly the full tokenizer's IDs, or
declines: on every real query shipped with the tests, on random ASCII text (controls, punctuation,
long words, truncation), and for each family's tokenizer."""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from worker.core.model import default_model_dir
from worker.intake.tokenize import KeywordTokenizer
from worker.intake.wordpiece import FastWordPiece

DATA = Path(__file__).resolve().parent / "data"
ROOT = Path(__file__).resolve().parents[1]


def _reference(path: Path, max_len: int) -> Tokenizer:
    tok = Tokenizer.from_file(str(path))
    tok.no_padding()
    tok.enable_truncation(max_len)
    return tok


def _expected(tok: Tokenizer, text: str) -> tuple[list[int], int]:
    enc = tok.encode(text, add_special_tokens=True)
    special = tok.num_special_tokens_to_add(False)
    return list(enc.ids), len(enc.ids) + sum(len(o.ids) - special for o in enc.overflowing)


def _real_queries() -> list[str]:
    texts = [line.split("\t", 1)[1].rstrip("\r\n") for line in
             (DATA / "queries" / "terabyte05-20k.tsv").read_text(encoding="utf-8").splitlines() if "\t" in line]
    texts += [json.loads(line)["text"] for line in (DATA / "golden" / "dev.jsonl").read_text(encoding="utf-8").splitlines()]
    texts += [line.split("\t", 1)[1] for line in
              (ROOT / "deploy" / "local" / "sample" / "keywords.tsv").read_text(encoding="utf-8").splitlines()
              if "\t" in line]
    return texts


def _random_ascii(rng: random.Random, n: int) -> list[str]:
    alphabet = [chr(c) for c in range(128)]
    words = ["cheap", "flights", "New", "YORK", "un", "##aff", "able", "x" * 120, "123abc", "[MASK]", "[mask]",
             "don't", "e-mail", "C++", "a.b.c", "[CLS]", "[sep]", "[UNK]", "\t", "\x00", "\x7f", "\x0b"]
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(0, 12)):
            if rng.random() < 0.5:
                parts.append(rng.choice(words))
            else:
                parts.append("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12))))
            parts.append(rng.choice([" ", "", "  ", "\n", "-"]))
        out.append("".join(parts))
    return out


@pytest.fixture(scope="module")
def minilm() -> Path:
    return default_model_dir() / "tokenizer.json"


@pytest.mark.parametrize("max_len", [256, 8])
def test_the_fast_path_matches_the_tokenizer_on_every_real_query(minilm: Path, max_len: int) -> None:
    ref = _reference(minilm, max_len)
    fast = FastWordPiece.of(_reference(minilm, max_len))
    assert fast is not None
    texts = _real_queries()
    taken = 0
    for text in texts:
        got = fast.encode(text, max_len)
        if got is None:
            assert not text.isascii() or "[" in text
            continue
        taken += 1
        assert got == _expected(ref, text), text
    assert taken / len(texts) > 0.98, "almost every real query is ASCII: the fast path takes it"
    assert fast.cache.hits > 3 * fast.cache.misses  # 20k distinct queries, cold: 80% of words seen before


@pytest.mark.parametrize("max_len", [256, 12])
def test_the_fast_path_matches_the_tokenizer_on_random_ascii(minilm: Path, max_len: int) -> None:
    ref = _reference(minilm, max_len)
    fast = FastWordPiece.of(_reference(minilm, max_len), limit=50)  # a small cache: cleared often
    declined = 0
    for text in _random_ascii(random.Random(11), 4000) + list(string.printable) + ["", " ", "\x00\x01", "[MASK]"]:
        got = fast.encode(text, max_len)
        if got is None:
            declined += 1
            continue
        assert got == _expected(ref, text), repr(text)
    assert 0 < declined < 2000  # the texts that hold an added token's text, and only those


def test_text_that_is_not_ascii_or_holds_a_special_token_is_declined(minilm: Path) -> None:
    fast = FastWordPiece.of(_reference(minilm, 256))
    assert fast is not None
    for text in ["café", "北京 hotels", "naïve", "what is [MASK]", "x [Sep] y", "\u200b"]:
        assert fast.encode(text, 256) is None


@pytest.mark.parametrize("family", ["bert", "distilbert", "mpnet", "roberta", "xlm-roberta"])
def test_each_family_takes_the_fast_path_only_where_it_is_exact(family: str) -> None:
    path = DATA / "families" / family / "tokenizer.json"
    ref = _reference(path, 64)
    fast = FastWordPiece.of(_reference(path, 64))
    if json.loads(path.read_text())["model"]["type"] != "WordPiece":
        assert fast is None
        return
    assert fast is not None
    for text in _real_queries()[:3000] + _random_ascii(random.Random(5), 500):
        got = fast.encode(text, 64)
        if got is not None:
            assert got == _expected(ref, text), (family, text)


def test_keyword_tokenizer_gives_the_same_encodings_with_and_without_the_fast_path(minilm: Path) -> None:
    texts = _real_queries()[:2000] + ["café au lait", "[MASK] tokens", "x " * 300, ""]
    fast = KeywordTokenizer(Tokenizer.from_file(str(minilm)), 256)
    slow = KeywordTokenizer(Tokenizer.from_file(str(minilm)), 256, fast=False)
    assert fast.word_cache is not None and slow.word_cache is None
    for a, b in zip(fast.encode(texts), slow.encode(texts), strict=True):
        assert np.array_equal(a.ids, b.ids) and a.ids.dtype == b.ids.dtype == np.int64
        assert (a.length, a.truncated) == (b.length, b.truncated)
