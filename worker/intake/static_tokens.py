"""Tokenisation for a static model (worker/core/static.py), as its library does it: no special
tokens, model2vec's character cut, the token cut; model2vec's unknown token is dropped in the
table (a zero row the mean does not count), so the IDs here are the tokenizer's own.

The fast path is the WordPiece one every BERT tokenizer takes (worker/intake/wordpiece.py), with
its [CLS] and [SEP] sliced off: a BERT post-processor only adds them, so the IDs between are
those of add_special_tokens=False. Everything else runs the tokenizer without special tokens.

Threads: the poll thread only, as KeywordTokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from tokenizers import Tokenizer

from worker.core.model import ModelError, ModelInfo, Prompt
from worker.core.static import StaticSpec
from worker.intake.tokenize import Encoded, KeywordTokenizer

_new_encoded = tuple.__new__


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
            for i, enc in zip(slow, self._tokenizer.encode_batch_fast([full[i] for i in slow],
                                                                       add_special_tokens=False)):
                ids = np.array(enc.ids, dtype=np.int64)
                n = len(ids)
                overflow = sum(len(o.ids) for o in enc.overflowing) if n >= cut else 0
                out[i] = Encoded(ids, n + overflow, overflow > 0)
        return out  # type: ignore[return-value]  # every slot is filled above
