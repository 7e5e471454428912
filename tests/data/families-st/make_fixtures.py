"""Makes the fixtures of the 2026 families (qwen3, gemma3_text, modernbert): whole sentence-transformers folders.

Run ONCE, in a throwaway environment with torch, transformers and sentence-transformers (never
in CI, never needed by the tests, which read only what this writes):

    python3 -m venv /tmp/refenv && /tmp/refenv/bin/pip install torch transformers sentence-transformers
    /tmp/refenv/bin/python tests/data/families-st/make_fixtures.py

Unlike tests/data/families/ (an encoder alone, pooled by hand), each fixture here is a complete
sentence-transformers folder as a user downloads one: the encoder (config.json, model.safetensors
in float16 to keep it small, tokenizer.json and tokenizer_config.json of a tiny tokenizer of the
family's kind trained here on tests/data/terabyte05-300.tsv) and its modules (modules.json,
Pooling, Dense, Normalize, prompts), saved by SentenceTransformer.save and then, for the "hub"
fixtures, rewritten as the hub's models spell them: sentence-transformers 5.x module names and
pooling_mode_* flags, and a config.json in transformers 4.x's keys (rope_theta,
rope_local_base_freq, global_rope_theta, local_rope_theta, global_attn_every_n_layers) instead
of transformers 5's rope_parameters. Each folder is then loaded back by SentenceTransformer (in
float32, from the float16 values) and `encode`d as a user would; reference.npz holds the texts,
the token IDs it fed the model and the vectors it returned, for each prompt case, both in one
padded batch of all texts and one text at a time (fixture.json and README.md say what each
holds). versions.json records what made them and the worst cosine between the batched and the
one-at-a-time vectors: sentence-transformers' own padding error, far under the 1e-4 the
worker's parity gate allows.

The weights are random with a larger spread than HF's init (std 0.02 makes attention nearly
uniform, which would let a wrong mask, window or rotary base pass).
"""

from __future__ import annotations

import json
import platform
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import sentence_transformers
import tokenizers
import torch
import transformers
from safetensors.torch import load_file, save_file
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.modules import Dense, Normalize, Transformer
from sentence_transformers.sentence_transformer.modules import Pooling
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

HERE = Path(__file__).resolve().parent
CORPUS = HERE.parent / "terabyte05-300.tsv"
VOCAB = 480

QWEN_QUERY = "Instruct: Given a web search query, retrieve relevant passages\nQuery:"
GEMMA_PROMPTS = {"query": "task: search result | query: ", "document": "title: none | text: ",
                 "Clustering": "task: clustering | query: "}

TEXTS = [
    "running shoes", "a", "weather", "?", "x y z", "東京 ラーメン", "Zürich café öffnungszeiten", "القاهرة",
    "python list comprehension", "cheap flights new york to london in december",
    "how to fix a flat bicycle tyre on the road without tools",
    "best laptop 2024 for students under 500 dollars with long battery life",
    # Several times any sliding window here (8 to 16 tokens): 40 to 100 tokens with these vocabularies.
    "the quick brown fox jumps over the lazy dog while the cat watches from the warm windowsill "
    "and the birds sing in the old oak tree beside the river",
    "nurseries in woodbridge new jersey that sell native plants, fruit trees and vegetable seedlings, "
    "open on sundays, with delivery to nearby towns and advice on planting",
    "what is the difference between a roth ira and a traditional ira for someone who changes jobs often, "
    "and can i move my old employer's 401k plan into either one without paying taxes or penalties this year",
    "miami white pages phone numbers addresses",
]

ACTIVATIONS = {"identity": torch.nn.Identity, "tanh": torch.nn.Tanh}
LEGACY_TYPES = {"Transformer": "sentence_transformers.models.Transformer",
                "Pooling": "sentence_transformers.models.Pooling",
                "Dense": "sentence_transformers.models.Dense",
                "Normalize": "sentence_transformers.models.Normalize"}
LEGACY_FLAGS = {"cls": "pooling_mode_cls_token", "max": "pooling_mode_max_tokens",
                "mean": "pooling_mode_mean_tokens", "mean_sqrt_len_tokens": "pooling_mode_mean_sqrt_len_tokens",
                "weightedmean": "pooling_mode_weightedmean_tokens", "lasttoken": "pooling_mode_lasttoken"}


