"""Tokenisation as the reference does it: [CLS] prompt text [SEP], cut at max_seq_length, no padding.

A prompt (worker.core.model.Prompt: "query: " for e5, an instruction for bge) is put before
each text before tokenisation, as sentence-transformers does, so it counts towards
max_seq_length and is part of the token IDs, hence of the embedding cache's key.

The packaged tokenizer.json switches on truncation at 128 and fixed padding to 128. Used as it
stands, every keyword would cost 128 positions and long ones would be cut below the reference's
256, so both are replaced here. Padding is done later, per batch, by worker.batching.padding.pad_batch.

A static model (worker/core/static.py) is tokenised as its library does it (StaticTokenizer): no
special tokens, model2vec's character cut, the token cut; model2vec's unknown token is dropped in the
table (a zero row the mean does not count), so the IDs here are the tokenizer's own. Its fast path is
the WordPiece one every BERT tokenizer takes (worker/intake/wordpiece.py), with its [CLS] and [SEP]
sliced off: a BERT post-processor only adds them, so the IDs between are those of
add_special_tokens=False. Everything else runs the tokenizer without special tokens. It lives here,
beside the KeywordTokenizer it extends, because KeywordTokenizer.from_model picks it for a static model.

Threads: the poll thread only.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
from tokenizers import Tokenizer

from worker.core.model import ModelError, ModelInfo, Prompt
from worker.core.static import StaticSpec
from worker.intake.wordpiece import FastWordPiece, WordCache


class Encoded(NamedTuple):
    """One text's encoding. A named tuple, not a dataclass: `encode` makes one per keyword with
    tuple.__new__, a C call, where a dataclass's __init__ ran a Python frame per keyword."""

    # Token ids with special tokens, already cut at max_len: what the model sees.
    ids: np.ndarray
    # Token count with special tokens *before* truncation (for metrics and bucketing decisions).
    length: int
    truncated: bool


_new_encoded = tuple.__new__


class KeywordTokenizer:
    def __init__(self, tokenizer: Tokenizer, max_len: int, *, source: str = "<tokenizer>",
                 prompt: Prompt | None = None, fast: bool = True) -> None:
        if max_len < 3:
            raise ValueError(f"{source}: max_len {max_len} cannot hold [CLS] x [SEP]")
        # A poll's texts are encoded in one call (encode_batch_fast), which releases the GIL for the
        # whole batch. With the library's parallelism on, that call wakes Rayon's pool, whose
        # threads spin between calls and took a core from the model under a trickle (issue 19,
        # ~5 ms per call of 1-3 keywords, benchmarks/results/latency/latency_diagnosis.md); off, it
        # runs on the calling thread. The library reads
        # this variable at each call and has no per-call argument; a value the user set is kept.
        # Parallelism comes from worker processes instead (`processes`).
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        tokenizer.no_padding()
        tokenizer.enable_truncation(max_len)
        self._tokenizer = tokenizer
        self._max_len = max_len
        self._fast = FastWordPiece.of(tokenizer) if fast else None
        # Each overflow piece repeats the special tokens; subtracting them gives the full length.
        self._n_special = tokenizer.num_special_tokens_to_add(False)
        self.prompt = prompt or Prompt()
        # What every encoding holds besides the text: the special tokens and the prompt's own.
        prompt_ids = tokenizer.encode(self.prompt.text, add_special_tokens=True).ids if self.prompt.text else []
        self._n_fixed = len(prompt_ids) if self.prompt.text else self._n_special
        # sentence-transformers' prompt_length: the prompt tokenized alone, less its trailing
        # special token ([SEP], </s>) when it has one; a pooling with include_prompt false
        # leaves these first positions out.
        special = {i for i, tok in tokenizer.get_added_tokens_decoder().items() if tok.special}
        self._prompt_tokens = len(prompt_ids) - (1 if prompt_ids and prompt_ids[-1] in special else 0)

    @classmethod
    def from_model_dir(cls, path: str | Path, max_len: int | None = None, *,
                       prompt: Prompt | None = None) -> KeywordTokenizer:
        return cls.from_model(ModelInfo.from_dir(path), max_len, prompt=prompt)

    @classmethod
    def from_model(cls, info: ModelInfo, max_len: int | None = None, *,
                   prompt: Prompt | None = None) -> KeywordTokenizer:
        """The model's tokenizer, from a ModelInfo already read (the model folder is read once per start)."""
        if info.static is not None:  # no special tokens, the library's cuts (StaticTokenizer, below)
            return StaticTokenizer.from_static(info, max_len, prompt=prompt)
        limit = info.max_seq_length if max_len is None else max_len
        if not 3 <= limit <= info.max_tokens:
            raise ModelError(f"{info.model_dir}: max_len {limit} must be in [3, {info.max_tokens}]")
        try:
            tokenizer = Tokenizer.from_file(str(info.tokenizer_path))
        except Exception as exc:  # tokenizers raises a bare Exception on a malformed file
            raise ModelError(f"{info.tokenizer_path}: cannot load tokenizer ({exc})") from None
        return cls(tokenizer, limit, source=str(info.tokenizer_path), prompt=prompt)

    @property
    def word_cache(self) -> WordCache | None:
        """The fast path's word cache (its hit rate), or None where the full tokenizer runs everything."""
        return self._fast.cache if self._fast is not None else None

    @property
    def fast_path(self) -> str:
        """Which path ASCII keywords take: "compiled" (worker/intake/_wordpiece.c), "python" (its
        Python loop: built without a C compiler), or "none" (not a BERT WordPiece: the full tokenizer)."""
        if self._fast is None:
            return "none"
        return "compiled" if self._fast.compiled else "python"

    def vocabulary(self, size: int) -> tuple[str, ...]:
        """The token of each id below `size` ("" for an id the tokenizer has none for): what a sparse
        model's `terms` name its indices with."""
        return tuple(self._tokenizer.id_to_token(i) or "" for i in range(size))

    @property
    def max_len(self) -> int:
        return self._max_len

    @property
    def special_tokens(self) -> int:
        """Tokens every encoding has ([CLS], [SEP], the prompt's): an encoding of no more has no text."""
        return int(self._n_fixed)

    @property
    def prompt_tokens(self) -> int:
        """How many leading tokens of every encoding are the prompt's, as sentence-transformers
        counts them for include_prompt=false (its leading special token included); 0 without one."""
        return self._prompt_tokens

    def encode(self, texts: Sequence[str]) -> list[Encoded]:
        """The texts' encodings. ASCII text of a BERT WordPiece tokenizer takes the fast path
        (worker/intake/wordpiece.py: the same IDs, a word lookup each); the rest goes to the
        tokenizer in one call on the calling thread, without the GIL (see __init__)."""
        prefix = self.prompt.text
        full = [prefix + t for t in texts] if prefix else list(texts)
        cut = self._max_len
        fast = self._fast
        out: list[Encoded | None]
        slow: list[int] = []
        if fast is None:
            out = [None] * len(full)
            slow = list(range(len(full)))
        else:
            views, counts = fast.encode_many(full, cut)
            out = [None if n is None else _new_encoded(Encoded, (ids, n, n > cut)) for ids, n in zip(views, counts)]
            if None in counts:
                slow = [i for i, n in enumerate(counts) if n is None]
        if slow:
            self._encode_slow(full, slow, out, cut, special_tokens=True)
        return out  # type: ignore[return-value]  # every slot is filled above

    def _encode_slow(self, full: list[str], slow: list[int], out: list[Encoded | None], cut: int, *,
                     special_tokens: bool) -> None:
        """The texts `slow` of `full` through the tokenizer in one call, into their slots of `out`."""
        special = self._n_special if special_tokens else 0
        # Offsets are not computed (encode_batch_fast): nothing here reads them.
        for i, enc in zip(slow, self._tokenizer.encode_batch_fast([full[i] for i in slow],
                                                                   add_special_tokens=special_tokens)):
            ids = np.array(enc.ids, dtype=np.int64)
            n = len(ids)
            # Only an encoding cut at max_len has overflowing pieces; reading them costs objects.
            overflow = sum(len(o.ids) - special for o in enc.overflowing) if n >= cut else 0
            out[i] = Encoded(ids, n + overflow, overflow > 0)


