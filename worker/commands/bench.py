"""`keyword-embedder bench`: offline monolithic vs bucketed vs sorted batching, with latency, on any backend."""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
import time
from pathlib import Path
from typing import get_args

import orjson

from worker.backends.base import OvPrecision
from worker.names import TorchPrecision
from worker.settings.schema import BackendSetting

PROG = "keyword-embedder bench"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", type=Path, metavar="FILE", nargs="?",
                        help="Queries as id<TAB>text, one per line (not needed with --calibrate).")
    parser.add_argument("--calibrate", action="store_true",
                        help="Measure as the worker does at start (same grids, same caches: with the worker's --threads "
                             "and --dispatchers it refreshes the worker's): with --backend auto the CPU candidates' table "
                             "(parity gate, ms per shape, speed-up), then the chosen backend's cost model t(B, L) = "
                             "fixed + per_row*B + per_token*B*L against every measured shape; and exit.")
    parser.add_argument("--merge-buckets", action=argparse.BooleanOptionalAction, default=True,
                        help="Partial batches take neighbouring buckets along when the measured cost model says one "
                             "call is cheaper than two, as the worker does (default on; CPU backends: TensorRT never merges).")
    parser.add_argument("--limit", type=int, default=20000, help="Use the first N queries (default 20000).")
    parser.add_argument("--rounds", type=int, default=3, help="Rounds of every policy, alternating order.")
    parser.add_argument("--backend", choices=get_args(BackendSetting), default="auto",
                        help="auto (the worker's CPU choice: measured, gated, cached), onnxruntime, openvino (the "
                             "openvino extra), tensorrt (needs --engine-path and the gpu extra) or torch (the torch "
                             "extra and a GPU: one CUDA graph per bucket).")
    parser.add_argument("--openvino-precision", choices=get_args(OvPrecision), default="bf16",
                        help="Arithmetic of --backend openvino.")
    parser.add_argument("--torch-precision", choices=get_args(TorchPrecision), default="auto",
                        help="Encoder arithmetic of --backend torch (auto: the first of fp16, bf16, fp32 that passes "
                             "the parity gate).")
    parser.add_argument("--engine-path", type=Path, default=None, help="TensorRT plan (keyword-embedder build-engine).")
    parser.add_argument("--profile", default=None,
                        help="Bucket profile of the bucketed policy (default: cpu; gpu with tensorrt and torch).")
    parser.add_argument("--compare-profile", default=None,
                        help="A second bucketed profile reported beside it; '' for none (default: cpu-aligned "
                             "on onnxruntime; none on tensorrt and torch, whose contexts hold one profile's shapes).")
    parser.add_argument("--profiles-file", type=Path, default=None,
                        help="Profiles TOML (default: worker/core/profiles.toml).")
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
    parser.add_argument("--strict", action="store_true",
                        help="Refuse a file with a bad line (not UTF-8, not id<TAB>text); default: skip and count them.")
    parser.add_argument("--quiet", action="store_true", help="No per-round progress on stderr.")


