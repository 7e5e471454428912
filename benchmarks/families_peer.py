"""Peer benchmark of the 2026 families: sentence-transformers against the worker's bucketed path.

    python3 -m venv /tmp/refenv && /tmp/refenv/bin/pip install torch transformers sentence-transformers
    .venv/bin/python -m benchmarks.families_peer --refenv /tmp/refenv/bin/python \
        --families qwen3 gemma3_text modernbert --n 2000 --rounds 5 --json PATH --markdown PATH

For each family, random weights at the real model's shape (Qwen3-Embedding-0.6B,
EmbeddingGemma-300m, gte-modernbert-base; benchmarks/families_peer_st.py builds the
sentence-transformers folder in the throwaway environment, with a tokenizer of the family's kind
trained on `--corpus` less the measured keywords, with a 16,384-token vocabulary instead of the real 150k-260k: the
embedding table is a lookup, the compute is the same). The same folder then runs on the same
CPU, in paired rounds of alternating order, on the first `--n` real keywords of `--queries`
(file order, repeats included):
- st: `SentenceTransformer.encode(texts)` with its defaults (batch 32, sorted by length
  inside, float32, torch's threads), in a process of the throwaway environment started once
  (the model loaded and warmed on a few texts before the rounds; only the encode is timed);
- bucketed: the worker's path offline, as benchmarks/peers.py runs it: tokenize, then the real
  Bucketer (`cpu` profile, stretched to the model's limit) fed in file order through the
  max_in_flight window, on the backend `--backend` picks (auto: the worker's default, measured at
  start-up), the embedding cache off, warmed on WARM_UP texts first.
While one side runs the other waits. Reported per family: keywords/s of each, the paired ratio
bucketed/st (median, q1-q3), the same ratio per CPU-second (each side's process CPU time over the
timed call: on a shared box the wall-clock ratio moves with the load, since the two sides do not
lose the same share of a contended core; the CPU-time ratio is what the code itself costs) and
the minimum cosine between the two sides' vectors. The
`--families bert` choice runs the same on the project's default model (all-MiniLM-L6-v2), to
check the harness on a family that exists.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from worker.backend_choice.select import open_backend
from worker.benchmark.inputs import read_queries
from worker.benchmark.policies import BucketerOptions, run_bucketed
from worker.benchmark.report import quartiles
from worker.benchmark.suite import round_order
from worker.core.model import default_model_dir
from worker.core.profiles import load_profile
from worker.embedder import Embedder

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_QUERIES = ROOT / "deploy" / "local" / "sample" / "keywords.tsv"
# The tokenizers are trained on these lines less the measured keywords (tokenizer_corpus).
DEFAULT_CORPUS = ROOT / "tests" / "data" / "queries" / "terabyte05-20k.tsv"
FAMILIES = ("qwen3", "gemma3_text", "modernbert", "bert")
WARM_UP = 256  # texts each side runs once before the rounds


class StSide:
    """The sentence-transformers process: started once, one encode per `encode()` call."""

    def __init__(self, python: str, model_dir: Path, texts: list[str], work: Path, threads: int) -> None:
        texts_file = work / "texts.txt"
        texts_file.write_text("\n".join(texts), encoding="utf-8")
        self.vectors_path = work / "st_vectors.npy"
        self.proc = subprocess.Popen(
            [python, "-m", "benchmarks.families_peer_st", "serve", "--model", str(model_dir),
             "--texts", str(texts_file), "--vectors", str(self.vectors_path), "--threads", str(threads)],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.info = self._answer()

    def _answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the sentence-transformers process ended (exit {self.proc.wait()})")
        return json.loads(line)

    def encode(self) -> tuple[float, float]:
        """One encode of every text: (wall seconds, the process's CPU seconds)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("encode\n")
        self.proc.stdin.flush()
        answer = self._answer()
        return float(answer["seconds"]), float(answer["cpu_seconds"])

    def vectors(self) -> np.ndarray:
        return np.load(self.vectors_path)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def tokenizer_corpus(corpus: Path, measured: list[str], work: Path) -> Path:
    """`corpus` without the measured keywords: a vocabulary learnt from them would cut them into
    fewer tokens than a real tokenizer does."""
    skip = set(measured)
    rows = [t for _, t in read_queries(corpus) if t not in skip]
    path = work / "tokenizer-corpus.tsv"
    path.write_text("".join(f"{i}\t{t}\n" for i, t in enumerate(rows)), encoding="utf-8")
    return path


def build_folder(python: str, family: str, corpus: Path, work: Path) -> Path:
    """The sentence-transformers folder of `family` at its real shape (the throwaway environment builds it)."""
    if family == "bert":
        return default_model_dir()
    out = work / f"{family}-st"
    if (out / "modules.json").is_file():  # built by an earlier run into the same --workdir
        return out
    start = time.perf_counter()
    subprocess.run([python, "-m", "benchmarks.families_peer_st", "build", "--family", family,
                    "--corpus", str(corpus), "--out", str(out)], cwd=ROOT, check=True)
    print(f"{family}: built {out} in {time.perf_counter() - start:.0f} s", flush=True)
    return out


def cos_min(a: np.ndarray, b: np.ndarray) -> float:
    return float(((a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))).min())


