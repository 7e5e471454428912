"""`produce --rate` against the real broker: open loop, stamped at send (the schedule itself is
tests/unit/worker/benchmark/test_loadgen.py)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from confluent_kafka import Consumer

from tests.kafka_tools import ROOT, load_queries


def test_produce_at_a_rate_is_open_loop_and_stamped_at_send(kafka_bootstrap: str, make_topic: Callable[..., str],
                                                            tmp_path: Path) -> None:
    topic = make_topic("rate", 2)
    src = tmp_path / "q.tsv"
    src.write_text("".join(f"{q}\t{t}\n" for q, t in load_queries(0, 50)), encoding="utf-8")
    rate, duration = 100, 2.0
    out = subprocess.run([sys.executable, "-m", "worker.cli", "produce", "--bootstrap-servers", kafka_bootstrap,
                          "--topic", topic, "--input", str(src), "--rate", str(rate), "--duration", str(duration),
                          "--spacing", "fixed", "--no-progress"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"produced 200 keywords to {topic}") and "open loop at 100/s" in out.stdout

    reader = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": f"{topic}-r", "auto.offset.reset": "earliest"})
    reader.subscribe([topic])
    got: list[tuple[int, str]] = []
    try:
        for _ in range(200):
            got += [(m.timestamp()[1], m.key().decode()) for m in reader.consume(200, timeout=0.5) if not m.error()]
            if len(got) >= 200:
                break
    finally:
        reader.close()
    assert len(got) == 200
    # The file (50 rows) is cycled for the whole duration, every record with its own ID.
    assert len({k for _, k in got}) == 200 and sum("~" in k for _, k in got) == 150
    # Stamped at send on a fixed schedule: the timestamps span most of the duration (a record is
    # never sent before its time; the first may be late), instead of one burst at the start.
    stamps = sorted(ts for ts, _ in got)
    assert stamps[-1] - stamps[0] >= 0.8 * duration * 1000
    assert stamps[-1] - stamps[100] >= 0.8 * (99 / rate) * 1000
