"""What a float-list output's embeddings cost to write as JSON, two ways, alternated and paired.

    python -m benchmarks.host.json_rows --rounds 9 --json benchmarks/results/host/json_rows.json

`batch_split`: one orjson call for the whole [n, dim] batch, split at "],[" (the output stage's
form until this benchmark). `per_row`: one orjson call a row (worker/formats/messages.py's
`_json_rows` now). Both give each row's bytes as orjson writes it alone; the benchmark checks that
they agree (brackets aside) before it times anything. Rows: the real model's vectors of
tests/data/golden/dev.npy, tiled to a batch, and the do-nothing backend's unit vectors (what the
host-path benchmarks write). Microseconds a row, median (q1-q3) over the rounds, and the paired
ratio per_row / batch_split.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import orjson

from worker.formats.messages import _json_rows

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "data" / "golden" / "dev.npy"


def batch_split(rows: np.ndarray) -> list[bytes]:
    whole = orjson.dumps(np.ascontiguousarray(rows, dtype=np.float32), option=orjson.OPT_SERIALIZE_NUMPY)
    return whole[2:-2].split(b"],[")


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q1, med, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, med, q3


def us_per_row(encode: Callable[[np.ndarray], list[bytes]], rows: np.ndarray, repeat: int) -> float:
    start = time.thread_time()
    for _ in range(repeat):
        encode(rows)
    return (time.thread_time() - start) / (repeat * len(rows)) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--batch", type=int, default=256, help="rows a batch")
    ap.add_argument("--repeat", type=int, default=20, help="batches a timing")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    golden = np.load(GOLDEN).astype(np.float32)
    real = np.resize(golden, (args.batch, golden.shape[1]))
    unit = np.zeros_like(real)
    unit[:, 0] = 1.0
    forms = {"batch_split": batch_split, "per_row": _json_rows}
    results: dict[str, object] = {"command": "python -m benchmarks.host.json_rows " + " ".join(
        f"--{k} {v}" for k, v in (("rounds", args.rounds), ("batch", args.batch), ("repeat", args.repeat))),
        "machine": cpu_model(), "rows": {}}
    for name, rows in (("real", real), ("unit", unit)):
        if [r[1:-1] for r in _json_rows(rows)] != batch_split(rows):
            raise SystemExit(f"{name}: the two forms disagree")
        times: dict[str, list[float]] = {form: [] for form in forms}
        for r in range(args.rounds):
            order = list(forms) if r % 2 == 0 else list(reversed(forms))
            for form in order:
                times[form].append(us_per_row(forms[form], rows, args.repeat))
        ratios = [new / old for new, old in zip(times["per_row"], times["batch_split"])]
        entry = {form: dict(zip(("q1", "median", "q3"), quartiles(t))) for form, t in times.items()}
        entry["per_row/batch_split"] = dict(zip(("q1", "median", "q3"), quartiles(ratios)))
        results["rows"][name] = entry  # type: ignore[index]
        print(f"{name}: batch_split {entry['batch_split']['median']:.2f} us/row, per_row "
              f"{entry['per_row']['median']:.2f} us/row, per_row/batch_split {quartiles(ratios)[1]:.3f} "
              f"({quartiles(ratios)[0]:.3f}-{quartiles(ratios)[2]:.3f})")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