def run_family(family: str, args: argparse.Namespace, texts: list[str], work: Path) -> dict[str, Any]:
    model_dir = build_folder(args.refenv, family, tokenizer_corpus(Path(args.corpus), texts, work), work)
    embedder = Embedder(model_dir, cache_bytes=0, intra_op_threads=args.threads, backend=args.backend)
    if embedder.backend_choice is not None:
        candidate = embedder.backend_choice.candidate
        kind, ov_precision, ours = candidate.backend, candidate.ov_precision, candidate.label
    else:
        kind, ov_precision = args.backend, "bf16"
        ours = "onnxruntime/fp32" if kind == "onnxruntime" else "openvino/bf16"
    backend = open_backend(kind, embedder.info, intra_op_threads=args.threads, openvino_precision=ov_precision)
    profile = load_profile("cpu", model_max_len=embedder.max_len)
    print(f"{family}: ours --backend {args.backend} -> {ours}", flush=True)
    st = StSide(args.refenv, model_dir, texts, work, args.threads)
    print(f"{family}: sentence-transformers ready {st.info}", flush=True)

    stream: dict[str, Any] = {}

    def run_bucketed_once(batch: list[str] = texts) -> tuple[float, float]:
        start, cpu = time.perf_counter(), time.process_time()
        encoded = embedder.tokenizer.encode(batch)
        tok_s = time.perf_counter() - start
        run = run_bucketed(encoded, profile, backend, options=BucketerOptions(), keep_embeddings=True)
        cpu_s = time.process_time() - cpu
        stream.update(vectors=run.embeddings, real_tokens=run.real_tokens)
        return tok_s + run.seconds, cpu_s

    try:
        run_bucketed_once(texts[:WARM_UP])  # warm-up: the backend's arenas, the common shapes
        sides = {"st": st.encode, "bucketed": run_bucketed_once}
        rounds: list[dict[str, float]] = []
        for r in range(args.rounds):
            got: dict[str, float] = {}
            for name in round_order(list(sides), r):
                wall, cpu = sides[name]()
                got[name], got[f"{name} cpu"] = len(texts) / wall, len(texts) / cpu
                print(f"{family} round {r + 1}/{args.rounds} {name:>8}: {got[name]:,.1f} kw/s, "
                      f"{got[f'{name} cpu']:,.1f} kw per CPU-second", flush=True)
            rounds.append(got)
        st_vectors = st.vectors()
    finally:
        st.close()
        backend.close()
    return {
        "model_dir": str(model_dir) if family == "bert" else f"random weights at {family}'s real shape",
        "ours": ours, "sentence_transformers": st.info, "rounds": rounds,
        "keywords_per_s": {n: quartiles([g[n] for g in rounds]) for n in ("st", "bucketed")},
        "keywords_per_cpu_s": {n: quartiles([g[f"{n} cpu"] for g in rounds]) for n in ("st", "bucketed")},
        "ratio bucketed/st": quartiles([g["bucketed"] / g["st"] for g in rounds]),
        "cpu ratio bucketed/st": quartiles([g["bucketed cpu"] / g["st cpu"] for g in rounds]),
        "tokens_per_keyword": {"ours": stream["real_tokens"] / len(texts),
                               "st": st.info["tokens"] / len(texts)},
        "cosine_min bucketed vs st": cos_min(stream["vectors"], st_vectors),
    }


