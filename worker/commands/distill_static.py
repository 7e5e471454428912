"""`keyword-embedder distill-static`: a model2vec-format static model (docs/models.md, Static
models) made from a dense model the worker runs, with the worker's own backend (ONNX Runtime, no
torch), as model2vec 0.10's `distill` makes one:

1. the vocabulary: every token of the teacher's tokenizer, in ID order, less its special tokens
   but the unknown and padding ones (as model2vec's cleaning leaves them) and those matching
   --remove-pattern (model2vec's token_remove_pattern, `[unusedN]` by default);
2. each token alone through the teacher, between the tokenizer's own special tokens ([CLS] t
   [SEP] for BERT), and the mean of the encoder's output over those tokens: model2vec's
   create_embeddings with its default mean pooling, on the encoder itself (the teacher's
   sentence-transformers pooling, Dense layers and Normalize are not applied, as AutoModel does
   not). Every input has the same length, so the pass is batches of one shape (one bucket);
3. PCA to --dim, then each row times its Zipf/SIF weight (worker/core/distill.py);
4. config.json (model_type model2vec, normalize true), model.safetensors (the table under
   "embeddings", float16 as model2vec's default quantize_to), tokenizer.json (the teacher's).

The table keeps the teacher's token IDs: a removed token's row is zero (model2vec renumbers its
tokenizer instead; a text only reaches such a token by spelling it, e.g. "[unused5]").
--evaluate QUERIES then reports recall@10 of nearest neighbours against the teacher.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from worker.core.distill import REMOVE_PATTERN, SIF_COEFFICIENT, neighbour_recall, reduce, token_pattern


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-dir", type=Path, default=None, help="The dense teacher (default: the packaged model).")
    parser.add_argument("--output", type=Path, required=True, help="The folder to write (must not exist, or be empty).")
    parser.add_argument("--dim", type=int, default=256, help="PCA components (model2vec's pca_dims).")
    parser.add_argument("--sif", type=float, default=SIF_COEFFICIENT,
                        help="SIF coefficient of the Zipf weighting (model2vec's sif_coefficient); 0: no weighting.")
    parser.add_argument("--remove-pattern", type=token_pattern, default=token_pattern(REMOVE_PATTERN),
                        help="Tokens matching this regex are left out (model2vec's token_remove_pattern).")
    parser.add_argument("--dtype", choices=("float16", "float32"), default="float16", help="The table's type.")
    parser.add_argument("--batch-size", type=int, default=512, help="Tokens a forward pass.")
    parser.add_argument("--threads", type=int, default=0, help="ONNX Runtime intra-op threads (0: all cores).")
    parser.add_argument("--evaluate", type=Path, default=None,
                        help="id<TAB>text file: report recall@10 of nearest neighbours against the teacher.")


def main(args: argparse.Namespace) -> int:
    if args.dim < 1 or args.batch_size < 1 or not 0 <= args.sif < 1:
        print("keyword-embedder distill-static: --dim and --batch-size must be >= 1, --sif in [0, 1)", file=sys.stderr)
        return 2
    if args.output.exists() and (not args.output.is_dir() or any(args.output.iterdir())):
        print(f"keyword-embedder distill-static: {args.output} exists and is not an empty folder", file=sys.stderr)
        return 2
    started = time.perf_counter()
    stats = distill(args.model_dir, args.output, dim=args.dim, sif=args.sif or None, pattern=args.remove_pattern,
                    dtype=args.dtype, batch_size=args.batch_size, threads=args.threads)
    print(f"distilled {stats['tokens']:,} tokens ({stats['removed']:,} removed) into {stats['shape'][0]:,} x "
          f"{stats['shape'][1]} ({args.dtype}) in {time.perf_counter() - started:.1f}s (the vocabulary pass "
          f"{stats['pass_s']:.1f}s): {args.output}")
    if args.evaluate is not None:
        recall, n = evaluate(args.model_dir, args.output, args.evaluate)
        print(f"recall@10 of nearest neighbours against the teacher on {n:,} distinct texts: {recall:.4f}")
    return 0


def distill(teacher_dir: Path | None, output: Path, *, dim: int = 256, sif: float | None = SIF_COEFFICIENT,
            pattern: re.Pattern[str] | None = re.compile(REMOVE_PATTERN), dtype: str = "float16",
            batch_size: int = 512, threads: int = 0) -> dict[str, object]:
    """Writes the static model distilled from `teacher_dir` to `output`; returns what it did."""
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer

    from engines.onnx_export.export import default_cache_dir, ensure_onnx
    from worker.backends.onnxruntime import OnnxRuntimeBackend
    from worker.core.errors import ModelError
    from worker.core.model import ModelInfo, default_model_dir
    from worker.core.st_pipeline import ModulePipeline

    info = ModelInfo.from_dir(teacher_dir or default_model_dir())
    if info.static is not None or info.sparse:
        raise ModelError(f"{info.model_dir}: distill-static needs a dense encoder as its teacher; this is a "
                         f"{'sparse' if info.sparse else 'static'} model")
    tokenizer = Tokenizer.from_file(str(info.tokenizer_path))
    tokenizer.no_padding()  # a tokenizer.json that pads to a length would put its pads around each token
    tokenizer.no_truncation()
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    size = max(vocab.values()) + 1
    by_id = sorted(vocab.items(), key=lambda kv: kv[1])
    dropped = _dropped_specials(info.tokenizer_path)
    kept = np.array([i for token, i in by_id if token not in dropped and (pattern is None or not pattern.match(token))],
                    dtype=np.int64)
    if not len(kept):
        raise ModelError(f"{info.tokenizer_path}: --remove-pattern leaves no token")
    prefix, suffix = _special_ids(tokenizer)
    # The encoder's mean over [prefix, token, suffix], as model2vec's AutoModel pass: no Normalize,
    # no Dense. Its own ONNX cache folder: the export's cache key does not tell pipelines apart
    # by their steps, only by their files.
    raw = dataclasses.replace(info, pipeline=ModulePipeline(steps=()))
    onnx_path = ensure_onnx(raw, cache_dir=default_cache_dir() / "distill-raw-mean")
    backend = OnnxRuntimeBackend(onnx_path, intra_op_threads=threads)
    context = backend.create_context(0)
    width = len(prefix) + 1 + len(suffix)
    vectors = np.empty((len(kept), backend.dim), dtype=np.float32)
    pass_started = time.perf_counter()
    try:
        for start in range(0, len(kept), batch_size):
            ids = kept[start:start + batch_size]
            batch = np.empty((len(ids), width), dtype=np.int64)
            batch[:, :len(prefix)] = prefix
            batch[:, len(prefix)] = ids
            batch[:, len(prefix) + 1:] = suffix
            vectors[start:start + len(ids)] = context.run(batch, np.ones_like(batch))
    finally:
        context.close()
        backend.close()
    pass_s = time.perf_counter() - pass_started
    reduced = reduce(vectors, dim, sif)
    table = np.zeros((size, reduced.shape[1]), dtype=np.float32)
    table[kept] = reduced
    output.mkdir(parents=True, exist_ok=True)
    save_file({"embeddings": table.astype(dtype)}, str(output / "model.safetensors"))
    shutil.copyfile(info.tokenizer_path, output / "tokenizer.json")
    config = {"model_type": "model2vec", "architectures": ["StaticModel"], "tokenizer_name": info.name,
              "apply_pca": dim, "sif_coefficient": sif, "hidden_dim": int(table.shape[1]), "seq_length": 1000000,
              "normalize": True, "pooling": "mean", "distilled_by": "keyword-embedder distill-static"}
    (output / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return {"tokens": len(kept), "removed": len(by_id) - len(kept), "shape": table.shape, "pass_s": pass_s}


def _dropped_specials(tokenizer_path: Path) -> set[str]:
    """The special tokens model2vec's distill leaves out of the vocabulary: every special added token
    but the unknown and padding tokens (skeletoken's prune_added_tokens and model2vec's cleaning
    keep those two; [CLS], [SEP] and [MASK] go)."""
    tok = json.loads(tokenizer_path.read_text(encoding="utf-8"))
    keep = {(tok.get("model") or {}).get("unk_token"), (tok.get("padding") or {}).get("pad_token")}
    config = tokenizer_path.parent / "tokenizer_config.json"
    if config.is_file():
        pad = json.loads(config.read_text(encoding="utf-8")).get("pad_token")
        keep.add(pad.get("content") if isinstance(pad, dict) else pad)
    model_config = tokenizer_path.parent / "config.json"  # else transformers takes pad_token_id's token
    pad_id = json.loads(model_config.read_text(encoding="utf-8")).get("pad_token_id") if model_config.is_file() else None
    added = tok.get("added_tokens") or []
    keep |= {t.get("content") for t in added if pad_id is not None and t.get("id") == pad_id}
    return {t["content"] for t in added if t.get("special") and t.get("content") not in keep}


def _special_ids(tokenizer: object) -> tuple[list[int], list[int]]:
    """The IDs the tokenizer's post-processor puts before and after a text ([CLS] and [SEP] for BERT)."""
    plain = tokenizer.encode("a", add_special_tokens=False).ids  # type: ignore[attr-defined]
    full = tokenizer.encode("a").ids  # type: ignore[attr-defined]
    for at in range(len(full) - len(plain) + 1):
        if full[at:at + len(plain)] == plain:
            return full[:at], full[at + len(plain):]
    return [], []


def evaluate(teacher_dir: Path | None, student_dir: Path, queries: Path, k: int = 10) -> tuple[float, int]:
    """recall@k of nearest neighbours, student against teacher, over the file's distinct texts."""
    from worker.embedder import Embedder
    from worker.formats.keyword_files import read_keywords

    texts = list(dict.fromkeys(text for _, text in read_keywords(queries, "auto") if text.strip()))
    with Embedder(teacher_dir) as teacher, Embedder(student_dir) as student:
        return neighbour_recall(teacher.embed(texts), student.embed(texts), k), len(texts)
