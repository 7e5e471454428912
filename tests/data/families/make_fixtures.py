"""Makes the encoder-family fixtures: tiny random models and their reference vectors.

Run ONCE, in a throwaway environment with torch, transformers and sentence-transformers (never
in CI, never needed by the tests, which read only what this writes):

    python3 -m venv /tmp/refenv && /tmp/refenv/bin/pip install torch transformers sentence-transformers
    /tmp/refenv/bin/python tests/data/families/make_fixtures.py

For each family (bert, roberta, xlm-roberta, distilbert, mpnet) it writes tests/data/families/<family>/
with config.json, model.safetensors (float16, to keep the fixture small; the exporter and the
reference both compute in float32 from the same float16 values), tokenizer.json (a tiny
tokenizer of the family's kind, trained here on tests/data/terabyte05-300.tsv) and
reference.npz: the token ids of each text and the vectors transformers computes for them
(AutoModel in float32, then sentence-transformers' Pooling + Normalize modules), mean and CLS
pooling, each text run on its own (no padding). versions.json records what made them.

The weights are random with a larger spread than HF's init (std 0.02 makes attention nearly
uniform and MPNet's relative position bias nearly zero, which would let a wrong graph pass).
"""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

import numpy as np
import sentence_transformers
import tokenizers
import torch
import transformers
from safetensors.torch import save_file
from sentence_transformers.models import Normalize, Pooling
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

HERE = Path(__file__).resolve().parent
CORPUS = HERE.parent / "terabyte05-300.tsv"
VOCAB = 320
HIDDEN, LAYERS, HEADS, INTERMEDIATE, MAX_TOKENS = 32, 2, 4, 64, 128

TEXTS = [
    "running shoes", "a", "how to fix a flat bicycle tyre on the road without tools",
    "東京 ラーメン", "Zürich café öffnungszeiten", "cheap flights new york to london in december",
    "x y z", "weather", "best laptop 2024 for students under 500 dollars with long battery life",
    "القاهرة", "python list comprehension", "?",
]


def corpus() -> list[str]:
    lines = [line.split("\t", 1)[-1].strip() for line in CORPUS.read_text(encoding="utf-8").splitlines()]
    return [line for line in lines if line] + TEXTS


def wordpiece(cls: str, sep: str, pad: str, unk: str, specials: list[str]) -> Tokenizer:
    tok = Tokenizer(models.WordPiece(unk_token=unk))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(corpus(), trainers.WordPieceTrainer(vocab_size=VOCAB, special_tokens=specials))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}", special_tokens=[(cls, tok.token_to_id(cls)), (sep, tok.token_to_id(sep))])
    return tok


def byte_bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus(), trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<s>", "<pad>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    return tok


def unigram() -> Tokenizer:
    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(corpus(), trainers.UnigramTrainer(
        vocab_size=VOCAB, special_tokens=["<s>", "<pad>", "</s>", "<unk>"], unk_token="<unk>"))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>",
                                                       special_tokens=[("<s>", 0), ("</s>", 2)])
    return tok