def _q(q: dict[str, float], fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(q['median'])} ({fmt.format(q['q1'])}-{fmt.format(q['q3'])})"


def render(report: dict[str, Any]) -> str:
    lines = ["# The 2026 families against sentence-transformers, same CPU, same weights (issue 58)", "",
             f"`{report['command']}`", "",
             f"{report['n']:,} keywords of `{report['queries']}` (file order), {report['rounds_per_family']} paired "
             f"rounds per family in alternating order, random weights at the real shapes, "
             f"{report['host']['cpus']} shared cores (absolute speeds drift; read the paired ratios).", "",
             "| family (shape) | ours | sentence-transformers kw/s | bucketed kw/s | bucketed / st | "
             "per CPU-second: bucketed / st | tokens/kw | min cos |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for family, res in report["families"].items():
        lines.append(f"| {family} ({report['shapes'].get(family, 'the default model')}) | {res['ours']} | "
                     f"{_q(res['keywords_per_s']['st'], '{:,.1f}')} | {_q(res['keywords_per_s']['bucketed'], '{:,.1f}')} | "
                     f"{_q(res['ratio bucketed/st'])} | {_q(res['cpu ratio bucketed/st'])} | "
                     f"{res['tokens_per_keyword']['ours']:.2f} | "
                     f"{res['cosine_min bucketed vs st']:.6f} |")
    lines.append("")
    return "\n".join(lines)


SHAPES = {"qwen3": "Qwen3-Embedding-0.6B: 28 x 1024, 16/8 heads of 128, 3072",
          "gemma3_text": "EmbeddingGemma-300m: 24 x 768, 3/1 heads of 256, 1152, Dense 768-3072-768",
          "modernbert": "gte-modernbert-base: 22 x 768, 12 heads, 1152"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--refenv", default="/tmp/refenv/bin/python",
                    help="python of the throwaway environment with torch and sentence-transformers")
    ap.add_argument("--families", nargs="+", choices=FAMILIES, default=["qwen3", "gemma3_text", "modernbert"])
    ap.add_argument("--queries", default=str(DEFAULT_QUERIES))
    ap.add_argument("--corpus", default=str(DEFAULT_CORPUS), help="id<TAB>text lines the tokenizers are trained on")
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--backend", choices=("auto", "onnxruntime", "openvino"), default="auto")
    ap.add_argument("--threads", type=int, default=0, help="threads of each side (0: each side's default)")
    ap.add_argument("--workdir", help="keep the built folders here and reuse them (default: a temporary folder)")
    ap.add_argument("--json")
    ap.add_argument("--markdown")
    args = ap.parse_args(argv)

    texts = [t for _, t in read_queries(args.queries, limit=args.n)]
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="families-peer-") as tmp:
        for family in args.families:
            work = Path(args.workdir or tmp) / family
            work.mkdir(parents=True, exist_ok=True)
            results[family] = run_family(family, args, texts, work)
            print(json.dumps({family: {k: results[family][k] for k in (
                "ratio bucketed/st", "cpu ratio bucketed/st", "cosine_min bucketed vs st",
                "tokens_per_keyword")}}), flush=True)
    report = {
        "command": "python -m benchmarks.families_peer " + " ".join(sys.argv[1:] if argv is None else argv),
        "queries": os.path.relpath(args.queries, ROOT), "n": len(texts), "rounds_per_family": args.rounds,
        "shapes": {f: SHAPES[f] for f in args.families if f in SHAPES},
        "tokenizers": "the family's kind, trained on --corpus, 16,384 tokens (benchmarks/families_peer_st.py)",
        "families": results,
        "settings": {"backend": args.backend, "threads": args.threads},
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version(),
                 "onnxruntime": __import__("onnxruntime").__version__},
    }
    print(json.dumps({f: {k: r[k] for k in ("ratio bucketed/st", "cpu ratio bucketed/st")}
                      for f, r in results.items()}, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    if args.markdown:
        Path(args.markdown).write_text(render(report), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