# ------------------------------------------------------------------ tokenizers


def corpus() -> list[str]:
    lines = [line.split("\t", 1)[-1].strip() for line in CORPUS.read_text(encoding="utf-8").splitlines()]
    return [line for line in lines if line] + TEXTS


def qwen_tokenizer() -> tuple[Tokenizer, dict[str, Any]]:
    """Byte-level BPE with Qwen2's split pattern; its special tokens after the vocabulary, as Qwen's
    are; the post-processor appends <|endoftext|> (Qwen3-Embedding's tokenizer.json does)."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    pattern = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus(), trainers.BpeTrainer(
        vocab_size=VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    eot = tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.TemplateProcessing(
        single="$A <|endoftext|>", pair="$A <|endoftext|> $B:1 <|endoftext|>:1",
        special_tokens=[("<|endoftext|>", eot)])
    return tok, {"tokenizer_class": "Qwen2Tokenizer", "pad_token": "<|endoftext|>", "eos_token": "<|im_end|>",
                 "bos_token": None, "unk_token": None, "model_max_length": 32768}


def gemma_tokenizer() -> tuple[Tokenizer, dict[str, Any]]:
    """SentencePiece-style BPE (spaces as "▁"), Gemma's special ids (<pad> 0, <eos> 1, <bos> 2,
    <unk> 3, <mask> 4); <bos> before and <eos> after the text, as EmbeddingGemma's tokenizer adds them."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse()])
    tok.train_from_iterator(corpus(), trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"], show_progress=False))
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A <eos>", pair="<bos> $A <eos> $B:1 <eos>:1", special_tokens=[("<bos>", 2), ("<eos>", 1)])
    return tok, {"tokenizer_class": "GemmaTokenizer", "pad_token": "<pad>", "eos_token": "<eos>",
                 "bos_token": "<bos>", "unk_token": "<unk>", "mask_token": "<mask>", "add_bos_token": True,
                 "add_eos_token": True, "model_max_length": 2048}


def modernbert_tokenizer() -> tuple[Tokenizer, dict[str, Any]]:
    """Byte-level BPE (OLMo's kind), [CLS] $A [SEP], the special tokens after the vocabulary as
    ModernBERT's are (50280 on)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus(), trainers.BpeTrainer(
        vocab_size=VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.add_special_tokens(["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"])
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", tok.token_to_id("[CLS]")), ("[SEP]", tok.token_to_id("[SEP]"))])
    return tok, {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "[PAD]", "cls_token": "[CLS]",
                 "sep_token": "[SEP]", "unk_token": "[UNK]", "mask_token": "[MASK]",
                 "model_input_names": ["input_ids", "attention_mask"], "model_max_length": 8192}


TOKENIZERS = {"qwen3": qwen_tokenizer, "gemma3_text": gemma_tokenizer, "modernbert": modernbert_tokenizer}


# ------------------------------------------------------------------ the fixtures


@dataclass(frozen=True)
class Spec:
    name: str
    family: str
    config: dict[str, Any]          # the transformers config's arguments (transformers 5 spelling)
    pooling: str
    padding_side: str = "right"
    dense: tuple[tuple[int, str, bool], ...] = ()  # (out_features, activation, bias) per Dense layer
    normalize: bool = True
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt: str | None = None
    max_seq_length: int = 128
    truncate_dim: int | None = None
    style: str = "st6"              # or "hub": sentence-transformers 5.x files, transformers 4.x config keys
    save_as_causal_lm: bool = False  # weights under "model." as a *ForCausalLM checkpoint has them
    seed: int = 0


SPECS = (
    # Qwen3-Embedding's own layout: left padding, lasttoken, query instruction, no default prompt.
    Spec("qwen3-lasttoken-left", "qwen3",
         dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=24, rms_norm_eps=1e-6, tie_word_embeddings=True,
              rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, max_position_embeddings=512),
         "lasttoken", padding_side="left", prompts={"query": QWEN_QUERY, "document": ""}, seed=11),
    # As the hub spells it (rope_theta; 5.x modules), one key-value head, right padding, the query
    # prompt by default (48 tokens here), truncation at 72 tokens (the <|endoftext|> kept), a Matryoshka width,
    # the weights under "model." (saved from Qwen3ForCausalLM, as fine-tunes often are).
    Spec("qwen3-lasttoken-right-hub", "qwen3",
         dict(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-5, tie_word_embeddings=True,
              rope_parameters={"rope_type": "default", "rope_theta": 10_000.0}, max_position_embeddings=256),
         "lasttoken", padding_side="right", prompts={"query": QWEN_QUERY, "document": ""}, default_prompt="query",
         max_seq_length=72, truncate_dim=16, style="hub", save_as_causal_lm=True, seed=12),
    # EmbeddingGemma's pipeline: mean, Dense up 4x and back (no bias, identity), Normalize; two
    # sliding layers of window 8 around a full one.
    Spec("gemma3-mean-dense", "gemma3_text",
         dict(hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=24, rms_norm_eps=1e-6,
              hidden_activation="gelu_pytorch_tanh", use_bidirectional_attention=True, sliding_window=8,
              layer_types=["sliding_attention", "full_attention", "sliding_attention"],
              rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
              max_position_embeddings=512, pad_token_id=0, eos_token_id=1, bos_token_id=2),
         "mean", dense=((192, "identity", False), (48, "identity", False)), prompts=GEMMA_PROMPTS, seed=21),
    # The hub's spelling (rope_theta, rope_local_base_freq, 5.x modules), 4 query / 2 key-value
    # heads, window 12, the query prompt by default.
    Spec("gemma3-mean-dense-hub", "gemma3_text",
         dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=12, query_pre_attn_scalar=12, rms_norm_eps=1e-6,
              hidden_activation="gelu_pytorch_tanh", use_bidirectional_attention=True, sliding_window=12,
              layer_types=["sliding_attention", "full_attention"],
              rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
              max_position_embeddings=512, pad_token_id=0, eos_token_id=1, bos_token_id=2),
         "mean", dense=((128, "identity", False), (32, "identity", False)), prompts=GEMMA_PROMPTS,
         default_prompt="query", style="hub", seed=22),
    # gte-modernbert's pipeline: CLS, Normalize; a global layer then two local ones of window 16.
    Spec("modernbert-cls", "modernbert",
         dict(hidden_size=48, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
              layer_types=["full_attention", "sliding_attention", "sliding_attention"], local_attention=16,
              rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 160_000.0},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
              max_position_embeddings=512, norm_eps=1e-5, hidden_activation="gelu"),
         "cls", seed=31),
    # The hub's spelling (global_rope_theta, local_rope_theta, global_attn_every_n_layers 2, no
    # layer_types; 5.x modules), window 8, mean pooling and no Normalize (the norm is checked).
    Spec("modernbert-mean-hub", "modernbert",
         dict(hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=2,
              layer_types=["full_attention", "sliding_attention", "full_attention"], local_attention=8,
              rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 80_000.0},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
              max_position_embeddings=512, norm_eps=1e-5, hidden_activation="gelu"),
         "mean", normalize=False, style="hub", seed=32),
)


def build_config(spec: Spec, tok: Tokenizer) -> transformers.PretrainedConfig:
    cfg = dict(spec.config, vocab_size=tok.get_vocab_size())
    if spec.family == "qwen3":
        eot = tok.token_to_id("<|endoftext|>")
        return transformers.Qwen3Config(**cfg, bos_token_id=eot, eos_token_id=eot)
    if spec.family == "gemma3_text":
        return transformers.Gemma3TextConfig(**cfg)
    ids = {k: tok.token_to_id(t) for k, t in (("pad_token_id", "[PAD]"), ("cls_token_id", "[CLS]"),
                                              ("sep_token_id", "[SEP]"), ("bos_token_id", "[CLS]"),
                                              ("eos_token_id", "[SEP]"))}
    return transformers.ModernBertConfig(**cfg, **ids)


def randomise(model: torch.nn.Module, family: str, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                if family == "gemma3_text":  # Gemma's RMSNorm scales by (1 + weight)
                    value = (0.5 if ("q_norm" in name or "k_norm" in name) else 0.0) + 0.4 * r
                elif "q_norm" in name or "k_norm" in name:  # sharper attention than unit norms give
                    value = 1.5 + 0.5 * r
                else:
                    value = (1.0 if name.endswith("weight") else 0.0) + 0.25 * r
            elif p.dim() == 2 and "embed" not in name:
                value = 1.5 / p.shape[1] ** 0.5 * r
            elif p.dim() == 2:
                value = 0.6 * r
            else:
                value = 0.1 * r
            p.copy_(value.half().float())  # what the float16 file holds: both sides start from these values


def encoder_folder(spec: Spec, into: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """The transformers model and its tokenizer, saved as transformers saves them."""
    tok, tok_config = TOKENIZERS[spec.family]()
    config = build_config(spec, tok)
    torch.manual_seed(spec.seed)
    model = transformers.AutoModel.from_config(config)
    randomise(model, spec.family, spec.seed)
    model.eval()
    folder = into / f"{spec.name}-encoder"
    model.save_pretrained(str(folder))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {**tok_config, "padding_side": spec.padding_side}, indent=2) + "\n")
    return folder, {k: v.detach().clone() for k, v in model.state_dict().items()}


def st_model(spec: Spec, encoder: Path) -> SentenceTransformer:
    torch.manual_seed(spec.seed)
    transformer = Transformer(str(encoder), max_seq_length=spec.max_seq_length, model_kwargs={"dtype": torch.float32})
    hidden = spec.config["hidden_size"]
    modules: list[torch.nn.Module] = [transformer, Pooling(hidden, pooling_mode=spec.pooling)]
    width = hidden
    for out, act, bias in spec.dense:
        dense = Dense(width, out, bias=bias, activation_function=ACTIVATIONS[act]())
        with torch.no_grad():
            dense.linear.weight.copy_((1.0 / width ** 0.5 * torch.randn(out, width)).half().float())
            if bias:
                dense.linear.bias.copy_((0.1 * torch.randn(out)).half().float())
        modules.append(dense)
        width = out
    if spec.normalize:
        modules.append(Normalize())
    return SentenceTransformer(modules=modules, prompts=spec.prompts or None,
                               default_prompt_name=spec.default_prompt, similarity_fn_name="cosine")


def hub_config(spec: Spec, folder: Path) -> None:
    """config.json in transformers 4.x's keys, as the hub's models have it."""
    cfg = json.loads((folder / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    if spec.family == "qwen3":
        cfg.update(rope_theta=rope["rope_theta"], rope_scaling=None)
        cfg.pop("layer_types")  # Qwen3-Embedding's config.json predates them: all layers full
    elif spec.family == "gemma3_text":
        cfg.update(rope_theta=rope["full_attention"]["rope_theta"],
                   rope_local_base_freq=rope["sliding_attention"]["rope_theta"], rope_scaling=None)
    else:
        cfg.update(global_rope_theta=rope["full_attention"]["rope_theta"],
                   local_rope_theta=rope["sliding_attention"]["rope_theta"])
        types = cfg.pop("layer_types")
        every = next(i for i in range(1, len(types) + 1) if all(
            (t == "full_attention") == (j % i == 0) for j, t in enumerate(types)))
        cfg["global_attn_every_n_layers"] = every
    cfg.pop("dtype", None)
    cfg["torch_dtype"] = "float32"
    cfg["transformers_version"] = "4.56.1"
    (folder / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def hub_modules(spec: Spec, folder: Path) -> None:
    """The module files as sentence-transformers 5.x saved them (and the hub's models have them)."""
    mods = json.loads((folder / "modules.json").read_text())
    for m in mods:
        m["type"] = LEGACY_TYPES[m["type"].rsplit(".", 1)[-1]]
    (folder / "modules.json").write_text(json.dumps(mods, indent=2) + "\n")
    pool = {"word_embedding_dimension": spec.config["hidden_size"],
            **{flag: mode == spec.pooling for mode, flag in LEGACY_FLAGS.items()}, "include_prompt": True}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pool, indent=2) + "\n")
    (folder / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": spec.max_seq_length, "do_lower_case": False}, indent=2) + "\n")
    for m in mods:
        if m["type"].endswith("Dense"):
            dense = json.loads((folder / m["path"] / "config.json").read_text())
            dense = {k: dense[k] for k in ("in_features", "out_features", "bias", "activation_function")}
            (folder / m["path"] / "config.json").write_text(json.dumps(dense) + "\n")
        if m["type"].endswith("Normalize"):  # the old Normalize folder holds nothing
            shutil.rmtree(folder / m["path"], ignore_errors=True)
    st = json.loads((folder / "config_sentence_transformers.json").read_text())
    st = {"__version__": {"sentence_transformers": "5.1.0", "transformers": "4.56.1", "pytorch": "2.8.0+cu128"},
          "prompts": st["prompts"], "default_prompt_name": st["default_prompt_name"],
          "similarity_fn_name": st["similarity_fn_name"]}
    (folder / "config_sentence_transformers.json").write_text(json.dumps(st, indent=2) + "\n")
    # As transformers 4.x wrote it: the tokenizer's own class and limit (5.x kept max_seq_length
    # in sentence_bert_config.json), none of transformers 5's keys.
    _, tok_cfg = TOKENIZERS[spec.family]()
    tok_cfg = {**tok_cfg, "padding_side": spec.padding_side, "clean_up_tokenization_spaces": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, sort_keys=True) + "\n")


