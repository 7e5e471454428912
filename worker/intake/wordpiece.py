"""A fast path for BERT's WordPiece tokenizers on ASCII text: the same token IDs as the model's
tokenizer.json, in a fraction of its time.

HF tokenizers spends ~9 us on a 5-token keyword (an Encoding with offsets, token strings, masks,
...), more than everything else the worker does for it. A search keyword is a few common words,
so the work that matters is a dictionary lookup per word: BERT's pipeline on ASCII text is

    clean (drop NUL and control characters; tab, newline, return become spaces) -> lowercase
    -> split at whitespace, each punctuation character a word of its own (every printable ASCII
    character that is not a letter or a digit is punctuation to BERT) -> WordPiece per word
    -> [CLS] words [SEP], cut at max_len

and WordPiece of a word never depends on its neighbours, so each word's IDs are asked of the
model's own WordPiece once and kept (`WordCache`). Everything else goes to the full tokenizer: a
text that is not ASCII (accents, CJK, other scripts), or that holds an added token's text
(`[MASK]`, ...: matched before normalisation), or a tokenizer whose pipeline is not exactly this
one (`FastWordPiece.of` returns None: RoBERTa, XLM-R, any other normaliser or template, or an
added token matched after normalisation, `"normalized": true`, as transformers' add_tokens makes).
tests/unit/worker/intake/test_wordpiece.py holds the fast path against the full tokenizer on every real query
shipped with the tests and on random ASCII text.

The loop over a poll's texts is compiled where the build found a C compiler
(worker/intake/_wordpiece.c, `encode_many`): the same steps on the same cache, a fraction of a
microsecond a keyword where the interpreter spends about three. Without it the same path runs here
in Python (`COMPILED` says which; the worker logs it at start).

Threads: the poll thread only (the cache is not locked).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

try:
    from worker.intake import _wordpiece
except ImportError:  # built without a C compiler: the Python loop below does the same
    _wordpiece = None  # type: ignore[assignment]

# Whether the compiled loop is there (setup.py builds it where a C compiler is found).
COMPILED = _wordpiece is not None
# ASCII control characters BERT's clean_text drops (category Cc, except tab, newline and return,
# which are whitespace): NUL..0x08, 0x0B, 0x0C, 0x0E..0x1F, DEL.
_DROP = {c: None for c in [*range(0x00, 0x09), 0x0B, 0x0C, *range(0x0E, 0x20), 0x7F]}
_SPACES = {0x09: 0x20, 0x0A: 0x20, 0x0D: 0x20}
_CLEAN = str.maketrans({**_DROP, **_SPACES})
# After cleaning and lowercasing: runs of letters and digits, and single punctuation characters.
_WORDS = re.compile(r"[a-z0-9]+|[!-/:-@\[-`{-~]")
# Words kept before the cache starts over (a few MB; a keyword stream's vocabulary is mostly
# common words, so a restart costs a burst of lookups, not a cliff).
DEFAULT_WORDS = 100_000


@dataclass
class WordCache:
    """word -> its WordPiece IDs, bounded: cleared when full."""

    lookup: Any  # the model's WordPiece: tokenize(word) -> tokens with .id
    limit: int = DEFAULT_WORDS
    words: dict[str, tuple[int, ...]] = field(default_factory=dict)
    hits: int = 0
    misses: int = 0

    def ids(self, word: str) -> tuple[int, ...]:
        found = self.words.get(word)
        if found is not None:
            self.hits += 1
            return found
        return self.miss(word)

    def miss(self, word: str) -> tuple[int, ...]:
        """A word not in the cache: asked of the model's WordPiece, counted, kept."""
        self.misses += 1
        if len(self.words) >= self.limit:
            self.words.clear()
        ids = tuple(t.id for t in self.lookup.tokenize(word))
        self.words[word] = ids
        return ids


