"""Test helpers for the real broker: worker processes, producing keywords, reading topics back."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

ROOT = Path(__file__).resolve().parents[1]
QUERIES = Path(__file__).resolve().parent / "data" / "queries" / "terabyte05-20k.tsv"


def load_queries(start: int = 0, count: int | None = None) -> list[tuple[str, str]]:
    rows = []
    with QUERIES.open(encoding="utf-8") as f:
        for line in f:
            qid, _, text = line.rstrip("\n").partition("\t")
            rows.append((qid, text))
    return rows[start:None if count is None else start + count]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@dataclass
class WorkerProcess:
    """One `keyword-embedder run` process: a real group member, as deployed."""

    bootstrap: str
    input_topic: str
    output_topic: str
    dead_letter_topic: str
    group: str
    log_path: Path
    extra: Sequence[str] = ()
    metrics_port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> WorkerProcess:
        cmd = [sys.executable, "-m", "worker.cli", "run", "--bootstrap-servers", self.bootstrap,
               "--input-topic", self.input_topic, "--output-topic", self.output_topic,
               "--dead-letter-topic", self.dead_letter_topic, "--group-id", self.group,
               "--metrics-port", str(self.metrics_port), "--metrics-host", "127.0.0.1",
               "--log-format", "json", *self.extra]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KWE_")}
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        log.close()
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}"

    def probe(self, path: str) -> int | None:
        try:
            return http_get(self.url + path)[0]
        except OSError:
            return None

    def wait_ready(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"worker exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            if self.probe("/readyz") == 200:
                return
            time.sleep(0.1)
        raise AssertionError(f"worker not ready after {timeout} s:\n{self.log()[-3000:]}")

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM and wait: the graceful path (drain, commit, leave the group)."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"worker did not stop within {timeout} s:\n{self.log()[-3000:]}") from None

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace") if self.log_path.exists() else ""

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        out = []
        for line in self.log().splitlines():
            try:
                obj = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            if isinstance(obj, dict) and (name is None or obj.get("event") == name):
                out.append(obj)
        return out


def produce(bootstrap: str, topic: str, records: Iterable[tuple[bytes | None, bytes | None]],
            config: Mapping[str, str] | None = None) -> int:
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, "enable.idempotence": True, **(config or {})})
    n = 0
    for key, value in records:
        while True:
            try:
                p.produce(topic, key=key, value=value)
                break
            except BufferError:
                p.poll(0.05)
        n += 1
    assert p.flush(60) == 0
    return n


def produce_queries(bootstrap: str, topic: str, queries: Sequence[tuple[str, str]],
                    config: Mapping[str, str] | None = None) -> int:
    return produce(bootstrap, topic,
                   ((qid.encode(), orjson.dumps({"id": qid, "text": text})) for qid, text in queries), config)


@dataclass
class Record:
    key: str | None
    value: dict[str, Any]
    headers: dict[str, bytes | None]
    partition: int
    offset: int
    timestamp_ms: int


class TopicReader:
    """Reads a topic from the beginning with its own group; keeps every record, duplicates included."""

    def __init__(self, bootstrap: str, topic: str, group: str) -> None:
        self.records: list[Record] = []
        self._c = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "auto.offset.reset": "earliest",
                            "enable.auto.commit": False})
        self._c.subscribe([topic])

    def poll(self, seconds: float) -> int:
        end = time.monotonic() + seconds
        got = 0
        while time.monotonic() < end:
            for m in self._c.consume(500, timeout=0.1):
                if m.error():
                    continue
                ts = m.timestamp()[1]
                self.records.append(Record(m.key().decode() if m.key() is not None else None, orjson.loads(m.value()),
                                           dict(m.headers() or []), m.partition(), m.offset(), ts))
                got += 1
        return got

    def ids(self) -> set[str]:
        return {r.key for r in self.records if r.key is not None}

    def wait_for(self, expected: set[str], timeout: float, *, alive: Sequence[WorkerProcess] = ()) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.poll(0.5)
            if expected <= self.ids():
                return
            for w in alive:
                assert w.proc is not None
                if w.proc.poll() is not None:
                    raise AssertionError(f"worker exited early ({w.proc.returncode}):\n{w.log()[-3000:]}")
        missing = expected - self.ids()
        raise AssertionError(f"{len(missing)} of {len(expected)} IDs missing after {timeout} s, e.g. "
                             f"{sorted(missing)[:5]}")

    def settle(self, quiet_s: float = 3.0) -> None:
        """Keeps reading until nothing new came for quiet_s (late duplicates included)."""
        while self.poll(quiet_s):
            pass

    def close(self) -> None:
        self._c.close()


def committed_offsets(bootstrap: str, group: str, topic: str, partitions: int,
                      config: Mapping[str, str] | None = None) -> dict[int, int]:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False, **(config or {})})
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                tps = c.committed([TopicPartition(topic, p) for p in range(partitions)], timeout=10)
                return {tp.partition: tp.offset for tp in tps}
            except KafkaException as exc:
                # A group coordinator still loading (a fresh broker) answers NOT_COORDINATOR for a while.
                if not exc.args[0].retriable() and exc.args[0].code() != KafkaError.NOT_COORDINATOR \
                        or time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
    finally:
        c.close()


def end_offsets(bootstrap: str, topic: str, partitions: int) -> dict[int, int]:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "offsets-probe"})
    try:
        return {p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in range(partitions)}
    finally:
        c.close()
