"""The default JSON path's per-record work, this checkout against an older one, paired in one process.

    .venv/bin/python -m benchmarks.archive.hot_path_ab --baseline-root /tmp/kwe-old [--rounds 15]

What a change to intake decoding or output encoding costs per record, without Kafka or the model
(whose noise on a shared box hides a sub-microsecond change): each round times decode_input on a
JSON keyword and OutputCodec.value on a 384-d float-list vector, plus the output header choice,
for N records with the new code and with the old (loaded from --baseline-root under another module
name), alternating which goes first; the ratio old/new time (new throughput over old) is paired
per round. Needs only that both checkouts have worker/formats/messages.py.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType

import numpy as np
import orjson


def load_old(root: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("kwe_old_messages", root / "worker" / "kafka" / "messages.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["kwe_old_messages"] = module
    spec.loader.exec_module(module)
    return module


def per_record(messages: ModuleType, values: list[bytes], vec: np.ndarray, new: bool) -> float:
    """Seconds for decode + encode + header choice of every value."""
    from worker.formats.headers import InputHeaders
    from worker.formats.propagation import Propagation

    codec = messages.OutputCodec(model="all-MiniLM-L6-v2", dim=384, encoding="float-list")
    propagation = Propagation.of((), trace_context=True)  # the new default: on, records without headers
    no_headers = InputHeaders()
    headers = codec.headers
    t0 = time.perf_counter()
    for value in values:
        kw = messages.decode_input(None, value, fmt="json", max_bytes=16384, headers_bytes=0)
        codec.value(kw.id, vec, 5, False)
        if new:
            _ = headers if propagation is None or not no_headers.headers else propagation.output_headers(headers, no_headers)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline-root", type=Path, required=True)
    ap.add_argument("-n", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    import worker.formats.messages as new_messages

    old_messages = load_old(args.baseline_root)
    values = [orjson.dumps({"id": f"q-{i}", "text": f"running shoes size {i}"}) for i in range(args.n)]
    vec = np.random.default_rng(0).standard_normal(384).astype(np.float32)
    per_record(new_messages, values[:1000], vec, True)
    per_record(old_messages, values[:1000], vec, False)
    ratios = []
    for r in range(args.rounds):
        order = [(new_messages, True), (old_messages, False)][:: 1 if r % 2 == 0 else -1]
        times = {is_new: per_record(m, values, vec, is_new) for m, is_new in order}
        ratios.append(times[False] / times[True])
        print(f"round {r}: new {times[True] / args.n * 1e6:.2f} us/record  old {times[False] / args.n * 1e6:.2f} "
              f"us/record  throughput ratio new/old {ratios[-1]:.3f}")
    q = statistics.quantiles(ratios, n=4)
    print(f"new/old throughput: median {statistics.median(ratios):.3f} (q1 {q[0]:.3f}, q3 {q[2]:.3f}), "
          f"{args.rounds} rounds of {args.n}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
