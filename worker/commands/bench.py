"""`keyword-embedder bench`: offline monolithic vs bucketed vs sorted batching, with latency."""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import orjson


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", type=Path, metavar="FILE", help="Queries as id<TAB>text, one per line.")
    parser.add_argument("--limit", type=int, default=20000, help="Use the first N queries (default 20000).")
    parser.add_argument("--rounds", type=int, default=3, help="Rounds of every policy, alternating order.")
    parser.add_argument("--profile", default="cpu", help="Bucket profile of the bucketed policy (default cpu).")
    parser.add_argument("--compare-profile", default="cpu-aligned",
                        help="A second bucketed profile reported beside it; '' for none (default cpu-aligned).")
    parser.add_argument("--profiles-file", type=Path, default=None, help="Profiles TOML (default: kwe_core/profiles.toml).")
    parser.add_argument("--json", type=Path, default=None, metavar="OUT", help="Write the JSON report here.")
    parser.add_argument("--markdown", type=Path, default=None, metavar="OUT", help="Write a Markdown table here.")
    parser.add_argument("--latency", action=argparse.BooleanOptionalAction, default=True,
                        help="Open-loop Poisson latency at 25/50/80%% of the bucketed peak (default on).")
    parser.add_argument("--latency-seconds", type=float, default=10.0, help="Seconds of arrivals per load level.")
    parser.add_argument("--batch-size", type=int, default=256, help="Batch size of monolithic and sorted.")
    parser.add_argument("--window", type=int, default=4096,
                        help="In-flight window of the bucketed feeder (the worker's max_in_flight).")
    parser.add_argument("--max-queue-delay-ms", type=float, default=20.0)
    parser.add_argument("--dispatchers", type=int, default=1)
    parser.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True,
                        help="An idle dispatcher takes a partial batch before its deadline (default on).")
    parser.add_argument("--threads", type=int, default=0,
                        help="ONNX Runtime intra-op threads of the bucketed contexts (0: all cores).")
    parser.add_argument("--baseline-threads", type=int, default=0,
                        help="Intra-op threads of monolithic and sorted, which call from one thread (0: all cores).")
    parser.add_argument("--onnx", type=Path, default=None, help="ONNX file (default: the cached plain export).")
    parser.add_argument("--fused", action="store_true", help="Use the offline-fused export.")
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--quiet", action="store_true", help="No per-round progress on stderr.")


def main(args: argparse.Namespace) -> int:
    from kwe_core.errors import BackendError
    from worker.bench import BenchConfig, BenchError, read_queries, render_markdown, run_benchmark
    from kwe_core.model import ModelError, ModelInfo, default_model_dir
    from kwe_core.profiles import ProfileError, load_profile
    from worker.tokenize import KeywordTokenizer

    def log(msg: str) -> None:
        if not args.quiet:
            print(msg, file=sys.stderr, flush=True)

    for flag, value in (("--limit", args.limit), ("--rounds", args.rounds), ("--batch-size", args.batch_size),
                        ("--window", args.window), ("--dispatchers", args.dispatchers)):
        if value < 1:
            print(f"keyword-embedder bench: {flag} must be >= 1, got {value}", file=sys.stderr)
            return 2
    try:
        from worker.backends.select import open_backend

        info = ModelInfo.from_dir(args.model_dir or default_model_dir())
        tokenizer = KeywordTokenizer.from_model(info)
        profile = load_profile(args.profile, args.profiles_file, model_max_len=tokenizer.max_len)
        compare = (load_profile(args.compare_profile, args.profiles_file, model_max_len=tokenizer.max_len)
                   if args.compare_profile else None)
        rows = read_queries(args.file, args.limit)
        t0 = time.perf_counter()
        encoded = tokenizer.encode([text for _, text in rows])
        log(f"tokenized {len(encoded)} queries in {time.perf_counter() - t0:.2f} s (excluded from all timings)")
        backend = open_backend("onnxruntime", info, onnx_path=args.onnx, intra_op_threads=args.threads,
                               fused=args.fused)
        onnx_path = backend.path
        baseline = (backend if args.baseline_threads == args.threads
                    else open_backend("onnxruntime", info, onnx_path=onnx_path,
                                      intra_op_threads=args.baseline_threads))
    except (BenchError, ProfileError, ModelError, BackendError) as exc:
        print(f"keyword-embedder bench: {exc}", file=sys.stderr)
        return 2
    cfg = BenchConfig(
        dataset=str(args.file), profile=profile, compare_profile=compare, rounds=args.rounds,
        batch_size=args.batch_size, window=args.window, max_queue_delay_ms=args.max_queue_delay_ms,
        dispatchers=args.dispatchers, eager=args.eager, latency=args.latency, latency_seconds=args.latency_seconds,
        backend_desc={"name": backend.name, "onnx": Path(onnx_path).name, "intra_op_threads": args.threads,
                      "baseline_intra_op_threads": args.baseline_threads})
    try:
        report = run_benchmark(encoded, backend, cfg, log=log, baseline_backend=baseline)
    except BenchError as exc:
        print(f"keyword-embedder bench: {exc}", file=sys.stderr)
        return 1
    finally:
        backend.close()
        baseline.close()
    command = "keyword-embedder bench " + " ".join(shlex.quote(a) for a in sys.argv[2:]) \
        if len(sys.argv) > 2 and sys.argv[1] == "bench" else f"keyword-embedder bench {args.file}"
    report["command"] = command
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2) + b"\n")
    md = render_markdown(report, command)
    if args.markdown is not None:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(md, encoding="utf-8")
    print(md)
    return 0
