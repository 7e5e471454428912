"""Test helpers for the real broker: worker processes, producing keywords, reading topics back."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
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
    root: Path = ROOT  # the checkout whose worker runs (`python -m` imports from the working directory)
    prefix: Sequence[str] = ()  # e.g. ("ip", "netns", "exec", NS): the worker runs in a network namespace
    host: str = "127.0.0.1"  # where its metrics server listens and is probed
    # ONNX Runtime fp32 unless a test says otherwise: tests compare the worker's vectors with an
    # Embedder's on the same backend within 1e-5, and auto may choose differently per thread layout.
    backend: str = "onnxruntime"
    # A session of its own (as a terminal's job or a container's entry point): a test can signal its
    # process group, as Ctrl-C does, without signalling itself.
    new_session: bool = False

    def start(self) -> WorkerProcess:
        cmd = [*self.prefix, sys.executable, "-m", "worker.cli", "run", "--bootstrap-servers", self.bootstrap,
               "--input-topic", self.input_topic, "--output-topic", self.output_topic,
               "--dead-letter-topic", self.dead_letter_topic, "--group-id", self.group,
               "--metrics-port", str(self.metrics_port), "--metrics-host", self.host,
               "--log-format", "json", "--backend", self.backend, *self.extra]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KWE_")}
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=self.root, env=env,
                                     start_new_session=self.new_session)
        log.close()
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}"

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


def produce(bootstrap: str, topic: str,
            records: Iterable[tuple[bytes | None, bytes | None] | tuple[bytes | None, bytes | None, Any]],
            config: Mapping[str, str] | None = None) -> int:
    """Produces (key, value) or (key, value, headers) records; returns how many."""
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, "enable.idempotence": True, **(config or {})})
    n = 0
    for key, value, *rest in records:
        while True:
            try:
                p.produce(topic, key=key, value=value, headers=rest[0] if rest else None)
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

    def __init__(self, bootstrap: str, topic: str, group: str, *, isolation: str = "read_committed",
                 decode: Callable[[bytes], Any] = orjson.loads) -> None:
        self.records: list[Record] = []
        self._decode = decode  # the value's decoder (a Schema Registry deserialiser, ...)
        self._c = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "auto.offset.reset": "earliest",
                            "enable.auto.commit": False, "isolation.level": isolation})
        self._c.subscribe([topic])

    def poll(self, seconds: float) -> int:
        end = time.monotonic() + seconds
        got = 0
        while time.monotonic() < end:
            for m in self._c.consume(500, timeout=0.1):
                if m.error():
                    continue
                ts = m.timestamp()[1]
                self.records.append(Record(m.key().decode() if m.key() is not None else None, self._decode(m.value()),
                                           dict(m.headers() or []), m.partition(), m.offset(), ts))
                got += 1
        return got

    def ids(self) -> set[str]:
        return {r.key for r in self.records if r.key is not None}

    def key_counts(self) -> Counter[str | None]:
        """How many records of the topic carry each key: a record this reader saw twice (a
        re-fetch after its own connection to a restarted broker broke) counts once."""
        seen = {(r.partition, r.offset): r.key for r in self.records}
        return Counter(seen.values())

    @property
    def rereads(self) -> int:
        """Records this reader received more than once (the same partition and offset)."""
        return len(self.records) - len({(r.partition, r.offset) for r in self.records})

    def where(self, key: str) -> list[tuple[int, int, int]]:
        """(partition, offset, timestamp ms) of every record with `key`, in reading order."""
        return [(r.partition, r.offset, r.timestamp_ms) for r in self.records if r.key == key]

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

    def close(self, timeout: float = 30.0) -> None:
        """Leaves the reader's group, waiting at most `timeout`: after a cluster's nodes were killed,
        librdkafka's consumer close can block for good (seen once in the cluster test; the worker
        bounds its own close the same way, worker/kafka/consumer.py). The records are read by then."""
        closing = threading.Thread(target=self._c.close, name="topic-reader-close", daemon=True)
        closing.start()
        closing.join(timeout)
        if closing.is_alive():
            print(f"TopicReader: consumer close did not return within {timeout:.0f} s; left behind")


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


RawRecord = tuple[bytes | None, bytes | None, Sequence[tuple[bytes, bytes | None]]]  # key, value, headers


def produce_with_raw_headers(bootstrap: str, topic: str, records: Sequence[RawRecord], timeout_s: float = 30.0) -> None:
    """Produces records whose header names are arbitrary bytes (non-UTF-8 names included).

    Kafka allows any bytes as a header name, but neither confluent-kafka-python nor the Java
    client can write one that is not UTF-8: confluent-kafka turns a bytes name into its repr
    (b'\\xff' is written as the text "b'\\xff'") and a str with a lone surrogate crashes the
    process in librdkafka; Java encodes a String. librdkafka itself takes a name with a length,
    so this calls it directly (ctypes on the copy bundled in the confluent-kafka wheel).
    """
    import ctypes
    import glob

    import confluent_kafka

    libs = glob.glob(str(Path(confluent_kafka.__file__).parents[1] / "confluent_kafka.libs" / "librdkafka*.so*"))
    lib = ctypes.CDLL(libs[0] if libs else "librdkafka.so.1")
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    lib.rd_kafka_conf_new.restype = vp
    lib.rd_kafka_conf_set.argtypes = [vp, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, sz]
    lib.rd_kafka_new.restype = vp
    lib.rd_kafka_new.argtypes = [ctypes.c_int, vp, ctypes.c_char_p, sz]
    lib.rd_kafka_headers_new.restype = vp
    lib.rd_kafka_headers_new.argtypes = [sz]
    lib.rd_kafka_header_add.argtypes = [vp, ctypes.c_char_p, ctypes.c_ssize_t, ctypes.c_char_p, ctypes.c_ssize_t]
    lib.rd_kafka_produceva.restype = vp
    lib.rd_kafka_produceva.argtypes = [vp, vp, sz]
    lib.rd_kafka_error_string.restype = ctypes.c_char_p
    lib.rd_kafka_error_string.argtypes = [vp]
    lib.rd_kafka_flush.argtypes = [vp, ctypes.c_int]
    lib.rd_kafka_outq_len.argtypes = [vp]
    lib.rd_kafka_destroy.argtypes = [vp]

    class _Mem(ctypes.Structure):
        _fields_ = [("ptr", ctypes.c_char_p), ("size", sz)]

    class _U(ctypes.Union):
        _fields_ = [("cstr", ctypes.c_char_p), ("mem", _Mem), ("ptr", vp), ("i", ctypes.c_int),
                    ("_pad", ctypes.c_char * 64)]

    class _VU(ctypes.Structure):  # rd_kafka_vu_t
        _fields_ = [("vtype", ctypes.c_int), ("u", _U)]

    vt_topic, vt_value, vt_key, vt_msgflags, vt_headers, msg_f_copy = 1, 4, 5, 7, 10, 0x2
    err = ctypes.create_string_buffer(512)
    conf = lib.rd_kafka_conf_new()
    for k, v in (("bootstrap.servers", bootstrap), ("enable.idempotence", "true")):
        if lib.rd_kafka_conf_set(conf, k.encode(), v.encode(), err, 512) != 0:
            raise RuntimeError(err.value.decode())
    rk = lib.rd_kafka_new(0, conf, err, 512)  # RD_KAFKA_PRODUCER; takes over conf
    if not rk:
        raise RuntimeError(err.value.decode())
    try:
        for key, value, headers in records:
            hdrs = lib.rd_kafka_headers_new(len(headers))
            for name, hval in headers:
                lib.rd_kafka_header_add(hdrs, name, len(name), hval, -1 if hval is None else len(hval))
            vus = (_VU * 5)()
            vus[0].vtype, vus[0].u.cstr = vt_topic, topic.encode()
            vus[1].vtype, vus[1].u.mem = vt_value, _Mem(value, 0 if value is None else len(value))
            vus[2].vtype, vus[2].u.mem = vt_key, _Mem(key, 0 if key is None else len(key))
            vus[3].vtype, vus[3].u.i = vt_msgflags, msg_f_copy
            vus[4].vtype, vus[4].u.ptr = vt_headers, hdrs  # owned by librdkafka from here on
            error = lib.rd_kafka_produceva(rk, ctypes.cast(vus, vp), 5)
            if error:
                raise RuntimeError(f"produce failed: {lib.rd_kafka_error_string(error).decode()}")
        lib.rd_kafka_flush(rk, int(timeout_s * 1000))
        if lib.rd_kafka_outq_len(rk):
            raise RuntimeError(f"records not delivered to {topic} within {timeout_s} s")
    finally:
        lib.rd_kafka_destroy(rk)


def stream_through_worker(bootstrap: str, topics: tuple[str, str, str], group: str, log_path: Path,
                          queries: Sequence[tuple[str, str]], args: Sequence[str], *,
                          backend: str = "onnxruntime") -> tuple[WorkerProcess, TopicReader, TopicReader]:
    """The queries and one record without text ("bad-1") through one worker process with `args`:
    waits for every query's output and the dead letter, stops the worker (exit 0 asserted), and
    returns the stopped worker (its log) and the output and dead-letter readers, closed, with what
    they read."""
    inp, out, dlq = topics
    produce_queries(bootstrap, inp, queries)
    produce(bootstrap, inp, [(b"bad-1", b'{"id": "bad-1"}')])
    w = WorkerProcess(bootstrap, inp, out, dlq, group, log_path, tuple(args), backend=backend)
    w.start()
    reader = TopicReader(bootstrap, out, group + "-reader")
    dead = TopicReader(bootstrap, dlq, group + "-dlq")
    try:
        reader.wait_for({qid for qid, _ in queries}, 300, alive=[w])
        dead.wait_for({"bad-1"}, 60, alive=[w])
        assert w.stop() == 0
    finally:
        if w.proc and w.proc.poll() is None:
            w.kill()
        reader.close()
        dead.close()
    return w, reader, dead
