"""The WordPiece fast path (worker/intake/wordpiece.py) gives exactly the full tokenizer's IDs, or
declines: on every real query shipped with the tests, on random ASCII text (controls, punctuation,
long words, truncation), and for each family's tokenizer; its compiled loop (_wordpiece.c) gives
exactly what its Python loop does."""

from __future__ import annotations

import json
import os
import random
import string
from pathlib import Path

import numpy as np
import pytest
from tokenizers import AddedToken, Tokenizer

from worker.core.model import default_model_dir
from worker.intake.tokenize import KeywordTokenizer
from worker.intake import wordpiece
from worker.intake.wordpiece import FastWordPiece
from tests.conftest import DATA, ROOT



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


def test_the_compiled_loop_is_built() -> None:
    # setup.py builds it where a C compiler is found and goes on without one; this says so rather
    # than letting every test below run the Python loop twice.
    if not wordpiece.COMPILED:
        reason = os.environ.get("KWE_COMPILED_UNAVAILABLE")
        if reason:
            pytest.skip(reason)
        pytest.fail("worker/intake/_wordpiece.c was not built (no C compiler at install?); "
                    "set KWE_COMPILED_UNAVAILABLE to say why when that is expected")
    fast = FastWordPiece.of(Tokenizer.from_file(str(default_model_dir() / "tokenizer.json")))
    assert fast is not None and fast.compiled


def _both(path: Path, max_len: int, limit: int) -> tuple[FastWordPiece, FastWordPiece]:
    if not wordpiece.COMPILED:
        pytest.skip("the compiled loop is not built (test_the_compiled_loop_is_built says why)")
    compiled = FastWordPiece.of(_reference(path, max_len), limit=limit)
    python = FastWordPiece.of(_reference(path, max_len), limit=limit, compiled=False)
    assert compiled is not None and python is not None and compiled.compiled and not python.compiled
    return compiled, python


@pytest.mark.parametrize(("max_len", "limit", "chunk"), [(256, 100_000, 500), (8, 100_000, 500), (12, 50, 97)])
def test_the_compiled_loop_gives_what_the_python_loop_does(minilm: Path, max_len: int, limit: int,
                                                           chunk: int) -> None:
    """Every real query and random ASCII (control characters, added tokens, words longer than the
    cut), in polls of `chunk`; a cache of 50 words is cleared many times inside one call."""
    compiled, python = _both(minilm, max_len, limit)
    texts = _real_queries() + _random_ascii(random.Random(3), 3000) + list(string.printable) + ["", " ", "\x00"]
    for at in range(0, len(texts), chunk):
        poll = texts[at:at + chunk]
        views, counts = compiled.encode_many(poll, max_len)
        want_views, want_counts = python.encode_many(poll, max_len)
        assert counts == want_counts, poll
        for text, got, want in zip(poll, views, want_views, strict=True):
            if want is None:
                assert got is None, repr(text)
            else:
                assert got is not None and got.dtype == np.int64 and got.tolist() == want.tolist(), repr(text)
    assert (compiled.cache.hits, compiled.cache.misses) == (python.cache.hits, python.cache.misses)


def _outcome(fast: FastWordPiece, texts: object, max_len: int) -> tuple[object, ...]:
    """What encode_many gave: its IDs, counts and the cache's counts, or the exception it raised."""
    try:
        views, counts = fast.encode_many(texts, max_len)  # type: ignore[arg-type]
    except Exception as exc:  # noqa: BLE001 - what is raised is the outcome compared
        return "raised", type(exc), str(exc)
    return ("returned", [None if v is None else (v.dtype.name, v.tolist()) for v in views], counts,
            fast.cache.hits, fast.cache.misses)


class _Failing:
    def tokenize(self, word: str) -> list[object]:
        raise RuntimeError(f"cannot split {word!r}")


@pytest.mark.parametrize(("texts", "max_len"), [
    ([], 256), (["cheap flights"], 256), (["cheap flights", "café", "[MASK] x", "x " * 40, ""], 8),
    (["cheap flights"], 3), (["cheap flights"], 2), (("cheap flights",), 256), (["cheap", None], 256),
    (["cheap", b"flights"], 256), (["cheap", 5], 256), (["x\x00y\tz"] * 3, 256),
])
def test_both_loops_return_and_raise_alike(minilm: Path, texts: object, max_len: int) -> None:
    compiled, python = _both(minilm, 256, 100)
    assert _outcome(compiled, texts, max_len) == _outcome(python, texts, max_len)


def test_a_word_the_model_fails_on_fails_both_loops_with_its_error(minilm: Path) -> None:
    for fast in _both(minilm, 256, 100):
        fast.cache.lookup = _Failing()
        fast.cache.words["cheap"] = (1, 2)
        assert fast.encode_many(["cheap"], 256)[0][0].tolist() == [101, 1, 2, 102]
        with pytest.raises(RuntimeError, match="cannot split 'flights'"):
            fast.encode_many(["cheap flights"], 256)


def test_a_miss_that_adds_texts_takes_only_those_of_the_call_in_both_loops(minilm: Path) -> None:
    outcomes = []
    for fast in _both(minilm, 256, 100):
        texts = ["cheap flights", "new york"]
        model = fast.cache.lookup

        class Growing:
            def tokenize(self, word: str) -> list[object]:
                texts.extend(["hotels " * 50] * 200)  # more than the call's buffer has room for
                return model.tokenize(word)

        fast.cache.lookup = Growing()
        outcomes.append(_outcome(fast, texts, 256))
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][0] == "returned" and len(outcomes[0][2]) == 2  # type: ignore[arg-type]


