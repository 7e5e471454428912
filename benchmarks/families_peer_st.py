"""The sentence-transformers side of benchmarks/families_peer.py, run in a throwaway environment.

Never imported by the worker or its venv: benchmarks/families_peer.py runs it with the
interpreter of a separate environment that has torch, transformers and sentence-transformers
(python3 -m venv /tmp/refenv && /tmp/refenv/bin/pip install torch transformers
sentence-transformers), from the repository root:

    /tmp/refenv/bin/python -m benchmarks.families_peer_st build --family qwen3 --corpus FILE --out DIR
    /tmp/refenv/bin/python -m benchmarks.families_peer_st serve --model DIR --texts FILE --vectors FILE

`build` saves a sentence-transformers folder at a real model's shape (SHAPES) with random
weights (transformers' own init) in float32, its pipeline as the real model's (Qwen3-Embedding:
lasttoken, Normalize, left padding; EmbeddingGemma: mean, Dense 768->3072->768, Normalize;
gte-modernbert: CLS, Normalize) and a tokenizer of the family's kind (Qwen's byte-level BPE,
Gemma's "▁" BPE, ModernBERT's byte-level BPE, each with its special tokens and post-processor)
trained on `--corpus` with a VOCAB-token vocabulary instead of the real 150k-260k: the
embedding table is a lookup, so its size does not change the compute, and the files stay small.

`serve` loads the folder once (float32, CPU), encodes the first WARM_UP texts to warm up, then
answers each line "encode" on stdin with one `SentenceTransformer.encode(texts)` (its defaults:
batch 32, sorted by length inside) and a JSON line {"seconds": wall, "cpu_seconds": the process's
CPU time} on stdout, so that the paired rounds time the encoding alone, not the start; the first
encode's vectors go to `--vectors`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

VOCAB = 16384

# The real models' shapes (their config.json), issue 58.
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, tie_word_embeddings=True,
                  rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
                  max_position_embeddings=32768),
    "gemma3_text": dict(hidden_size=768, intermediate_size=1152, num_hidden_layers=24, num_attention_heads=3,
                        num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, rms_norm_eps=1e-6,
                        hidden_activation="gelu_pytorch_tanh", use_bidirectional_attention=True,
                        sliding_window=512, max_position_embeddings=2048,
                        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                     for i in range(24)],
                        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}),
    "modernbert": dict(hidden_size=768, intermediate_size=1152, num_hidden_layers=22, num_attention_heads=12,
                       local_attention=128, max_position_embeddings=8192, norm_eps=1e-5, hidden_activation="gelu",
                       layer_types=["full_attention" if i % 3 == 0 else "sliding_attention" for i in range(22)],
                       rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 160_000.0},
                                        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}),
}
REAL_NAMES = {"qwen3": "Qwen3-Embedding-0.6B", "gemma3_text": "EmbeddingGemma-300m", "modernbert": "gte-modernbert-base"}
MAX_SEQ_LENGTH = 512
WARM_UP = 256  # texts encoded once before the rounds (the first calls' one-off costs)


def _lines(path: Path) -> list[str]:
    rows = [line.split("\t", 1)[-1].strip() for line in path.read_text(encoding="utf-8").splitlines()]
    return [r for r in rows if r]


def tokenizer(family: str, corpus: list[str]) -> tuple[Any, dict[str, Any]]:
    """A tokenizer of the family's kind, trained on `corpus`, and its tokenizer_config.json."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    if family == "gemma3_text":
        tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True))
        tok.normalizer = normalizers.Replace(" ", "▁")
        tok.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse()])
        tok.train_from_iterator(corpus, trainers.BpeTrainer(
            vocab_size=VOCAB, special_tokens=["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"],
            show_progress=False))
        tok.post_processor = processors.TemplateProcessing(single="<bos> $A <eos>",
                                                           special_tokens=[("<bos>", 2), ("<eos>", 1)])
        return tok, {"tokenizer_class": "GemmaTokenizer", "pad_token": "<pad>", "eos_token": "<eos>",
                     "bos_token": "<bos>", "unk_token": "<unk>", "mask_token": "<mask>", "add_bos_token": True,
                     "add_eos_token": True, "padding_side": "right"}
    tok = Tokenizer(models.BPE())
    if family == "qwen3":
        tok.normalizer = normalizers.NFC()
        pattern = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                   r"|\s*[\r\n]+|\s+(?!\S)|\s+")
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    if family == "qwen3":
        tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
        tok.post_processor = processors.TemplateProcessing(
            single="$A <|endoftext|>", special_tokens=[("<|endoftext|>", tok.token_to_id("<|endoftext|>"))])
        return tok, {"tokenizer_class": "Qwen2Tokenizer", "pad_token": "<|endoftext|>", "eos_token": "<|im_end|>",
                     "padding_side": "left"}
    tok.add_special_tokens(["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"])
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", tok.token_to_id("[CLS]")),
                                                 ("[SEP]", tok.token_to_id("[SEP]"))])
    return tok, {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "[PAD]", "cls_token": "[CLS]",
                 "sep_token": "[SEP]", "unk_token": "[UNK]", "mask_token": "[MASK]",
                 "model_input_names": ["input_ids", "attention_mask"], "padding_side": "right"}


