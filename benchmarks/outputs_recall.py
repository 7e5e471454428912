"""Retrieval sanity check of the smaller outputs: recall@10 of truncated, int8 and binary vectors.

Real queries are both the corpus and the questions (a keyword's neighbours among other
keywords, which is what a consumer of the output topic searches). The full float32 vectors give
the true top 10 of each question (by cosine, itself excluded); each smaller form gives its own
top 10 and recall@10 is the overlap. Binary ranks by Hamming distance of the packed sign bits,
int8 by the dot product of the dequantised vectors, truncated by cosine of the renormalised
head. Also prints the mean bytes of one output record and of its `embedding` value per
encoding, from the worker's own codec.

    .venv/bin/python -m benchmarks.outputs_recall ../shared/data/queries/terabyte05-efficiency.tsv \
        --corpus 20000 --questions 1000 --json benchmarks/results/outputs/outputs.json

Only meaningful as a sanity check: all-MiniLM-L6-v2 was not trained for Matryoshka truncation.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import orjson

from worker.core.model import ModelInfo, Prompt
from worker.core.vectors import default_int8_range, dequantize_int8, pack_binary, quantize_int8, truncate
from worker.formats.codec_choice import output_codec
from worker.embedder import Embedder
from worker.formats.keyword_files import read_keywords
from worker.settings.schema import Settings

K = 10
_POPCOUNT = np.array([bin(i).count("1") for i in range(256)], dtype=np.uint8)


def top_k(scores: np.ndarray, k: int) -> np.ndarray:
    idx = np.argpartition(-scores, k, axis=1)[:, :k]
    return idx


def recall(truth: np.ndarray, got: np.ndarray) -> float:
    return float(np.mean([len(set(t) & set(g)) / K for t, g in zip(truth, got)]))


def hamming_scores(bits_q: np.ndarray, bits_c: np.ndarray) -> np.ndarray:
    """Negative Hamming distance [Q, C] (higher is nearer), in chunks to bound memory."""
    out = np.empty((len(bits_q), len(bits_c)), dtype=np.int32)
    for i in range(0, len(bits_q), 64):
        x = bits_q[i:i + 64, None, :] ^ bits_c[None, :, :]
        out[i:i + 64] = -_POPCOUNT[x].sum(axis=2, dtype=np.int32)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file", type=Path)
    ap.add_argument("--corpus", type=int, default=20000, help="Distinct queries searched (default 20000).")
    ap.add_argument("--questions", type=int, default=1000, help="Queries asked, drawn from the corpus.")
    ap.add_argument("--truncate-dims", default="256,128", help="Comma-separated truncate_dim values.")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    seen: dict[str, None] = {}
    for _, text in read_keywords(args.file, "auto"):
        seen.setdefault(text.strip().lower(), None)
        if len(seen) >= args.corpus:
            break
    texts = list(seen)
    t0 = time.perf_counter()
    with Embedder(cache_bytes=0) as emb:
        full = emb.embed(texts)
        info: ModelInfo = emb.info
    embed_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    qi = rng.choice(len(texts), size=min(args.questions, len(texts)), replace=False)

    def ranked(q: np.ndarray, c: np.ndarray) -> np.ndarray:
        scores = (q @ c.T).astype(np.float32)
        scores[np.arange(len(qi)), qi] = -np.inf  # a query is not its own neighbour
        return top_k(scores, K)

    truth = ranked(full[qi], full)
    results: dict[str, float] = {}
    for d in (int(x) for x in args.truncate_dims.split(",") if x):
        short = truncate(full, d)
        results[f"truncate-{d}"] = recall(truth, ranked(short[qi], short))
    r = default_int8_range(info.dim)
    deq = dequantize_int8(quantize_int8(full, -r, r), -r, r)
    results["int8"] = recall(truth, ranked(deq[qi], deq))
    bits = pack_binary(full)
    ham = hamming_scores(bits[qi], bits).astype(np.float32)
    ham[np.arange(len(qi)), qi] = -np.inf
    results["binary"] = recall(truth, top_k(ham, K))
    short256 = truncate(full, 256)
    bits256 = pack_binary(short256)
    ham = hamming_scores(bits256[qi], bits256).astype(np.float32)
    ham[np.arange(len(qi)), qi] = -np.inf
    results["truncate-256+binary"] = recall(truth, top_k(ham, K))

    sizes: dict[str, dict[str, float]] = {}
    sample = full[:500]
    for encoding in ("float-list", "base64-f32", "base64-f16", "int8", "binary"):
        codec = output_codec(Settings(output_encoding=encoding), info, Prompt())  # type: ignore[arg-type]
        values = [codec.value(f"q-{i:07d}", row, 6, False) for i, row in enumerate(sample)]
        field = [len(orjson.dumps(orjson.loads(v)["embedding"])) for v in values]
        sizes[encoding] = {"record_bytes": float(np.mean([len(v) for v in values])),
                           "embedding_bytes": float(np.mean(field))}
    base = sizes["float-list"]
    report = {"model": info.name, "dim": info.dim, "file": str(args.file), "corpus": len(texts),
              "questions": len(qi), "k": K, "recall_at_10_vs_float32": results, "sizes": sizes,
              "float_list_over_binary": {"record": base["record_bytes"] / sizes["binary"]["record_bytes"],
                                         "embedding": base["embedding_bytes"] / sizes["binary"]["embedding_bytes"]},
              "int8_range": [-r, r], "embed_seconds": round(embed_s, 1)}
    print(f"{info.name} ({info.dim}-d), {len(texts)} distinct queries from {args.file.name}, {len(qi)} asked")
    print(f"{'form':<22} recall@10 vs float32")
    for name, value in results.items():
        print(f"{name:<22} {value:.3f}")
    print(f"\n{'encoding':<12} {'record bytes':>13} {'embedding bytes':>16}")
    for name, s in sizes.items():
        print(f"{name:<12} {s['record_bytes']:>13.0f} {s['embedding_bytes']:>16.0f}")
    ratio = report["float_list_over_binary"]
    print(f"\nfloat-list / binary: {ratio['embedding']:.1f}x the embedding value, {ratio['record']:.1f}x the record")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
