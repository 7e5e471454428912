"""int8 study: every quantization variant of engines/quantize_int8.py against the fp32 graph.

    .venv/bin/python -m benchmarks.int8_study --json benchmarks/results/int8/int8.json \
        --markdown benchmarks/results/int8/int8.md

Quality, on `--n` (5,000) distinct real queries (TREC 2005 efficiency, file order):
- cosine of each int8 vector to its fp32 vector: mean, 1st percentile, minimum;
- recall@10: for each query, the share of its 10 nearest fp32 neighbours (among the same
  queries, itself excluded) that are among its 10 nearest int8 neighbours, averaged;
- the golden rows' cosine to the sentence-transformers reference (minimum over 224 rows).
Gate (issue 13): mean >= 0.995, p1 >= 0.98, recall@10 >= 0.95, golden min >= 0.99.

Speed: int8/fp32 keywords/s through the worker's real Bucketer (cpu profile, the worker's
default dispatch), `--speed-n` queries per pass, the two graphs alternating in one run, paired
ratio per round (median, q1-q3). Tokenisation is done once, outside the timings.

Static variants are calibrated on `--calib-n` other distinct queries of the same file (its last
ones, disjoint from the evaluated ones), tokenized as the worker does, in batches sorted by
length and padded to their longest item.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from engines.onnx_export.export import ensure_onnx
from engines.quantize_int8 import Int8Variant, QuantizeError, quantize, quantized_op_counts
from worker.core.profiles import load_profile
from worker.backends.onnxruntime import OnnxRuntimeBackend
from worker.batching.padding import pad_batch
from worker.benchmark.inputs import read_queries
from worker.benchmark.policies import BucketerOptions, run_bucketed
from worker.benchmark.report import quartiles
from worker.embedder import Embedder
from worker.intake.tokenize import Encoded

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_QUERIES = ROOT.parent / "shared" / "data" / "queries" / "terabyte05-efficiency.tsv"
GOLDEN = ROOT / "tests" / "data" / "golden"
GATE = {"mean": 0.995, "p1": 0.98, "recall10": 0.95, "golden_min": 0.99}

VARIANTS = [
    Int8Variant("dynamic, per-tensor (ORT default)", "dynamic"),
    Int8Variant("dynamic, per-channel", "dynamic", per_channel=True),
    Int8Variant("dynamic, per-channel, reduce_range", "dynamic", per_channel=True, reduce_range=True),
    Int8Variant("dynamic, per-channel, u8 weights", "dynamic", per_channel=True, weight_unsigned=True),
    Int8Variant("dynamic, per-channel, preprocessed, sensitive fp32", "dynamic", per_channel=True,
                preprocess=True, exclude="sensitive"),
    Int8Variant("dynamic, per-channel, preprocessed, sensitive + FFN-out fp32", "dynamic", per_channel=True,
                preprocess=True, exclude="sensitive+ffn-out"),
    Int8Variant("dynamic, per-channel, only Q/K/attention-out int8 (measured)", "dynamic", per_channel=True,
                exclude="measured"),
    Int8Variant("static QDQ minmax, per-channel, attention products fp32", "static", per_channel=True,
                exclude="attn-act"),
    Int8Variant("static QDQ minmax, per-channel, preprocessed, sensitive fp32", "static", per_channel=True,
                preprocess=True, exclude="sensitive"),
    Int8Variant("static QDQ percentile 99.999, per-channel, preprocessed, sensitive fp32", "static",
                per_channel=True, preprocess=True, exclude="sensitive", calibration="percentile"),
    Int8Variant("static QDQ percentile 99.999, per-channel, preprocessed, sensitive + FFN-out fp32", "static",
                per_channel=True, preprocess=True, exclude="sensitive+ffn-out", calibration="percentile"),
    Int8Variant("static QDQ entropy, per-channel, preprocessed, sensitive fp32", "static",
                per_channel=True, preprocess=True, exclude="sensitive", calibration="entropy"),
    Int8Variant("static QDQ minmax, per-channel, only Q/K/attention-out int8 (measured)", "static",
                per_channel=True, preprocess=True, exclude="measured"),
]


def distinct(texts: list[str]) -> list[str]:
    seen: set[str] = set()
    out = []
    for t in texts:
        if t not in seen:
            seen.add(t)
            out.append(t)
    return out


def calibration_batches(encoded: list[Encoded], batch: int = 32) -> list[tuple[np.ndarray, np.ndarray]]:
    """Full batches of `batch`, all padded to the longest calibration query.

    One shape for every batch: ORT's histogram calibrators (entropy, percentile) stack the
    collected tensors and fail on ragged shapes. The padded positions' activations enter the
    ranges, as they do at run time in a padded batch.
    """
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i].ids))
    longest = max(len(e.ids) for e in encoded)
    return [pad_batch([encoded[i].ids for i in order[lo:lo + batch]], longest)
            for lo in range(0, len(order) - batch + 1, batch)]


def knn(vectors: np.ndarray, k: int = 10) -> np.ndarray:
    sims = vectors @ vectors.T
    np.fill_diagonal(sims, -np.inf)
    idx = np.argpartition(-sims, k, axis=1)[:, :k]
    return idx


def quality(ref: np.ndarray, ref_nn: np.ndarray, vec: np.ndarray, golden_ref: np.ndarray,
            golden_vec: np.ndarray) -> dict[str, float]:
    cos = (ref * vec).sum(1) / (np.linalg.norm(ref, axis=1) * np.linalg.norm(vec, axis=1))
    nn = knn(vec)
    recall = np.mean([len(set(a) & set(b)) / len(a) for a, b in zip(ref_nn, nn)])
    gcos = (golden_ref * golden_vec).sum(1) / (np.linalg.norm(golden_ref, axis=1) * np.linalg.norm(golden_vec, axis=1))
    return {"mean": float(cos.mean()), "p1": float(np.percentile(cos, 1)), "min": float(cos.min()),
            "recall10": float(recall), "golden_min": float(gcos.min()), "golden_mean": float(gcos.mean())}


def passes(q: dict[str, float]) -> bool:
    return all(q[k] >= v for k, v in GATE.items())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--queries", default=str(DEFAULT_QUERIES))
    ap.add_argument("--n", type=int, default=5000, help="distinct queries evaluated")
    ap.add_argument("--calib-n", type=int, default=512, help="distinct queries for static calibration")
    ap.add_argument("--speed-n", type=int, default=3000, help="queries per speed pass")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--intra-op-threads", type=int, default=0)
    ap.add_argument("--dispatchers", type=int, default=1)
    ap.add_argument("--only", nargs="*", help="substrings of variant names to run")
    ap.add_argument("--workdir", default=None, help="keep the int8 graphs here (default: a temp dir)")
    ap.add_argument("--scan", action="store_true",
                    help="instead of the variants: dynamic per-channel int8 on one group of MatMuls (or one "
                         "layer) at a time, the rest fp32, quality only")
    ap.add_argument("--json")
    ap.add_argument("--markdown")
    args = ap.parse_args(argv)

    texts = distinct([t for _, t in read_queries(args.queries)])
    if len(texts) < args.n + args.calib_n:
        raise SystemExit(f"{args.queries}: {len(texts)} distinct queries, need {args.n + args.calib_n}")
    eval_texts, calib_texts = texts[:args.n], texts[-args.calib_n:]
    golden_rows = [json.loads(line) for line in (GOLDEN / "dev.jsonl").read_text(encoding="utf-8").splitlines()]
    golden_ref = np.load(GOLDEN / "dev.npy")

    fp32_path = ensure_onnx()
    fp32 = Embedder(onnx_path=fp32_path, cache_bytes=0, intra_op_threads=args.intra_op_threads)
    tok = fp32.tokenizer
    enc_eval = tok.encode(eval_texts)
    enc_golden = tok.encode([r["text"] for r in golden_rows])
    calib = calibration_batches(tok.encode(calib_texts))
    ref = fp32.embed_encoded(enc_eval)
    ref_nn = knn(ref)
    fp32_golden = fp32.embed_encoded(enc_golden)
    base = quality(ref, ref_nn, ref, golden_ref, fp32_golden)
    print(f"fp32: golden min {base['golden_min']:.6f}", flush=True)
    fp32.close()

    if args.scan:
        return scan(args, fp32_path, ref, ref_nn, golden_ref, enc_eval, enc_golden)
    profile = load_profile("cpu", model_max_len=tok.max_len)
    speed_enc = enc_eval[:args.speed_n]
    fp32_backend = OnnxRuntimeBackend(fp32_path, intra_op_threads=args.intra_op_threads)

    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="kwe-int8-"))
    rows: list[dict[str, Any]] = []
    variants = [v for v in VARIANTS if not args.only or any(s in v.name for s in args.only)]
    for n, variant in enumerate(variants):
        path = workdir / f"variant{n}.onnx"
        row: dict[str, Any] = {"variant": variant.name, "recipe": {k: v for k, v in vars(variant).items()
                                                                   if k not in ("name", "extra")}}
        t0 = time.perf_counter()
        try:
            quantize(fp32_path, path, variant, calib)
        except QuantizeError as exc:
            row["error"] = str(exc)
            rows.append(row)
            print(f"{variant.name}: FAILED {exc}", flush=True)
            continue
        row["build_s"] = time.perf_counter() - t0
        row["ops"] = quantized_op_counts(path)
        with Embedder(onnx_path=path, cache_bytes=0, intra_op_threads=args.intra_op_threads) as emb:
            vec = emb.embed_encoded(enc_eval)
            gvec = emb.embed_encoded(enc_golden)
        row["quality"] = quality(ref, ref_nn, vec, golden_ref, gvec)
        row["gate"] = passes(row["quality"])
        backend = OnnxRuntimeBackend(path, intra_op_threads=args.intra_op_threads)
        # Warm both (arenas, pages), then alternate which goes first.
        for b in (fp32_backend, backend):
            run_bucketed(speed_enc[:500], profile, b, options=BucketerOptions(dispatchers=args.dispatchers))
        ratios, kws = [], {"fp32": [], "int8": []}
        for r in range(args.rounds):
            order = [("fp32", fp32_backend), ("int8", backend)]
            if r % 2:
                order.reverse()
            got = {}
            for name, b in order:
                run = run_bucketed(speed_enc, profile, b, options=BucketerOptions(dispatchers=args.dispatchers))
                got[name] = run.keywords_per_s
                kws[name].append(run.keywords_per_s)
            ratios.append(got["int8"] / got["fp32"])
        backend.close()
        row["speed"] = {"int8_over_fp32": quartiles(ratios), "ratios": ratios, "keywords_per_s": kws}
        rows.append(row)
        q = row["quality"]
        print(f"{variant.name}: mean {q['mean']:.4f} p1 {q['p1']:.4f} min {q['min']:.4f} "
              f"recall@10 {q['recall10']:.3f} golden {q['golden_min']:.4f} speed x{np.median(ratios):.2f} "
              f"gate {'PASS' if row['gate'] else 'fail'}", flush=True)

    report = {
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]),
        "queries": args.queries, "n": args.n, "calib_n": args.calib_n, "speed_n": args.speed_n,
        "rounds": args.rounds, "intra_op_threads": args.intra_op_threads, "dispatchers": args.dispatchers,
        "gate": GATE, "fp32": base, "variants": rows,
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version(),
                 "onnxruntime": __import__("onnxruntime").__version__},
    }
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    if args.markdown:
        Path(args.markdown).write_text(render(report), encoding="utf-8")
    return 0


SCAN_GROUPS = {"query": ".attention.self.query.", "key": ".attention.self.key.",
               "value": ".attention.self.value.", "attention output": ".attention.output.dense.",
               "FFN in (intermediate)": ".intermediate.dense.", "FFN out": "0.output.dense|1.output.dense|"
               "2.output.dense|3.output.dense|4.output.dense|5.output.dense"}


def scan(args: argparse.Namespace, fp32_path: Path, ref: np.ndarray, ref_nn: np.ndarray, golden_ref: np.ndarray,
         enc_eval: list[Encoded], enc_golden: list[Encoded]) -> int:
    import re

    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    from engines.quantize_int8 import matmul_names

    names = matmul_names(onnx.load(str(fp32_path)))
    linear = [n for n in names if not re.search(r"\.(qk|ctx)_\d+", n)]
    layers = sorted({int(m.group(1)) for n in linear if (m := re.search(r"encoder\.layer\.(\d+)\.", n))})
    groups = {f"{g} (all layers)": [n for n in linear if re.search(p.replace(".", r"\."), n)]
              for g, p in SCAN_GROUPS.items()}
    groups.update({f"layer {i} (all its linear MatMuls)": [n for n in linear if f"encoder.layer.{i}." in n]
                   for i in layers})
    groups["query + key + attention output (the shipped recipe)"] = [
        n for n in linear if any(k in n for k in (".self.query.", ".self.key.", ".attention.output.dense."))]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, quantized in groups.items():
            path = Path(tmp) / "scan.onnx"
            quantize_dynamic(str(fp32_path), str(path), per_channel=True, weight_type=QuantType.QInt8,
                             op_types_to_quantize=["MatMul"], nodes_to_exclude=[n for n in names if n not in quantized])
            with Embedder(onnx_path=path, cache_bytes=0, intra_op_threads=args.intra_op_threads) as emb:
                q = quality(ref, ref_nn, emb.embed_encoded(enc_eval), golden_ref, emb.embed_encoded(enc_golden))
            rows.append({"int8": label, "matmuls": len(quantized), "quality": q, "gate": passes(q)})
            print(f"{label}: mean {q['mean']:.4f} p1 {q['p1']:.4f} recall@10 {q['recall10']:.3f} "
                  f"golden {q['golden_min']:.4f}", flush=True)
    command = "python " + " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:])
    if args.json:
        Path(args.json).write_text(json.dumps({"command": command, "n": args.n, "rows": rows}, indent=2) + "\n",
                                   encoding="utf-8")
    if args.markdown:
        lines = ["# int8 sensitivity scan (issue 13)", "", f"`{command}`", "",
                 f"Dynamic per-channel int8 on the listed MatMuls only, every other MatMul fp32; {args.n:,} distinct "
                 "TREC 2005 efficiency queries against fp32 (recall@10 among those queries), golden rows against "
                 "sentence-transformers. Quality only.", "",
                 "| int8 | MatMuls | mean cos | p1 | recall@10 | golden min | gate |", "|---|---:|---:|---:|---:|---:|---|"]
        for r in rows:
            q = r["quality"]
            lines.append(f"| {r['int8']} | {r['matmuls']} | {q['mean']:.4f} | {q['p1']:.4f} | {q['recall10']:.3f} | "
                         f"{q['golden_min']:.4f} | {'pass' if r['gate'] else 'fail'} |")
        Path(args.markdown).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return 0


def render(report: dict[str, Any]) -> str:
    g = report["gate"]
    lines = [
        "# int8 variants against fp32 (issue 13)",
        "",
        f"`{report['command']}`",
        "",
        f"{report['n']:,} distinct TREC 2005 efficiency queries (file order); static variants calibrated on "
        f"{report['calib_n']} other distinct queries of the same file. Speed: keywords/s through the worker's "
        f"Bucketer (`cpu` profile, {report['dispatchers']} dispatcher, intra_op_threads "
        f"{report['intra_op_threads']}), {report['speed_n']:,} queries per pass, fp32 and int8 alternating, "
        f"{report['rounds']} rounds, paired ratio median (q1-q3). ONNX Runtime "
        f"{report['host']['onnxruntime']}, {report['host']['cpus']} shared cores: absolute speeds are noisy, "
        "the paired ratio is the number to read.",
        "",
        f"Gate: mean cosine >= {g['mean']}, 1st percentile >= {g['p1']}, recall@10 of the fp32 neighbours >= "
        f"{g['recall10']}, golden rows' cosine to sentence-transformers >= {g['golden_min']} (minimum over 224 rows).",
        "",
        "| variant | int8 MatMuls | mean cos | p1 | min | recall@10 | golden min | int8/fp32 speed | gate |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in report["variants"]:
        if "error" in row:
            lines.append(f"| {row['variant']} | | | | | | | | error: {row['error'][:80]} |")
            continue
        q, s, ops = row["quality"], row["speed"]["int8_over_fp32"], row["ops"]
        n_int8 = ops.get("MatMulInteger", 0) + ops.get("QLinearMatMul", 0)
        if not n_int8:  # QDQ: a MatMul fed by DequantizeLinear runs as int8 after ORT's fusion
            n_int8 = f"{ops.get('DequantizeLinear', 0)} DQ"
        lines.append(f"| {row['variant']} | {n_int8} | {q['mean']:.4f} | {q['p1']:.4f} | {q['min']:.4f} | "
                     f"{q['recall10']:.3f} | {q['golden_min']:.4f} | {s['median']:.2f} ({s['q1']:.2f}-{s['q3']:.2f}) "
                     f"| {'**pass**' if row['gate'] else 'fail'} |")
    f = report["fp32"]
    lines += ["", f"fp32 itself: golden min cosine {f['golden_min']:.6f}.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