class FastWordPiece:
    def __init__(self, model: Any, first: int, last: int, added: tuple[str, ...], *,
                 limit: int = DEFAULT_WORDS, compiled: bool = True) -> None:
        self._cache = WordCache(model, limit)
        self._first, self._last = first, last
        # Any added token's text, in any case (one normalised before matching would match the
        # lowercased text): such a text takes the full tokenizer, which splits the token out.
        self._added = re.compile("|".join(map(re.escape, added)), re.IGNORECASE) if added else None
        # The compiled loop compares added tokens lowercased, exact only for ASCII ones (a text it
        # takes is ASCII, but a non-ASCII token could still match it ignoring case: the Kelvin sign).
        self._added_ascii = tuple(a.lower().encode("ascii") for a in added) if all(map(str.isascii, added)) else None
        self.compiled = compiled and _wordpiece is not None and self._added_ascii is not None

    @classmethod
    def of(cls, tokenizer: Any, *, limit: int = DEFAULT_WORDS, compiled: bool = True) -> FastWordPiece | None:
        """The fast path for this tokenizer (a `tokenizers.Tokenizer`), or None when its pipeline is
        not exactly BERT's uncased WordPiece with one special token on each side, or it has an added
        token matched in the normalised text."""
        try:
            spec = json.loads(tokenizer.to_str())
        except Exception:  # noqa: BLE001 - anything unreadable runs on the full tokenizer
            return None
        norm, pre, model, post = (spec.get(k) or {} for k in ("normalizer", "pre_tokenizer", "model", "post_processor"))
        if not (norm.get("type") == "BertNormalizer" and norm.get("clean_text") is True
                and norm.get("lowercase") is True and norm.get("strip_accents") in (None, True)
                and norm.get("handle_chinese_chars") is True):
            return None
        if pre.get("type") != "BertPreTokenizer" or model.get("type") != "WordPiece":
            return None
        ends = _special_ends(post)
        if ends is None:
            return None
        tokens = spec.get("added_tokens") or []
        # An added token with "normalized": true (what transformers' add_tokens gives, special or
        # not) is matched in the normalised text: "E-\x01MAIL" holds "e-mail" only once the control
        # character is dropped and the case folded. The fast path looks for added tokens in the raw
        # text, which is exact only for tokens matched there ("normalized": false, as BERT's
        # [CLS], [SEP], [MASK], ... are), so such a tokenizer takes the full tokenizer throughout.
        if any(t.get("normalized") is not False for t in tokens):
            return None
        added = tuple(str(t["content"]) for t in tokens)
        return cls(tokenizer.model, ends[0], ends[1], added, limit=limit, compiled=compiled)

    @property
    def cache(self) -> WordCache:
        return self._cache

    def encode(self, text: str, max_len: int) -> tuple[list[int], int] | None:
        """(IDs cut at max_len, the token count before the cut), both with the special tokens; None
        for a text this path does not take (the caller runs the full tokenizer on it)."""
        if not text.isascii() or (self._added is not None and self._added.search(text)):
            return None
        ids = [self._first]
        words = self._cache.ids
        for word in _WORDS.findall(text.translate(_CLEAN).lower()):
            ids += words(word)
        n = len(ids) + 1
        if n > max_len:
            del ids[max_len - 1:]
        ids.append(self._last)
        return ids, n

    def encode_many(self, texts: list[str], max_len: int) -> tuple[list[np.ndarray | None], list[int | None]]:
        """`encode` of each text at once: (its IDs cut at max_len, as an int64 array, or None for a
        text this path does not take; its token count before the cut, or None). The arrays are views
        of one buffer for the whole call. The texts taken are those in the list at the call, as long
        as they stay in it (a miss runs the model's Python, which could change it); both loops raise
        alike: TypeError for texts that are not a list of str, ValueError for max_len under 3."""
        if not isinstance(texts, list):
            raise TypeError("texts must be a list")
        if not self.compiled:
            if max_len < 3:
                raise ValueError("max_len must be at least 3")
            if not all(isinstance(text, str) for text in texts):
                raise TypeError("texts must be str")  # before any text is split, as the compiled loop
            views: list[np.ndarray | None] = []
            counts: list[int | None] = []
            for i in range(len(texts)):
                if i >= len(texts):
                    break
                text = texts[i]
                if not isinstance(text, str):
                    raise TypeError("texts must be str")
                got = self.encode(text, max_len)
                views.append(None if got is None else np.array(got[0], dtype=np.int64))
                counts.append(None if got is None else got[1])
            return views, counts
        assert self._added_ascii is not None
        # A word of k characters has at most k pieces, so a text has at most len + 2 IDs.
        try:
            room = sum(map(len, texts)) + 2 * len(texts)
        except TypeError:
            raise TypeError("texts must be str") from None
        flat = np.empty(room, dtype=np.int64)
        cache = self._cache
        views, counts, hits = _wordpiece.encode(texts, flat, cache.words, cache.miss, self._first, self._last,
                                                max_len, self._added_ascii)
        cache.hits += hits
        return views, counts


def _special_ends(post: dict[str, Any]) -> tuple[int, int] | None:
    """The IDs put before and after a single sequence ([CLS], [SEP]), if that is all the template does."""
    kind = post.get("type")
    if kind == "BertProcessing":
        return int(post["cls"][1]), int(post["sep"][1])
    if kind != "TemplateProcessing":
        return None
    single = post.get("single") or []
    if len(single) != 3 or "Sequence" not in single[1]:
        return None
    try:
        first, last = (post["special_tokens"][single[i]["SpecialToken"]["id"]]["ids"] for i in (0, 2))
    except (KeyError, TypeError):
        return None
    return (int(first[0]), int(last[0])) if len(first) == 1 and len(last) == 1 else None
