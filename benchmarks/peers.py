"""Peer benchmark: FastEmbed vs our offline Embedder vs our bucketed stream, and the CPU ceiling.

    pip install -e '.[peers]'          # fastembed; never part of the worker's install
    .venv/bin/python -m benchmarks.peers --json benchmarks/results/peers/peers.json \
        --markdown benchmarks/results/peers/peers.md

Same ONNX weights for all three: FastEmbed gets a local model folder (no hub download) whose
graph is our export cut before pooling, so it returns `last_hidden_state` and FastEmbed does
its own mean pooling and normalisation. Each round runs, in rotating order, on the same
queries (the first `--n` TREC 2005 efficiency queries, repeats included, the cache off: this
compares the model path; the cache is measured in benchmarks/cache_bench.py):
- fastembed: `TextEmbedding.embed(texts)` with its defaults (batch 256, ORT's threads);
- embedder: `Embedder(cache_bytes=0, backend=--backend).embed(texts)` (sorted by length,
  tokenisation included); `--backend auto` (the worker's default) measures ONNX Runtime and
  OpenVINO at start-up and keeps the faster that passes the fp32 gate (worker/backend_choice/auto.py);
  the stream and the ceiling then run on that same choice;
- bucketed: the worker's path offline: tokenize, then the real Bucketer (`cpu` profile) fed in
  file order through the max_in_flight window (tokenisation timed too);
- ceiling: the backend alone at the best (batch, length, thread layout) found by a grid search
  at the start, every token real; `bucketed` real tokens/s as a fraction of it, paired per round.
Ratios are per round (paired), median and q1-q3. The vectors are compared: the minimum cosine
between FastEmbed's and ours, and between the stream's and the Embedder's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from engines.onnx_export.export import default_cache_dir, ensure_onnx
from worker.core.model import ModelInfo, default_model_dir
from worker.core.profiles import load_profile
from worker.backend_choice.select import open_backend
from worker.backends.base import Backend
from worker.benchmark.inputs import read_queries
from worker.benchmark.policies import BucketerOptions, run_bucketed
from worker.benchmark.report import quartiles
from worker.benchmark.suite import round_order
from worker.embedder import Embedder

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_QUERIES = ROOT.parent / "shared" / "data" / "queries" / "terabyte05-efficiency.tsv"
FASTEMBED_NAME = "keyword-embedder/all-MiniLM-L6-v2-local"
TOKENIZER_FILES = ("tokenizer.json", "special_tokens_map.json", "config.json", "vocab.txt")


# --------------------------------------------------------------------------- FastEmbed
def cut_before_pooling(onnx_path: Path, output: Path) -> Path:
    """Our export with the pooling and normalisation removed: outputs last_hidden_state [B, L, H]."""
    model = onnx.load(str(onnx_path))
    produced = {o: n for n in model.graph.node for o in n.output}
    # The pooling starts with hidden_states * mask; its float input from a LayerNormalization is
    # the encoder's last hidden state.
    pool = next(n for n in model.graph.node if n.name.startswith("masked_states"))
    hidden = next(i for i in pool.input if i in produced and produced[i].op_type == "LayerNormalization")
    onnx.utils.extract_model(str(onnx_path), str(output), ["input_ids", "attention_mask"], [hidden])
    cut = onnx.load(str(output))
    cut.graph.node.append(onnx.helper.make_node("Identity", [hidden], ["last_hidden_state"]))
    old = cut.graph.output[0]
    cut.graph.output.remove(old)
    cut.graph.output.append(onnx.helper.make_tensor_value_info("last_hidden_state", onnx.TensorProto.FLOAT,
                                                               ["batch", "seq", ModelInfo.from_dir(
                                                                   default_model_dir()).dim]))
    onnx.save(cut, str(output))
    return output


def fastembed_folder(model_dir: Path, onnx_path: Path, out: Path, max_len: int) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(model_dir / name, out / name)
    # FastEmbed truncates at tokenizer_config's model_max_length (512 in the package); the
    # reference, and our worker, at sentence-transformers' max_seq_length.
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    cfg["model_max_length"] = max_len
    (out / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    cut_before_pooling(onnx_path, out / "model.onnx")
    return out


def make_fastembed(folder: Path, threads: int | None):  # noqa: ANN201 (optional dependency)
    from fastembed import TextEmbedding
    from fastembed.common.model_description import ModelSource, PoolingType

    if FASTEMBED_NAME not in {m["model"] for m in TextEmbedding.list_supported_models()}:
        TextEmbedding.add_custom_model(model=FASTEMBED_NAME, pooling=PoolingType.MEAN, normalization=True,
                                       sources=ModelSource(hf=FASTEMBED_NAME), dim=384, model_file="model.onnx")
    return TextEmbedding(FASTEMBED_NAME, specific_model_path=str(folder), threads=threads)


# --------------------------------------------------------------------------- the ceiling
def tokens_per_s(backend: Backend, batch: int, length: int, contexts: int, min_s: float) -> float:
    """Real tokens/s of `contexts` threads each calling the backend on [batch, length] (all real)."""
    rng = np.random.default_rng(batch * 1000 + length)
    ids = rng.integers(1000, 29000, (batch, length), dtype=np.int64)
    ids[:, 0], ids[:, -1] = 101, 102
    mask = np.ones_like(ids)
    # One inference context per thread, as the worker's dispatchers have (OpenVINO runs only
    # through a context; ONNX Runtime's are cheap views of its one session).
    ctxs = [backend.create_context(t) for t in range(contexts)]
    for ctx in ctxs:
        ctx.run(ids, mask)  # warm this shape
    calls = [0] * contexts
    stop = threading.Event()

    def loop(t: int) -> None:
        while not stop.is_set():
            ctxs[t].run(ids, mask)
            calls[t] += 1

    threads = [threading.Thread(target=loop, args=(t,)) for t in range(contexts)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(min_s)
    stop.set()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    for ctx in ctxs:
        ctx.close()
    return sum(calls) * batch * length / elapsed


def ceiling_grid(open_ours: Callable[[int], Backend], batches: list[int], lengths: list[int], min_s: float
                 ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    cores = os.cpu_count() or 1
    layouts = [(1, 0)] + ([(cores, 1)] if cores > 1 else [])  # (contexts, intra-op threads each)
    cells = []
    for contexts, threads in layouts:
        backend = open_ours(threads)
        for b in batches:
            for length in lengths:
                tps = max(tokens_per_s(backend, b, length, contexts, min_s) for _ in range(2))
                cells.append({"contexts": contexts, "intra_op_threads": threads, "batch": b, "length": length,
                              "tokens_per_s": tps})
                print(f"ceiling grid {contexts}x{threads} threads [{b}, {length}]: {tps:,.0f} tokens/s", flush=True)
        backend.close()
    best = max(cells, key=lambda c: c["tokens_per_s"])
    return cells, best


# --------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--queries", default=str(DEFAULT_QUERIES))
    ap.add_argument("--n", type=int, default=10000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--backend", choices=("auto", "onnxruntime", "openvino"), default="auto",
                    help="our backend (auto: the worker's default, measured at start-up)")
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads for ours (0: all cores)")
    ap.add_argument("--dispatchers", type=int, default=1, help="bucketed stream dispatchers (worker default 1)")
    ap.add_argument("--fastembed-threads", type=int, default=None, help="FastEmbed threads (default: its own)")
    ap.add_argument("--grid-batches", default="16,32,64,128,256")
    ap.add_argument("--grid-lengths", default="8,12,16,32")
    ap.add_argument("--grid-seconds", type=float, default=0.4)
    ap.add_argument("--json")
    ap.add_argument("--markdown")
    args = ap.parse_args(argv)

    texts = [t for _, t in read_queries(args.queries, limit=args.n)]
    model_dir = default_model_dir()
    onnx_path = ensure_onnx(model_dir)
    embedder = Embedder(model_dir, onnx_path=onnx_path, cache_bytes=0, intra_op_threads=args.threads,
                        backend=args.backend)
    if embedder.backend_choice is not None:
        kind, ov_precision = embedder.backend_choice.candidate.backend, embedder.backend_choice.candidate.ov_precision
        ours = embedder.backend_choice.candidate.label
    else:
        kind, ov_precision = args.backend, "bf16"
        ours = "onnxruntime/fp32" if kind == "onnxruntime" else "openvino/bf16"
    print(f"ours: --backend {args.backend} -> {ours}", flush=True)

    def open_ours(threads: int) -> Backend:
        return open_backend(kind, embedder.info, onnx_path=onnx_path, intra_op_threads=threads,
                            openvino_precision=ov_precision)

    folder = fastembed_folder(model_dir, onnx_path, default_cache_dir() / "fastembed-minilm", embedder.max_len)
    fe = make_fastembed(folder, args.fastembed_threads)
    backend = open_ours(args.threads)
    profile = load_profile("cpu", model_max_len=embedder.max_len)

    cells, best = ceiling_grid(open_ours, [int(x) for x in args.grid_batches.split(",")],
                               [int(x) for x in args.grid_lengths.split(",")], args.grid_seconds)
    ceil_backend = open_ours(best["intra_op_threads"])

    def run_fastembed() -> tuple[float, np.ndarray, int]:
        t0 = time.perf_counter()
        vec = np.stack(list(fe.embed(texts)))
        return time.perf_counter() - t0, vec, 0

    def run_embedder() -> tuple[float, np.ndarray, int]:
        t0 = time.perf_counter()
        vec = embedder.embed(texts)
        return time.perf_counter() - t0, vec, 0

    def run_stream() -> tuple[float, np.ndarray, int]:
        t0 = time.perf_counter()
        encoded = embedder.tokenizer.encode(texts)
        tok_s = time.perf_counter() - t0
        run = run_bucketed(encoded, profile, backend, options=BucketerOptions(dispatchers=args.dispatchers), keep_embeddings=True)
        stream_runs.append((run.real_tokens, run.seconds))
        return tok_s + run.seconds, run.embeddings, run.real_tokens

    def run_ceiling() -> tuple[float, np.ndarray, int]:
        tps = tokens_per_s(ceil_backend, best["batch"], best["length"], best["contexts"], 2.0)
        return 1.0 / tps, np.zeros(0), 0  # "seconds per token"

    stream_runs: list[tuple[int, float]] = []
    configs = {"fastembed": run_fastembed, "embedder": run_embedder, "bucketed": run_stream, "ceiling": run_ceiling}
    # Warm-up: sessions, arenas, FastEmbed's lazy parts.
    warm = texts[:512]
    list(fe.embed(warm))
    embedder.embed(warm)
    names = list(configs)
    rounds: list[dict[str, float]] = []
    vectors: dict[str, np.ndarray] = {}
    for r in range(args.rounds):
        got: dict[str, float] = {}
        for name in round_order(names, r):
            seconds, vec, _ = configs[name]()
            if name == "ceiling":
                got["ceiling_tokens_per_s"] = 1.0 / seconds
            else:
                got[name] = len(texts) / seconds
                vectors[name] = vec
            if name == "bucketed":
                real, run_s = stream_runs[-1]
                got["bucketed_tokens_per_s"] = real / run_s
            print(f"round {r + 1}/{args.rounds} {name:>10}: " + (
                f"{got['ceiling_tokens_per_s']:,.0f} tokens/s" if name == "ceiling" else f"{got[name]:,.0f} kw/s"),
                flush=True)
        rounds.append(got)

    def cos_min(a: np.ndarray, b: np.ndarray) -> float:
        return float(((a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))).min())

    def paired(num: str, den: str) -> dict[str, float]:
        return quartiles([g[num] / g[den] for g in rounds])

    report = {
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]),
        "queries": args.queries, "n": len(texts), "rounds": rounds,
        "keywords_per_s": {n: quartiles([g[n] for g in rounds]) for n in ("fastembed", "embedder", "bucketed")},
        "ratios": {"embedder/fastembed": paired("embedder", "fastembed"),
                   "bucketed/fastembed": paired("bucketed", "fastembed"),
                   "bucketed/embedder": paired("bucketed", "embedder"),
                   "bucketed tokens/s / ceiling": paired("bucketed_tokens_per_s", "ceiling_tokens_per_s")},
        "cosine_min": {"fastembed vs embedder": cos_min(vectors["fastembed"], vectors["embedder"]),
                       "bucketed vs embedder": cos_min(vectors["bucketed"], vectors["embedder"])},
        "ceiling": {"best": best, "grid": cells},
        "backend": {"setting": args.backend, "chosen": ours,
                    "auto_reason": embedder.backend_choice.reason if embedder.backend_choice else None},
        "settings": {"backend": args.backend, "threads": args.threads, "dispatchers": args.dispatchers,
                     "fastembed_threads": args.fastembed_threads},
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version(),
                 "onnxruntime": __import__("onnxruntime").__version__,
                 "fastembed": __import__("fastembed").__version__, "openvino": _openvino_version()},
    }
    print(json.dumps({k: report[k] for k in ("ratios", "cosine_min")}, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    if args.markdown:
        Path(args.markdown).write_text(render(report), encoding="utf-8")
    return 0


def _openvino_version() -> str | None:
    try:
        import openvino
    except ImportError:
        return None
    return str(openvino.__version__)


def _q(q: dict[str, float], fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(q['median'])} ({fmt.format(q['q1'])}-{fmt.format(q['q3'])})"


def _ours(report: dict[str, Any]) -> str:
    # Results written before --backend existed ran ours on ONNX Runtime fp32.
    b = report.get("backend") or {"setting": "onnxruntime", "chosen": "onnxruntime/fp32"}
    return f"`--backend {b['setting']}` ({b['chosen']})"


def render(report: dict[str, Any]) -> str:
    kw, ra, best = report["keywords_per_s"], report["ratios"], report["ceiling"]["best"]
    lines = [
        "# Peers: FastEmbed vs ours, and the CPU ceiling (issue 13)",
        "",
        f"`{report['command']}`",
        "",
        f"{report['n']:,} TREC 2005 efficiency queries (file order, repeats included, cache off), "
        f"{len(report['rounds'])} rounds in rotating order, same ONNX weights; ours on "
        f"{_ours(report)}; FastEmbed "
        f"{report['host']['fastembed']} (ONNX Runtime), ONNX Runtime {report['host']['onnxruntime']}, "
        f"OpenVINO {report['host'].get('openvino') or 'absent'}, "
        f"{report['host']['cpus']} shared cores (absolute speeds drift; read the paired ratios).",
        "",
        "| configuration | keywords/s, median (q1-q3) |",
        "|---|---:|",
        f"| FastEmbed `TextEmbedding.embed` (defaults) | {_q(kw['fastembed'], '{:,.0f}')} |",
        f"| our `Embedder.embed` (offline, sorted by length) | {_q(kw['embedder'], '{:,.0f}')} |",
        f"| our bucketed stream (tokenize + the worker's Bucketer, file order) | {_q(kw['bucketed'], '{:,.0f}')} |",
        "",
        "| paired ratio | median (q1-q3) |",
        "|---|---:|",
    ]
    for name, q in ra.items():
        lines.append(f"| {name} | {_q(q)} |")
    cm = report["cosine_min"]
    lines += [
        "",
        f"Vectors: minimum cosine FastEmbed vs Embedder {cm['fastembed vs embedder']:.6f}, "
        f"bucketed vs Embedder {cm['bucketed vs embedder']:.6f}.",
        "",
        f"Ceiling: the backend alone, every token real, best cell of the grid: batch {best['batch']} x length "
        f"{best['length']}, {best['contexts']} context(s) x {best['intra_op_threads'] or 'all'} intra-op threads: "
        f"{best['tokens_per_s']:,.0f} tokens/s in the grid search. Our bucketed stream's real tokens/s "
        f"(its own run time, tokenisation excluded) as a fraction of the ceiling measured in the same round: "
        f"{_q(ra['bucketed tokens/s / ceiling'])}.",
        "",
        "| contexts x threads | batch | length | tokens/s |",
        "|---|---:|---:|---:|",
    ]
    for c in sorted(report["ceiling"]["grid"], key=lambda c: -c["tokens_per_s"])[:10]:
        lines.append(f"| {c['contexts']} x {c['intra_op_threads'] or 'all'} | {c['batch']} | {c['length']} | "
                     f"{c['tokens_per_s']:,.0f} |")
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