def configs(vocab: int) -> dict[str, tuple[transformers.PretrainedConfig, Tokenizer]]:
    common = dict(vocab_size=vocab, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  intermediate_size=INTERMEDIATE, hidden_act="gelu")
    bert_tok = wordpiece("[CLS]", "[SEP]", "[PAD]", "[UNK]", ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    # RoBERTa-style positions start at padding_idx + 1: max_position_embeddings holds the offset.
    offset = dict(pad_token_id=1, bos_token_id=0, eos_token_id=2, max_position_embeddings=MAX_TOKENS + 2)
    return {
        "bert": (transformers.BertConfig(**common, max_position_embeddings=MAX_TOKENS, type_vocab_size=2,
                                         layer_norm_eps=1e-12), bert_tok),
        "roberta": (transformers.RobertaConfig(**common, **offset, type_vocab_size=1, layer_norm_eps=1e-5),
                    byte_bpe()),
        "xlm-roberta": (transformers.XLMRobertaConfig(**common, **offset, type_vocab_size=1, layer_norm_eps=1e-5),
                        unigram()),
        "distilbert": (transformers.DistilBertConfig(vocab_size=vocab, dim=HIDDEN, n_layers=LAYERS, n_heads=HEADS,
                                                     hidden_dim=INTERMEDIATE, activation="gelu",
                                                     max_position_embeddings=MAX_TOKENS, pad_token_id=0), bert_tok),
        "mpnet": (transformers.MPNetConfig(**common, **offset, layer_norm_eps=1e-5, relative_attention_num_buckets=32),
                  wordpiece("<s>", "</s>", "<pad>", "<unk>", ["<s>", "<pad>", "</s>", "<unk>", "<mask>"])),
    }


def randomise(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" in name or "layer_norm" in name:
                base = 1.0 if name.endswith("weight") else 0.0
                p.copy_(base + 0.2 * torch.randn(p.shape, generator=gen))
            elif "relative_attention_bias" in name:
                p.copy_(1.0 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            p.copy_(p.half().float())  # what the float16 file holds: both sides start from these values


def reference(model: torch.nn.Module, ids: list[list[int]], mode: str) -> np.ndarray:
    pooling = Pooling(HIDDEN, pooling_mode=mode)
    normalize = Normalize()
    rows = []
    with torch.no_grad():
        for row in ids:  # one text at a time: no padding in the reference
            input_ids = torch.tensor([row])
            mask = torch.ones_like(input_ids)
            tokens = model(input_ids=input_ids, attention_mask=mask).last_hidden_state
            out = normalize(pooling({"token_embeddings": tokens, "attention_mask": mask}))
            rows.append(out["sentence_embedding"][0].numpy())
    return np.stack(rows).astype(np.float32)


def main() -> None:
    torch.manual_seed(0)
    made = {}
    for seed, (family, (config, tok)) in enumerate(configs(VOCAB).items()):
        config.vocab_size = tok.get_vocab_size()
        folder = HERE / family
        folder.mkdir(exist_ok=True)
        model = transformers.AutoModel.from_config(config, add_pooling_layer=False) \
            if family in ("bert", "roberta", "xlm-roberta") else transformers.AutoModel.from_config(config)
        model.eval()
        randomise(model, seed)
        state = {k: v.detach().half().contiguous() for k, v in model.state_dict().items()
                 if not k.endswith("position_ids") and not k.endswith("token_type_ids")}
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
        cfg = config.to_dict()
        cfg.pop("transformers_version", None)
        (folder / "config.json").write_text(json.dumps(cfg, indent=1, sort_keys=True) + "\n")
        tok.save(str(folder / "tokenizer.json"))
        ids = [enc.ids for enc in tok.encode_batch(TEXTS)]
        flat = np.concatenate([np.asarray(r, np.int64) for r in ids])
        offsets = np.cumsum([0] + [len(r) for r in ids])
        np.savez_compressed(folder / "reference.npz", texts=np.asarray(TEXTS), ids=flat, offsets=offsets,
                            mean=reference(model, ids, "mean"), cls=reference(model, ids, "cls"))
        made[family] = {"model_class": type(model).__name__, "vocab_size": config.vocab_size,
                        "max_position_embeddings": config.max_position_embeddings}
        print(family, type(model).__name__, "vocab", config.vocab_size, "tokens", [len(r) for r in ids])
    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "transformers": transformers.__version__, "sentence_transformers": sentence_transformers.__version__,
                "tokenizers": tokenizers.__version__, "numpy": np.__version__, "families": made,
                "command": " ".join([Path(sys.executable).name, *sys.argv])}
    (HERE / "versions.json").write_text(json.dumps(versions, indent=1) + "\n")


if __name__ == "__main__":
    main()
