"""`keyword-embedder embed`: embed texts offline (no Kafka) and print or save the vectors (a sparse
model's as {"indices", "values"}, its non-zero weights, as the worker writes them)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from worker.formats.keyword_files import FORMATS, KeywordFileError, read_keywords


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("texts", nargs="*", metavar="TEXT", help="Texts to embed (ids 1..N).")
    parser.add_argument("--input", type=Path, help="id<TAB>text TSV, one text per line, or JSONL (.jsonl).")
    parser.add_argument("--format", choices=FORMATS, default="auto")
    parser.add_argument("--output", type=Path, help="Write JSON lines here and print a summary instead.")
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--onnx", type=Path, default=None, help="ONNX file (default: the cached export).")
    parser.add_argument("--threads", type=int, default=0, help="ONNX Runtime intra-op threads (0: all cores).")
    parser.add_argument("--backend", choices=("auto", "onnxruntime", "openvino"), default="auto",
                        help="auto: the CPU backend measured fastest here that passes the fp32 parity gate (cached); "
                             "openvino needs the openvino extra.")
    parser.add_argument("--openvino-precision", choices=("bf16", "f32"), default="bf16",
                        help="Arithmetic of --backend openvino.")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--fused", action="store_true",
                        help="Use the offline-fused export instead of the plain one (see benchmarks/results/backends/ort_grid.md).")
    parser.add_argument("--precision", choices=("fp32", "int8"), default="fp32",
                        help="int8: the quantized graph (benchmarks/results/int8/int8.md), cached beside the fp32 one.")
    parser.add_argument("--cache-bytes", type=int, default=None,
                        help="Byte bound of the embedding cache (repeats are embedded once); 0 turns it off.")
    parser.add_argument("--prompt", default=None, help="Literal prefix put before every text (e.g. 'query: ').")
    parser.add_argument("--prompt-name", default="auto",
                        help="A prompt by name from the model's config_sentence_transformers.json; 'auto': its "
                             "default_prompt_name; 'none': no prompt.")
    parser.add_argument("--truncate-dim", type=int, default=None,
                        help="Keep the first N dimensions and renormalise (models trained for it only).")
    parser.add_argument("--sparse-top-k", type=int, default=0,
                        help="Sparse models: keep each text's k largest weights (0: every non-zero one).")
    parser.add_argument("--sparse-min-weight", type=float, default=0.0,
                        help="Sparse models: leave out weights below this (0: every non-zero one).")


def main(args: argparse.Namespace) -> int:
    items = [(str(i), t) for i, t in enumerate(args.texts, 1)]
    if args.input is not None:
        try:
            items.extend(read_keywords(args.input, args.format))
        except KeywordFileError as exc:
            print(f"keyword-embedder embed: {args.input}: {exc}", file=sys.stderr)
            return 2
    if not items:
        print("keyword-embedder embed: nothing to embed (give TEXT arguments or --input FILE)", file=sys.stderr)
        return 2

    from worker.core.errors import KeywordEmbedderError
    from worker.core.vectors import truncate
    from worker.embedder import Embedder

    try:
        embedder = Embedder(args.model_dir, onnx_path=args.onnx, intra_op_threads=args.threads,
                            batch_size=args.batch_size, optimize=args.fused, precision=args.precision,
                            prompt=args.prompt, prompt_name=args.prompt_name, truncate_dim=args.truncate_dim,
                            backend=args.backend, openvino_precision=args.openvino_precision,
                            sparse_top_k=args.sparse_top_k, sparse_min_weight=args.sparse_min_weight,
                            **({} if args.cache_bytes is None else {"cache_bytes": args.cache_bytes}))
    except KeywordEmbedderError as exc:  # the model, its export, the backend or an option
        print(f"keyword-embedder embed: {exc}", file=sys.stderr)
        return 1
    started = time.perf_counter()
    encoded = embedder.tokenizer.encode([text for _, text in items])
    vectors: Any
    if embedder.sparse:
        vectors = [{"indices": row.indices, "values": row.values}
                   for row in embedder.embed_sparse_encoded(encoded).rows()]
    else:
        vectors = truncate(embedder.embed_encoded(encoded), embedder.truncate_dim)
    elapsed = time.perf_counter() - started

    out = args.output.open("wb") if args.output is not None else sys.stdout.buffer
    try:
        for (qid, text), enc, vec in zip(items, encoded, vectors, strict=True):
            out.write(orjson.dumps({"id": qid, "text": text, "tokens": enc.length, "truncated": enc.truncated,
                                    "embedding": vec}, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
    finally:
        if args.output is not None:
            out.close()
    if args.output is not None:
        tokens = sum(len(e.ids) for e in encoded)
        print(f"embedded {len(items)} texts ({tokens} tokens, {sum(e.truncated for e in encoded)} truncated at "
              f"{embedder.max_len}) with {embedder.model_name} "
              f"({'sparse' if embedder.sparse else f'{embedder.dim}-d'}) in {elapsed:.2f}s "
              f"-> {args.output}")
    return 0