def main(args: argparse.Namespace) -> int:
    from worker.backend_choice.select import DEFAULT_PROFILE, model_profile
    from worker.benchmark.inputs import read_queries
    from worker.benchmark.policies import BucketerOptions
    from worker.benchmark.report import render_markdown
    from worker.benchmark.suite import BenchConfig, run_benchmark
    from worker.core.errors import KeywordEmbedderError
    from worker.core.model import ModelInfo, default_model_dir
    from worker.core.profiles import load_profile
    from worker.formats.keyword_files import BadLines
    from worker.intake.tokenize import KeywordTokenizer

    def log(msg: str) -> None:
        if not args.quiet:
            print(msg, file=sys.stderr, flush=True)

    def fail(msg: object, code: int = 2) -> int:
        print(f"{PROG}: {msg}", file=sys.stderr)
        return code

    for flag, value in (("--limit", args.limit), ("--rounds", args.rounds), ("--batch-size", args.batch_size),
                        ("--window", args.window), ("--dispatchers", args.dispatchers)):
        if value < 1:
            return fail(f"{flag} must be >= 1, got {value}")
    tensorrt = args.backend == "tensorrt"
    # A backend whose context i serves bucket i only (a plan's profiles, torch's graphs): one profile per backend.
    bound = args.backend in ("tensorrt", "torch")
    if args.calibrate:
        return calibrate(args, fail)
    if args.file is None:
        return fail("FILE is required (except with --calibrate)")
    profile_name = args.profile or DEFAULT_PROFILE[args.backend if bound else "onnxruntime"]
    compare_name = args.compare_profile if args.compare_profile is not None else ("" if bound else "cpu-aligned")
    if bound and compare_name:
        return fail(f"--compare-profile needs a second backend on {args.backend} (its contexts hold one profile's "
                    "shapes); pass --compare-profile ''")
    if tensorrt and not args.engine_path:
        return fail("--backend tensorrt needs --engine-path (build it with keyword-embedder build-engine)")
    backends = []
    try:
        info = ModelInfo.from_dir(args.model_dir or default_model_dir())
        tokenizer = KeywordTokenizer.from_model(info)
        profile = model_profile(info, load_profile(profile_name, args.profiles_file, model_max_len=tokenizer.max_len))
        compare = model_profile(info, load_profile(compare_name, args.profiles_file, model_max_len=tokenizer.max_len)) \
            if compare_name else None
        bad = None if args.strict else BadLines()
        rows = read_queries(args.file, args.limit, bad=bad)
        if bad is not None and bad.count:
            print(f"{PROG}: {bad.summary(args.file)}", file=sys.stderr)
        t0 = time.perf_counter()
        encoded = tokenizer.encode([text for _, text in rows])
        log(f"tokenized {len(encoded)} queries in {time.perf_counter() - t0:.2f} s (excluded from all timings)")
        backend, choice = _open(args, info, profile, args.threads)
        backends.append(backend)
        baseline = backend
        if not bound and args.baseline_threads != args.threads:
            baseline, _ = _open(args, info, profile, args.baseline_threads, kind=backend.name)
            backends.append(baseline)
    except KeywordEmbedderError as exc:  # a file, the model, the profile or the backend: exit 2
        for b in backends:
            b.close()
        return fail(exc)
    desc: dict = {"name": backend.name}
    if choice is not None:  # --backend auto: what it chose and why
        desc.update(choice=choice.candidate.label, choice_reason=choice.reason, choice_cached=choice.cached)
    if backend.name == "openvino":
        desc["precision"] = choice.candidate.ov_precision if choice is not None else args.openvino_precision
    if tensorrt:
        desc["plan"] = Path(args.engine_path).name
    elif backend.name == "torch":
        desc.update(precision=getattr(backend, "precision", ""), device=getattr(backend, "device_name", ""),
                    providers=getattr(backend, "providers", []))
    else:
        desc.update(onnx=Path(getattr(backend, "path", "")).name, intra_op_threads=args.threads,
                    baseline_intra_op_threads=args.baseline_threads)
    costs = None
    if args.merge_buckets and not bound:
        from worker.backend_choice.costs import calibration_key
        from worker.batching.calibration import cost_model_for

        costs = cost_model_for(backend, calibration_key(_worker_settings(args, backend.name, desc.get("precision")),
                                                        info))
        desc["cost_model"] = costs.calibrated.as_dict() if costs is not None else None
    cfg = BenchConfig(
        dataset=str(args.file), profile=profile, compare_profile=compare, rounds=args.rounds,
        batch_size=args.batch_size, window=args.window,
        options=BucketerOptions(max_queue_delay_ms=args.max_queue_delay_ms, dispatchers=args.dispatchers,
                                eager=args.eager, costs=costs),
        latency=args.latency, latency_seconds=args.latency_seconds, backend_desc=desc,
        input_desc=bad.as_dict() if bad is not None else {"strict": True})
    try:
        report = run_benchmark(encoded, backend, cfg, log=log, baseline_backend=baseline)
    except KeywordEmbedderError as exc:  # the run itself failed: exit 1
        return fail(exc, 1)
    finally:
        for b in backends:
            b.close()
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