class StaticTokenizer(KeywordTokenizer):
    def __init__(self, tokenizer: Tokenizer, spec: StaticSpec, max_len: int, *, source: str = "<tokenizer>",
                 prompt: Prompt | None = None, fast: bool = True) -> None:
        if max_len < 1:
            raise ValueError(f"{source}: max_len {max_len} must be at least 1")
        # The fast path cuts with its [CLS] and [SEP] counted: two more than the tokens kept.
        super().__init__(tokenizer, max_len + 2, source=source, prompt=prompt, fast=fast)
        self._max_len = max_len
        tokenizer.enable_truncation(max_len)  # the full tokenizer's cut, without special tokens
        # model2vec cuts the text first, at max_length x the median token length (characters).
        chars = 0
        if spec.format == "model2vec" and spec.stated_cut:
            tokens = [tok for tok, _ in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])]
            chars = max_len * int(np.median([len(t) for t in tokens]))
        self._chars = chars
        # Nothing is put around the text, and the mean takes every token (a prompt's too).
        self._n_fixed = 0
        self._prompt_tokens = 0

    @classmethod
    def from_static(cls, info: ModelInfo, max_len: int | None = None, *,
                    prompt: Prompt | None = None) -> StaticTokenizer:
        assert info.static is not None
        limit = info.max_seq_length if max_len is None else max_len
        if not 1 <= limit <= info.max_tokens:
            raise ModelError(f"{info.model_dir}: max_len {limit} must be in [1, {info.max_tokens}]")
        try:
            tokenizer = Tokenizer.from_file(str(info.tokenizer_path))
        except Exception as exc:  # tokenizers raises a bare Exception on a malformed file
            raise ModelError(f"{info.tokenizer_path}: cannot load tokenizer ({exc})") from None
        return cls(tokenizer, info.static, limit, source=str(info.tokenizer_path), prompt=prompt)

    def encode(self, texts: Sequence[str]) -> list[Encoded]:
        """Each text's token IDs without special tokens, cut as the model's library cuts them."""
        prefix = self.prompt.text
        full = [prefix + t for t in texts] if prefix else list(texts)
        if self._chars:
            chars = self._chars
            full = [t[:chars] for t in full]
        cut = self._max_len
        fast = self._fast
        out: list[Encoded | None]
        slow: list[int] = []
        if fast is None:
            out = [None] * len(full)
            slow = list(range(len(full)))
        else:
            views, counts = fast.encode_many(full, cut + 2)
            out = [None if n is None else _new_encoded(Encoded, (ids[1:-1], n - 2, n - 2 > cut))
                   for ids, n in zip(views, counts)]
            if None in counts:
                slow = [i for i, n in enumerate(counts) if n is None]
        if slow:
            self._encode_slow(full, slow, out, cut, special_tokens=False)
        return out  # type: ignore[return-value]  # every slot is filled above