def test_a_non_ascii_added_token_keeps_the_python_loop() -> None:
    # "\u212a" (the Kelvin sign) matches "k" ignoring case: only the regular expression knows.
    fast = FastWordPiece(object(), 101, 102, ("[MASK]", "\u212aelvin"))
    assert not fast.compiled


def test_the_keyword_tokenizer_says_which_path_it_takes(minilm: Path) -> None:
    assert KeywordTokenizer(Tokenizer.from_file(str(minilm)), 256).fast_path == (
        "compiled" if wordpiece.COMPILED else "python")
    assert KeywordTokenizer(Tokenizer.from_file(str(minilm)), 256, fast=False).fast_path == "none"
    roberta = DATA / "families" / "roberta" / "tokenizer.json"
    assert KeywordTokenizer(Tokenizer.from_file(str(roberta)), 64).fast_path == "none"


# Added tokens as tokenizers matches them: "normalized": false in the raw text, true in the
# normalised text (special or not; transformers' add_tokens gives true).
_ADDED_TEXTS = ["E-\x01MAIL me", "e-mail me", "E-MAIL me", "send e-mails", "xe-mail", "e - mail", "E\x00-MAIL",
                "e-\tmail", "cheap flights", "", "[MASK] e-mail", "re-mail-e-mail"]


@pytest.mark.parametrize("special", [False, True])
@pytest.mark.parametrize("options", [{"normalized": True}, {"normalized": False},
                                     {"normalized": False, "single_word": True},
                                     {"normalized": False, "lstrip": True, "rstrip": True},
                                     {"normalized": True, "single_word": True}])
def test_an_added_token_gives_the_tokenizers_ids_whichever_way_it_is_matched(
        minilm: Path, special: bool, options: dict[str, bool]) -> None:
    def with_token() -> Tokenizer:
        tok = _reference(minilm, 256)
        token = AddedToken("e-mail", **options)
        (tok.add_special_tokens if special else tok.add_tokens)([token])
        return tok

    ref = with_token()
    texts = _ADDED_TEXTS + _random_ascii(random.Random(17), 300)
    keyword = KeywordTokenizer(with_token(), 256)
    for text, enc in zip(texts, keyword.encode(texts), strict=True):
        assert (enc.ids.tolist(), enc.length) == _expected(ref, text), repr(text)
    if options["normalized"]:
        assert keyword.encode(["E-\x01MAIL me"])[0].ids.tolist() == [101, 30522, 2033, 102]
    fast = FastWordPiece.of(with_token())
    # Matched in the normalised text: the fast path, which looks in the raw text, declines the tokenizer.
    assert (fast is None) == options["normalized"]
    for text in texts:
        got = fast.encode(text, 256) if fast is not None else None
        if got is not None:
            assert got == _expected(ref, text), repr(text)


def test_a_tokenizer_file_with_a_normalized_added_token_is_declined(minilm: Path, tmp_path: Path) -> None:
    spec = json.loads(minilm.read_text(encoding="utf-8"))
    assert FastWordPiece.of(Tokenizer.from_str(json.dumps(spec))) is not None
    spec["added_tokens"][-1]["normalized"] = True  # [MASK], matched after lowercasing: "[mask]" is it too
    ref = _reference(minilm, 256)
    ref.add_special_tokens([AddedToken("[MASK]", normalized=True)])
    keyword = KeywordTokenizer(Tokenizer.from_str(json.dumps(spec)), 256)
    for text in ["[MA\x01SK] x", "[Mask] x", "[MASK] x", "mask x"]:
        assert (keyword.encode([text])[0].ids.tolist(), keyword.encode([text])[0].length) == _expected(ref, text)
    assert keyword.encode(["[MA\x01SK] x"])[0].ids.tolist() == [101, 103, 1060, 102]
    assert FastWordPiece.of(Tokenizer.from_str(json.dumps(spec))) is None
    assert keyword.fast_path == "none"


_SHRINK = r"""
import sys
from tokenizers import Tokenizer
from worker.core.model import default_model_dir
from worker.intake.wordpiece import FastWordPiece

form = sys.argv[1]
fast = FastWordPiece.of(Tokenizer.from_file(str(default_model_dir() / "tokenizer.json")), compiled=form == "compiled")
assert fast.compiled == (form == "compiled")
texts = ["".join(("word", str(i), " flights")) for i in range(5000)]  # each held by the list alone
model = fast.cache.lookup

class Shrinking:
    # The model's WordPiece, but its first call empties the poll's list (frees its texts and its items).
    calls = 0
    def tokenize(self, word):
        Shrinking.calls += 1
        if Shrinking.calls == 1:
            texts.clear()
        return model.tokenize(word)

fast.cache.lookup = Shrinking()
views, counts = fast.encode_many(texts, 256)
print([v.tolist() for v in views], counts)
"""


@pytest.mark.parametrize("form", ["compiled", "python"])
def test_a_miss_that_shrinks_the_list_of_texts_ends_the_loop_there(form: str) -> None:
    # The compiled loop read the list's length once and its items borrowed: a callee that emptied
    # it made the loop read freed memory (a segfault, hence a child process).
    if form == "compiled" and not wordpiece.COMPILED:
        pytest.skip("the compiled loop is not built (test_the_compiled_loop_is_built says why)")
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", _SHRINK, form], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    # The text being split is finished (its characters held), then the loop sees the list is empty.
    assert done.stdout.strip() == "[[101, 2773, 2692, 7599, 102]] [5]"
