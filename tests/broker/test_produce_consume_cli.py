"""`keyword-embedder produce` and `consume` against the real broker."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import orjson

from tests.kafka_tools import ROOT, load_queries


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "worker.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_produce_then_consume_round_trip(kafka_bootstrap: str, make_topic: Callable[..., str], tmp_path: Path) -> None:
    topic = make_topic("cli", 3)
    queries = load_queries(0, 500)
    src = tmp_path / "q.tsv"
    src.write_text("".join(f"{q}\t{t}\n" for q, t in queries), encoding="utf-8")
    out = cli("produce", "--bootstrap-servers", kafka_bootstrap, "--topic", topic, "--input", str(src),
              "--no-progress")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"produced 500 keywords to {topic}") and "keywords/s" in out.stdout

    dst = tmp_path / "out.jsonl"
    got = cli("consume", "--bootstrap-servers", kafka_bootstrap, "--topic", topic, "--output", str(dst),
              "--max-messages", "500", "--idle-timeout", "30")
    assert got.returncode == 0, got.stderr
    records = [orjson.loads(line) for line in dst.read_bytes().splitlines()]
    assert len(records) == 500
    assert {(r["id"], r["text"]) for r in records} == set(queries)
    assert all(r["_kafka"]["key"] == r["id"] and r["_kafka"]["offset"] >= 0 for r in records)


def test_produce_reports_a_bad_file_and_bad_config(kafka_bootstrap: str, make_topic: Callable[..., str],
                                                   tmp_path: Path) -> None:
    topic = make_topic("cli", 1)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a"}\n', encoding="utf-8")
    out = cli("produce", "--bootstrap-servers", kafka_bootstrap, "--topic", topic, "--input", str(bad),
              "--no-progress", "--strict")
    assert out.returncode == 2 and "bad.jsonl:1" in out.stderr
    out = cli("produce", "--bootstrap-servers", kafka_bootstrap, "--topic", topic, "--input", str(bad),
              "--kafka-config", "acks")
    assert out.returncode == 2 and "expected key=value" in out.stderr


def test_produce_skips_and_counts_bad_lines_unless_strict(kafka_bootstrap: str, make_topic: Callable[..., str],
                                                          tmp_path: Path) -> None:
    topic = make_topic("cli", 1)
    queries = load_queries(0, 20)
    src = tmp_path / "q.tsv"
    lines = [f"{q}\t{t}\n".encode() for q, t in queries]
    lines.insert(5, "q-latin1\tcaf\u00e9 cr\u00e8me\n".encode("latin-1"))  # line 6: a real query log's Latin-1
    lines.insert(12, b"no tab on this line\n")  # line 13: not id<TAB>text, read as text by the default format
    src.write_bytes(b"".join(lines))
    out = cli("produce", "--bootstrap-servers", kafka_bootstrap, "--topic", topic, "--input", str(src),
              "--format", "tsv", "--no-progress")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"produced 20 keywords to {topic}")
    assert "skipped 2 bad lines (first: line 6, not UTF-8" in out.stderr
    dst = tmp_path / "out.jsonl"
    got = cli("consume", "--bootstrap-servers", kafka_bootstrap, "--topic", topic, "--output", str(dst),
              "--max-messages", "20", "--idle-timeout", "30")
    assert got.returncode == 0, got.stderr
    assert {(r["id"], r["text"]) for r in map(orjson.loads, dst.read_bytes().splitlines())} == set(queries)
    strict = cli("produce", "--bootstrap-servers", kafka_bootstrap, "--topic", topic, "--input", str(src),
                 "--format", "tsv", "--no-progress", "--strict")
    assert strict.returncode == 2 and "q.tsv:6: not UTF-8" in strict.stderr


def test_consume_reads_committed_records_only_unless_told_otherwise(kafka_bootstrap: str,
                                                                   make_topic: Callable[..., str],
                                                                   tmp_path: Path) -> None:
    from confluent_kafka import Producer

    topic = make_topic("cli-txn", 1)
    p = Producer({"bootstrap.servers": kafka_bootstrap, "transactional.id": f"keyword-embedder-test-{topic}"})
    p.init_transactions(30)
    p.begin_transaction()
    p.produce(topic, key=b"committed", value=orjson.dumps({"id": "committed", "text": "a"}))
    p.commit_transaction(30)
    p.begin_transaction()
    p.produce(topic, key=b"aborted", value=orjson.dumps({"id": "aborted", "text": "b"}))
    p.flush(30)
    p.abort_transaction(30)

    def read(*flags: str) -> list[str]:
        dst = tmp_path / f"out{len(flags)}.jsonl"
        got = cli("consume", "--bootstrap-servers", kafka_bootstrap, "--topic", topic, "--output", str(dst),
                  "--idle-timeout", "4", *flags)
        assert got.returncode == 0, got.stderr
        return [orjson.loads(line)["id"] for line in dst.read_bytes().splitlines()]

    assert read() == ["committed"]
    assert read("--read-uncommitted") == ["committed", "aborted"]