def build(family: str, corpus: Path, out: Path, seed: int = 0) -> None:
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    tok, tok_config = tokenizer(family, _lines(corpus))
    shape = dict(SHAPES[family], vocab_size=tok.get_vocab_size())
    if family == "qwen3":
        eot = tok.token_to_id("<|endoftext|>")
        config = transformers.Qwen3Config(**shape, bos_token_id=eot, eos_token_id=eot)
    elif family == "gemma3_text":
        config = transformers.Gemma3TextConfig(**shape, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    else:
        ids = {k: tok.token_to_id(t) for k, t in (("pad_token_id", "[PAD]"), ("cls_token_id", "[CLS]"),
                                                  ("sep_token_id", "[SEP]"), ("bos_token_id", "[CLS]"),
                                                  ("eos_token_id", "[SEP]"))}
        config = transformers.ModernBertConfig(**shape, **ids)
    torch.manual_seed(seed)
    encoder = out.parent / f"{out.name}-encoder"
    transformers.AutoModel.from_config(config, dtype=torch.float32).save_pretrained(str(encoder))
    tok.save(str(encoder / "tokenizer.json"))
    (encoder / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    hidden = shape["hidden_size"]
    modules: list[torch.nn.Module] = [
        Transformer(str(encoder), max_seq_length=MAX_SEQ_LENGTH, model_kwargs={"dtype": torch.float32}),
        Pooling(hidden, pooling_mode={"qwen3": "lasttoken", "gemma3_text": "mean", "modernbert": "cls"}[family])]
    if family == "gemma3_text":
        modules += [Dense(hidden, 4 * hidden, bias=False, activation_function=torch.nn.Identity()),
                    Dense(4 * hidden, hidden, bias=False, activation_function=torch.nn.Identity())]
    modules.append(Normalize())
    SentenceTransformer(modules=modules, similarity_fn_name="cosine").save(str(out))
    for path in sorted(encoder.iterdir()):
        path.unlink()
    encoder.rmdir()


def serve(model_dir: Path, texts_file: Path, vectors: Path, threads: int) -> None:
    import numpy as np
    import torch
    from sentence_transformers import SentenceTransformer

    if threads:
        torch.set_num_threads(threads)
    texts = texts_file.read_text(encoding="utf-8").split("\n")
    model = SentenceTransformer(str(model_dir), device="cpu", model_kwargs={"dtype": torch.float32})
    model.encode(texts[:WARM_UP], convert_to_numpy=True)
    info = {"ready": True, "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "sentence_transformers": __import__("sentence_transformers").__version__,
            "transformers": __import__("transformers").__version__,
            "padding_side": model.tokenizer.padding_side,
            "tokens": int(sum(len(x) for x in model.tokenizer(texts)["input_ids"]))}
    print(json.dumps(info), flush=True)
    for calls, line in enumerate(sys.stdin):
        if line.strip() != "encode":
            break
        start, cpu = time.perf_counter(), time.process_time()
        got = model.encode(texts, convert_to_numpy=True)
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
        if not calls:
            np.save(vectors, got.astype(np.float32))
        print(json.dumps({"seconds": seconds, "cpu_seconds": cpu_seconds}), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build")
    b.add_argument("--family", choices=sorted(SHAPES), required=True)
    b.add_argument("--corpus", type=Path, required=True, help="id<TAB>text lines to train the tokenizer on")
    b.add_argument("--out", type=Path, required=True)
    s = sub.add_parser("serve")
    s.add_argument("--model", type=Path, required=True)
    s.add_argument("--texts", type=Path, required=True, help="the texts, one a line")
    s.add_argument("--vectors", type=Path, required=True, help="where to write the first encode's vectors (.npy)")
    s.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args(argv)
    if args.command == "build":
        build(args.family, args.corpus, args.out)
    else:
        serve(args.model, args.texts, args.vectors, args.threads)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
