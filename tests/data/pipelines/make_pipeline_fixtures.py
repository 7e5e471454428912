"""Makes the sentence-transformers pipeline fixtures: module folders and their reference vectors.

Run ONCE, in a throwaway environment with torch and sentence-transformers (never in CI, never
needed by the tests, which read only what this writes):

    python3 -m venv /tmp/st-venv && /tmp/st-venv/bin/pip install sentence-transformers
    /tmp/st-venv/bin/python tests/data/pipelines/make_pipeline_fixtures.py

Each fixture is a sentence-transformers model folder without its transformer: the encoder
(config.json, model.safetensors, tokenizer.json) is one of the tiny family fixtures in
tests/data/families/<family>/ (named in fixture.json), so only the module files are stored
here: modules.json, sentence_bert_config.json, 1_Pooling/config.json, the Dense layers'
config.json and model.safetensors (random float32 weights), config_sentence_transformers.json
(prompts). The folder is assembled from both (worker.families.pipeline_folder does the same),
loaded with SentenceTransformer and `encode`d as a user would (its tokenizer, its truncation at
max_seq_length, its prompt, its batching and padding, normalize_embeddings left off: vectors
are unit length only where the pipeline has a Normalize module). reference.npz holds the texts,
the token IDs sentence-transformers fed the model and the vectors it returned.

Two file styles, both of which sentence-transformers loads: "legacy" folders are written as
the hub's models are (sentence_transformers.models.X types, pooling_mode_*_token flags,
max_seq_length in sentence_bert_config.json); "st6" folders are what this version of
sentence-transformers saves (its module paths, a pooling_mode list, the length in
tokenizer_config.json).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import sentence_transformers
import torch
import transformers
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.modules import Dense, Normalize, Transformer
from sentence_transformers.sentence_transformer.modules import Pooling

HERE = Path(__file__).resolve().parent
FAMILIES = HERE.parent / "families"
ENCODER_FILES = ("config.json", "model.safetensors", "tokenizer.json")
HIDDEN = 32

TEXTS = [
    "running shoes", "a", "how to fix a flat bicycle tyre on the road without tools",
    "東京 ラーメン", "Zürich café öffnungszeiten", "cheap flights new york to london in december",
    "x y z", "weather", "best laptop 2024 for students under 500 dollars with long battery life",
    "القاهرة", "python list comprehension", "?",
    "the quick brown fox jumps over the lazy dog while the cat watches from the warm windowsill "
    "and the birds sing in the old oak tree beside the river",
]

ACTIVATIONS = {"tanh": torch.nn.Tanh, "identity": torch.nn.Identity, "gelu": torch.nn.GELU,
               "relu": torch.nn.ReLU, "sigmoid": torch.nn.Sigmoid, "silu": torch.nn.SiLU}
LEGACY_TYPES = {"Transformer": "sentence_transformers.models.Transformer",
                "Pooling": "sentence_transformers.models.Pooling",
                "Dense": "sentence_transformers.models.Dense",
                "Normalize": "sentence_transformers.models.Normalize"}
LEGACY_FLAGS = {"cls": "pooling_mode_cls_token", "max": "pooling_mode_max_tokens",
                "mean": "pooling_mode_mean_tokens", "mean_sqrt_len_tokens": "pooling_mode_mean_sqrt_len_tokens",
                "weightedmean": "pooling_mode_weightedmean_tokens", "lasttoken": "pooling_mode_lasttoken"}


@dataclass(frozen=True)
class Spec:
    name: str
    family: str
    pooling: tuple[str, ...]
    dense: tuple[tuple[int, str, bool], ...] = ()  # (out_features, activation, bias) per Dense layer
    normalize: bool = True
    include_prompt: bool = True
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt: str | None = None
    similarity: str = "cosine"
    max_seq_length: int = 64
    style: str = "legacy"  # or "st6"
    seed: int = 0


SPECS = (
    # distiluse-base-multilingual-cased's pipeline: mean, Dense with tanh, no Normalize.
    Spec("distilbert-mean-dense-tanh", "distilbert", ("mean",), dense=((24, "tanh", True),), normalize=False, seed=1),
    # multi-qa-mpnet-base-dot-v1's: CLS, no Normalize (a dot-product model).
    Spec("mpnet-cls-dot", "mpnet", ("cls",), normalize=False, similarity="dot", seed=2),
    # bge-small-en-v1.5's: CLS, Normalize.
    Spec("bert-cls-normalize", "bert", ("cls",), seed=3),
    Spec("roberta-max-dense-silu", "roberta", ("max",), dense=((32, "silu", True),), seed=4),
    Spec("xlm-roberta-lasttoken-dense-sigmoid", "xlm-roberta", ("lasttoken",), dense=((12, "sigmoid", True),),
         normalize=False, seed=5),
    Spec("bert-mean-sqrt-len-dense-identity", "bert", ("mean_sqrt_len_tokens",), dense=((16, "identity", False),),
         normalize=False, max_seq_length=24, seed=6),
    # An e5/INSTRUCTOR-style prompt, left out of the mean (include_prompt false); truncated at 20.
    Spec("bert-mean-prompt-excluded", "bert", ("mean",), include_prompt=False,
         prompts={"query": "query: ", "passage": "passage: "}, default_prompt="query", max_seq_length=20, seed=7),
    # Saved as this sentence-transformers saves: two poolings concatenated, CLS past the excluded
    # prompt, two Dense layers.
    Spec("mpnet-cls-weightedmean-prompt-excluded", "mpnet", ("cls", "weightedmean"),
         dense=((16, "gelu", True), (8, "relu", True)), include_prompt=False,
         prompts={"query": "Represent this query: "}, default_prompt="query", max_seq_length=28, style="st6", seed=8),
)


def assemble(fixture: Path, family: str, into: Path) -> Path:
    folder = into / fixture.name
    shutil.copytree(fixture, folder, ignore=shutil.ignore_patterns("reference.npz", "fixture.json"))
    for name in ENCODER_FILES:
        shutil.copy(FAMILIES / family / name, folder / name)
    return folder


def write_fixture(spec: Spec, tmp: Path) -> Path:
    torch.manual_seed(spec.seed)
    encoder = tmp / f"{spec.name}-encoder"
    encoder.mkdir()
    for name in ENCODER_FILES:
        shutil.copy(FAMILIES / spec.family / name, encoder / name)
    modules: list[torch.nn.Module] = [Transformer(str(encoder), max_seq_length=spec.max_seq_length)]
    modules.append(Pooling(HIDDEN, pooling_mode=spec.pooling if len(spec.pooling) > 1 else spec.pooling[0],
                           include_prompt=spec.include_prompt))
    width = HIDDEN * len(spec.pooling)
    for out, act, bias in spec.dense:
        dense = Dense(width, out, bias=bias, activation_function=ACTIVATIONS[act]())
        with torch.no_grad():  # a wider spread than nn.Linear's init, so a wrong layer shows
            dense.linear.weight.copy_(0.4 * torch.randn(out, width))
            if bias:
                dense.linear.bias.copy_(0.2 * torch.randn(out))
        modules.append(dense)
        width = out
    if spec.normalize:
        modules.append(Normalize())
    model = SentenceTransformer(modules=modules, prompts=spec.prompts or None,
                                default_prompt_name=spec.default_prompt, similarity_fn_name=spec.similarity)
    saved = tmp / f"{spec.name}-saved"
    model.save(str(saved))
    out_dir = HERE / spec.name
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir()
    for path in sorted(saved.rglob("*")):
        rel = path.relative_to(saved)
        encoder_file = rel.parent == Path(".") and rel.name in (*ENCODER_FILES, "README.md")
        if path.is_dir() or encoder_file:
            continue
        (out_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, out_dir / rel)
    if spec.style == "legacy":
        legacy(spec, out_dir)
    else:
        # The saved tokenizer_config.json names the tokenizer class's default unknown token
        # (MPNet's "[UNK]"); the fixture's tiny vocabulary has its own.
        tok_cfg = json.loads((out_dir / "tokenizer_config.json").read_text())
        tok_cfg["unk_token"] = json.loads((FAMILIES / spec.family / "tokenizer.json").read_text())["model"]["unk_token"]
        (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, sort_keys=True) + "\n")
    (out_dir / "fixture.json").write_text(json.dumps({"transformer": spec.family}, indent=1) + "\n")
    return out_dir


def legacy(spec: Spec, folder: Path) -> None:
    """The files as the hub's (older) sentence-transformers models have them."""
    mods = json.loads((folder / "modules.json").read_text())
    for m in mods:
        m["type"] = LEGACY_TYPES[m["type"].rsplit(".", 1)[-1]]
    (folder / "modules.json").write_text(json.dumps(mods, indent=2) + "\n")
    pool = {"word_embedding_dimension": HIDDEN, **{flag: mode in spec.pooling for mode, flag in LEGACY_FLAGS.items()},
            "include_prompt": spec.include_prompt}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pool, indent=2) + "\n")
    (folder / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": spec.max_seq_length, "do_lower_case": False}, indent=2) + "\n")
    (folder / "tokenizer_config.json").unlink(missing_ok=True)
    for m in mods:  # the old Normalize folder holds nothing
        if m["type"].endswith("Normalize"):
            shutil.rmtree(folder / m["path"], ignore_errors=True)


def reference(spec: Spec, folder: Path, tmp: Path) -> dict[str, float]:
    assembled = assemble(folder, spec.family, tmp / "assembled")
    model = SentenceTransformer(str(assembled), device="cpu", model_kwargs={"dtype": torch.float32})
    assert model.max_seq_length == spec.max_seq_length, model.max_seq_length
    prompt = model.prompts.get(spec.default_prompt, "") if spec.default_prompt else ""
    features = model.preprocess([prompt + t for t in TEXTS])
    mask = features["attention_mask"].numpy().astype(bool)
    ids = [row[m] for row, m in zip(features["input_ids"].numpy(), mask)]
    vectors = model.encode(TEXTS, batch_size=4, convert_to_numpy=True)  # the default prompt applies
    flat = np.concatenate(ids).astype(np.int64)
    offsets = np.cumsum([0] + [len(r) for r in ids])
    np.savez_compressed(folder / "reference.npz", texts=np.asarray(TEXTS), ids=flat, offsets=offsets,
                        vectors=vectors.astype(np.float32), prompt=np.asarray(prompt))
    norms = np.linalg.norm(vectors, axis=1)
    return {"dim": int(vectors.shape[1]), "norm_min": float(norms.min()), "norm_max": float(norms.max()),
            "tokens_max": int(max(len(r) for r in ids))}


def main() -> None:
    made = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for spec in SPECS:
            folder = write_fixture(spec, tmp)
            made[spec.name] = reference(spec, folder, tmp)
            print(spec.name, made[spec.name])
    versions = {"python": sys.version.split()[0], "torch": torch.__version__,
                "transformers": transformers.__version__, "sentence_transformers": sentence_transformers.__version__,
                "numpy": np.__version__, "fixtures": made,
                "command": " ".join([Path(sys.executable).name, *sys.argv])}
    (HERE / "versions.json").write_text(json.dumps(versions, indent=1) + "\n")


if __name__ == "__main__":
    main()
