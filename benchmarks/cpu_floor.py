"""The model's CPU floor: CPU time per keyword of one backend call, by batch size, on this machine.

    .venv/bin/python -m benchmarks.cpu_floor [--rounds 3] [--rate 1050] [--json PATH]

Issue 37 asks for p99 <= 100 ms at 50% of the backlog rate with the broker, the load generator and
the worker on the same two cores. Whether any schedule can give that is a question of CPU: the
backlog rate is measured with batches of 128, and a stream served within 100 ms forms far smaller
ones, whose keywords cost more each. This measures that cost where nothing else runs, so it is a
floor: one context with one thread (the worker's default layout: two single-threaded dispatchers),
batches of B real keywords of one exact length (the CPU buckets), the length drawn per call from
the stream's own token lengths so the shape changes from call to call as it does in the worker
(OpenVINO pays for a shape change; ONNX Runtime does not). Time is the calling thread's CPU time
(time.thread_time), not the wall clock. Backends alternate within each round; medians and quartiles
over rounds. Then, for --rate keywords/s, the cores the backend calls alone need at each batch size.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path

from benchmarks.fresh_keywords import SHIPPED
from worker.benchmark.report import quartiles
from worker.formats.keyword_files import read_keywords


BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
# Keywords per measurement at each batch size (at least MIN_CALLS calls): ~0.5-1 s of CPU each.
KEYWORDS_PER_POINT = 512
MIN_CALLS = 24


def stream_lengths(limit: int = 5000) -> list[int]:
    """Token lengths ([CLS] and [SEP] included) of the shipped sample keywords, as the worker tokenizes them."""
    from worker.core.model import default_model_dir
    from worker.intake.tokenize import KeywordTokenizer

    tokenizer = KeywordTokenizer.from_model_dir(default_model_dir())
    texts = [text for _, text in read_keywords(SHIPPED[1], "tsv", limit=limit)]
    return [e.ids.size for e in tokenizer.encode(texts)]


def contexts() -> dict[str, object]:
    from engines.onnx_export.export import ensure_onnx
    from worker.backends.onnxruntime import OnnxRuntimeBackend

    onnx = ensure_onnx()
    out: dict[str, object] = {}
    try:
        from worker.backends.openvino import OpenVinoBackend
        out["openvino/bf16"] = OpenVinoBackend(onnx, precision="bf16").create_context(0)
    except Exception as exc:  # noqa: BLE001 - the openvino extra is optional; say so and go on
        print(f"openvino/bf16 left out: {exc}", file=sys.stderr)
    out["onnxruntime/fp32"] = OnnxRuntimeBackend(onnx, intra_op_threads=1, allow_spinning=False).create_context(0)
    return out


def cpu_ms_per_keyword(context: object, batch: int, lengths: list[int], rng: random.Random) -> float:
    import numpy as np

    calls = max(MIN_CALLS, KEYWORDS_PER_POINT // batch)
    shapes = [(batch, rng.choice(lengths)) for _ in range(calls)]
    feeds = [np.full(s, 2000, dtype=np.int64) for s in shapes]
    masks = [np.ones(s, dtype=np.int64) for s in shapes]
    run = context.run  # type: ignore[attr-defined]
    t0 = time.thread_time()
    for ids, mask in zip(feeds, masks):
        run(ids, mask)
    return (time.thread_time() - t0) / (calls * batch) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rate", type=float, default=1050.0, help="keywords/s to size the cores for (1,050: 50%% of 2,100)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    import numpy as np

    lengths = stream_lengths()
    ctxs = contexts()
    rng = random.Random(args.seed)
    for context in ctxs.values():  # every shape the rounds can meet, once, before any timing
        for batch in BATCHES:
            for n in sorted(set(lengths)):
                warm = np.full((batch, n), 2000, dtype=np.int64)
                context.run(warm, np.ones_like(warm))  # type: ignore[attr-defined]
    samples: dict[str, dict[int, list[float]]] = {name: {b: [] for b in BATCHES} for name in ctxs}
    for r in range(args.rounds):
        names = list(ctxs) if r % 2 == 0 else list(reversed(ctxs))
        for batch in BATCHES:
            for name in names:
                samples[name][batch].append(cpu_ms_per_keyword(ctxs[name], batch, lengths, rng))
        print(f"round {r}: " + "; ".join(f"{n} " + " ".join(f"{b}:{samples[n][b][-1]:.2f}" for b in BATCHES) for n in ctxs),
              flush=True)

    mean_len = sum(lengths) / len(lengths)
    print(f"\nCPU ms per keyword, one thread, shapes changing per call (mean length {mean_len:.1f} tokens); "
          f"cores at {args.rate:,.0f} kw/s")
    print(f"{'batch':>5}  " + "  ".join(f"{n:>26}" for n in ctxs))
    table = []
    for batch in BATCHES:
        row: dict[str, object] = {"batch": batch}
        cells = []
        for name in ctxs:
            q = quartiles(samples[name][batch])
            cores = q["median"] * args.rate / 1e3
            row[name] = {"ms_per_keyword": q, "cores_at_rate": cores}
            cells.append(f"{q['median']:6.3f} ({q['q1']:.3f}-{q['q3']:.3f}) {cores:5.2f} cores")
        table.append(row)
        print(f"{batch:>5}  " + "  ".join(f"{c:>26}" for c in cells))
    if args.json:
        from worker.backend_choice.auto import cpu_flags
        from worker.batching.calibration import cpu_model

        flags = sorted(f for f in cpu_flags() if f.startswith(("avx512", "amx", "avx_vnni")))
        args.json.write_text(json.dumps({
            "command": "python -m benchmarks.cpu_floor " + " ".join(sys.argv[1:] if argv is None else argv),
            "machine": {"cpu": cpu_model(), "flags": flags, "python": platform.python_version()},
            "rate": args.rate, "rounds": args.rounds, "mean_length": mean_len,
            "table": table, "samples": samples}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