def _worker_settings(args: argparse.Namespace, backend: str = "onnxruntime",  # noqa: ANN202 - Settings, lazily
                     openvino_precision: str | None = None):
    """The worker settings whose calibration this bench run shares (thread layout, model, ONNX file, backend)."""
    from worker.settings.schema import Settings

    return Settings(intra_op_threads=args.threads, dispatchers=args.dispatchers, onnx_path=str(args.onnx or ""),
                    model_dir=str(args.model_dir or ""), backend=backend,
                    openvino_precision=openvino_precision or args.openvino_precision)


def _open(args: argparse.Namespace, info, profile, threads: int, *, kind: str | None = None,  # noqa: ANN001, ANN202
          remeasure: bool = False):
    """(backend, CpuChoice or None): auto measures (or reads) the worker's CPU choice for this layout."""
    from engines.onnx_export.export import ensure_onnx
    from worker.backend_choice.select import choose_cpu, open_backend

    kind = kind or args.backend
    onnx = args.onnx or (ensure_onnx(info, optimize=True) if args.fused else None)
    if kind == "auto":
        settings = dataclasses.replace(_worker_settings(args), intra_op_threads=threads, onnx_path=str(onnx or ""))
        choice, backend = choose_cpu(settings, info, threads=threads, remeasure=remeasure)
        return backend, choice
    precision = args.openvino_precision
    return open_backend(kind, info, profile, onnx_path=onnx, engine_path=args.engine_path, intra_op_threads=threads,
                        openvino_precision=precision, torch_precision=args.torch_precision), None


def calibrate(args: argparse.Namespace, fail) -> int:  # noqa: ANN001
    """`bench --calibrate`: measure afresh (and cache it for the worker) the backend choice and the cost model, print them."""
    from worker.backend_choice.costs import calibration_key
    from worker.backend_choice.select import intra_op_threads
    from worker.batching.calibration import backend_key, cache_key, default_cache_dir, load_or_measure
    from worker.batching.cost_model import fit
    from worker.core.errors import KeywordEmbedderError
    from worker.core.model import ModelInfo, default_model_dir

    if args.backend in ("tensorrt", "torch"):
        return fail(f"--calibrate is for the CPU backends: on {args.backend} context i serves bucket i only, so "
                    "batches never merge buckets and the worker measures no cost model")
    # The thread count as the worker resolves it (0: the cores divided among the dispatchers), so
    # the keys, and the layout measured, are the worker's own.
    settings = _worker_settings(args)
    settings = dataclasses.replace(settings, intra_op_threads=intra_op_threads(settings))
    try:
        info = ModelInfo.from_dir(args.model_dir or default_model_dir())
        t0 = time.perf_counter()
        backend, choice = _open(args, info, None, settings.intra_op_threads, remeasure=True)
    except KeywordEmbedderError as exc:
        return fail(exc)
    if choice is not None:
        print(f"backend auto: {choice.candidate.label}, measured in {time.perf_counter() - t0:.1f} s: {choice.reason}")
        print(choice.table() or "  (one candidate: nothing to measure)")
    precision = backend.precision if backend.name == "openvino" else None  # type: ignore[attr-defined]
    settings = dataclasses.replace(settings, backend=backend.name, openvino_precision=precision or "bf16")
    try:
        ctx = backend.create_context(0)
        key = backend_key(backend, calibration_key(settings, info))
        t0 = time.perf_counter()
        samples, _ = load_or_measure(ctx.run, key, remeasure=True)
        seconds = time.perf_counter() - t0
        ctx.close()
    finally:
        backend.close()
    prices = fit(samples)
    label = backend.name + (f" {precision}" if precision else "")
    print(f"cost model of {label}, {settings.intra_op_threads} thread(s) per call, {args.dispatchers} dispatcher(s), "
          f"measured in {seconds:.1f} s")
    print(f"  t(B, L) = {1000 * prices.fixed_s:.3f} ms + {1000 * prices.per_row_s:.4f} ms x B "
          f"+ {1000 * prices.per_token_s:.5f} ms x B x L")
    print("  rows  length  measured ms  model ms  error")
    for rows, length, secs in samples:
        model = prices.cost(rows, length)
        print(f"  {rows:4d}  {length:6d}  {1000 * secs:11.2f}  {1000 * model:8.2f}  {(model - secs) / secs:+6.1%}")
    print(f"  cached for the worker in {default_cache_dir() / (cache_key(key) + '.json')}")
    return 0