def half_weights(folder: Path, *, causal_lm: bool) -> None:
    """Every safetensors file in float16; with `causal_lm`, the encoder's keys under "model." and
    the architecture a *ForCausalLM, as a checkpoint saved from the language model has them."""
    for path in folder.rglob("model.safetensors"):
        tensors = {k: v.half().contiguous() for k, v in load_file(str(path)).items()}
        if causal_lm and path.parent == folder:
            tensors = {f"model.{k}": v for k, v in tensors.items()}
        save_file(tensors, str(path), metadata={"format": "pt"})
    if causal_lm:
        cfg = json.loads((folder / "config.json").read_text())
        cfg["architectures"] = [cfg["architectures"][0].replace("Model", "ForCausalLM")]
        (folder / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def write_fixture(spec: Spec, tmp: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    encoder, state = encoder_folder(spec, tmp)
    model = st_model(spec, encoder)
    out = HERE / spec.name
    shutil.rmtree(out, ignore_errors=True)
    model.save(str(out))
    (out / "README.md").unlink(missing_ok=True)
    for extra in ("generation_config.json", "chat_template.jinja"):
        (out / extra).unlink(missing_ok=True)
    if spec.style == "hub":
        hub_config(spec, out)
        hub_modules(spec, out)
    half_weights(out, causal_lm=spec.save_as_causal_lm)
    return out, state


# ------------------------------------------------------------------ the reference


FIRST_LAST = {"qwen3": (None, "<|endoftext|>"), "gemma3_text": ("<bos>", "<eos>"), "modernbert": ("[CLS]", "[SEP]")}


def token_ids(model: SentenceTransformer, texts: list[str]) -> list[np.ndarray]:
    features = model.preprocess(texts)
    mask = features["attention_mask"].numpy().astype(bool)
    return [row[m].astype(np.int64) for row, m in zip(features["input_ids"].numpy(), mask)]


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def reference(spec: Spec, folder: Path, state: dict[str, torch.Tensor]) -> dict[str, Any]:
    model = SentenceTransformer(str(folder), device="cpu", model_kwargs={"dtype": torch.float32})
    assert model.max_seq_length == spec.max_seq_length, model.max_seq_length
    loaded = model[0].model.state_dict()
    for key, value in state.items():  # the folder loads the weights it was made from (no fresh init)
        assert torch.equal(loaded[key].float(), value.float()), key
    tokenizer = model.tokenizer
    assert tokenizer.padding_side == spec.padding_side, tokenizer.padding_side
    raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
    arrays: dict[str, np.ndarray] = {"texts": np.asarray(TEXTS)}
    cases = {"default": {}} | {name: {"prompt_name": name} for name in spec.prompts}
    worst = 1.0
    made: dict[str, Any] = {}
    for case, kwargs in cases.items():
        prompt = spec.prompts.get(kwargs.get("prompt_name") or spec.default_prompt or "", "")
        ids = token_ids(model, [prompt + t for t in TEXTS])
        for text, row in zip(TEXTS, ids):
            if len(row) < spec.max_seq_length:  # untruncated rows are tokenizer.json's own encoding
                assert raw.encode(prompt + text).ids == row.tolist(), (case, text)
            first, last = FIRST_LAST[spec.family]  # truncated rows keep the special tokens
            assert first is None or row[0] == raw.token_to_id(first), (case, text)
            assert row[-1] == raw.token_to_id(last), (case, text)
        batched = model.encode(TEXTS, batch_size=len(TEXTS), convert_to_numpy=True, **kwargs).astype(np.float32)
        single = model.encode(TEXTS, batch_size=1, convert_to_numpy=True, **kwargs).astype(np.float32)
        cos = float(cosines(batched, single).min())
        worst = min(worst, cos)
        arrays |= {f"{case}_ids": np.concatenate(ids), f"{case}_offsets": np.cumsum([0] + [len(r) for r in ids]),
                   f"{case}_vectors": batched, f"{case}_single": single, f"{case}_prompt": np.asarray(prompt)}
        norms = np.linalg.norm(batched, axis=1)
        made[case] = {"prompt": prompt, "tokens": [len(r) for r in ids], "batched_vs_single_min_cos": cos,
                      "norm_min": float(norms.min()), "norm_max": float(norms.max())}
    # The pipeline fixtures' keys (tests/data/pipelines): the default case.
    arrays |= {"ids": arrays["default_ids"], "offsets": arrays["default_offsets"],
               "vectors": arrays["default_vectors"], "prompt": arrays["default_prompt"]}
    if spec.truncate_dim:
        truncated = model.encode(TEXTS, batch_size=len(TEXTS), convert_to_numpy=True,
                                 truncate_dim=spec.truncate_dim).astype(np.float32)
        assert np.allclose(truncated, arrays["default_vectors"][:, :spec.truncate_dim], atol=1e-6)
        arrays |= {"truncate_dim": np.asarray(spec.truncate_dim), "default_truncated": truncated}
        made["truncated_norm_max"] = float(np.linalg.norm(truncated, axis=1).max())
    np.savez_compressed(folder / "reference.npz", **arrays)
    made["cases"] = list(cases)
    made["batched_vs_single_min_cos"] = worst
    return made


def describe(spec: Spec, folder: Path, made: dict[str, Any]) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "fixture.json").write_text(json.dumps({
        "family": spec.family, "style": spec.style, "pooling": spec.pooling, "padding_side": spec.padding_side,
        "dense": [list(d) for d in spec.dense], "normalize": spec.normalize, "prompts": spec.prompts,
        "default_prompt_name": spec.default_prompt, "max_seq_length": spec.max_seq_length,
        "truncate_dim": spec.truncate_dim, "weights_under_model_prefix": spec.save_as_causal_lm,
        "cases": made["cases"], "layer_types": config.get("layer_types"),
    }, indent=1) + "\n")


def main() -> None:
    made = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for spec in SPECS:
            folder, state = write_fixture(spec, tmp)
            made[spec.name] = reference(spec, folder, state)
            describe(spec, folder, made[spec.name])
            print(spec.name, {k: v for k, v in made[spec.name].items() if not isinstance(v, dict)},
                  {c: (v["tokens"], v["batched_vs_single_min_cos"]) for c, v in made[spec.name].items()
                   if isinstance(v, dict)})
    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "transformers": transformers.__version__, "sentence_transformers": sentence_transformers.__version__,
                "tokenizers": tokenizers.__version__, "numpy": np.__version__, "fixtures": made,
                "command": " ".join([Path(sys.executable).name, *sys.argv])}
    (HERE / "versions.json").write_text(json.dumps(versions, indent=1) + "\n")


if __name__ == "__main__":
    main()
