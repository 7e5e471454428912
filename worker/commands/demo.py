"""`keyword-embedder demo`: the whole job end to end against a running broker.

Creates fresh topics (input with several partitions, output, dead-letter), starts two
workers in one consumer group (real `keyword-embedder run` processes), publishes the
keyword sample shipped in the repo plus a few deliberately broken messages, reads every
embedding back, prints a summary, and stops what it started. Exits 1 if any keyword is
missing from the output, or a broken message is missing from the dead-letter topic.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections import defaultdict
from pathlib import Path

import numpy as np
import orjson
from confluent_kafka import Consumer, KafkaError, Message, Producer
from tqdm import tqdm

from worker.embedding_cache import hit_rate_line
from worker.formats.keyword_files import read_keywords
from worker.formats.messages import decode_embedding
from worker.kafka.admin import ensure_topics
from worker.kafka.client_config import add_client_flags, client_config, client_env
from worker.settings.loader import load_settings
from worker.settings.schema import SettingsError

SAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "local" / "sample" / "keywords.tsv"
BROKEN: list[tuple[bytes | None, bytes | None]] = [
    (b"broken-1", b'{"id": "broken-1", "text": '),
    (b"broken-2", b'["not", "an", "object"]'),
    (b"broken-3", b'{"text": "no id here"}'),
    (b"broken-4", b'{"id": 4, "text": "numeric id"}'),
    (b"broken-5", b'{"id": "broken-5", "text": "   "}'),
    (b"broken-6", b'{"id": "broken-6", "text": "caf\xe9 latin-1"}'),
    (b"broken-7", None),
    (b"broken-8", orjson.dumps({"id": "broken-8", "text": "x" * 20000})),
]
NEIGHBOUR_PROBES = ("cheap flights to new york", "how to treat a headache without medication", "used cars")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bootstrap-servers", default=os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092"))
    parser.add_argument("--input", type=Path, default=SAMPLE, help="id<TAB>text keywords to publish.")
    parser.add_argument("--limit", type=int, default=0, help="Publish only the first N keywords.")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--partitions", type=int, default=6)
    parser.add_argument("--timeout", type=float, default=300.0, help="Give up waiting for output after this.")
    parser.add_argument("--processing-guarantee", choices=("at-least-once", "exactly-once"), default="at-least-once",
                        help="The workers' delivery guarantee (docs/delivery.md).")
    parser.add_argument("--keep-topics", action="store_true", help="Do not delete the demo topics at the end.")
    add_client_flags(parser)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str, timeout_s: float = 2.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _metrics(port: int, timeout_s: float = 10.0) -> str:
    """A worker's /metrics text, or "" when it does not answer in time (a loaded 2-core box): the
    summary then leaves that worker out of its backend, padding and cache lines, and the demo's
    verdict, which rests on the topics alone, stands."""
    try:
        return _get(f"http://127.0.0.1:{port}/metrics", timeout_s=timeout_s)[1]
    except OSError as exc:
        print(f"demo: the metrics of the worker on port {port} were not read ({exc}); the summary leaves it out",
              file=sys.stderr)
        return ""


def _metric_sums(text: str, name: str) -> dict[str, float]:
    """Sums of a per-bucket counter: {bucket label: value}."""
    out: dict[str, float] = {}
    pattern = re.compile(rf'^{name}\{{.*?bucket="([^"]+)".*?\}} (\S+)$')
    for line in text.splitlines():
        m = pattern.match(line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def _metric_value(text: str, name: str) -> float:
    """The value of an unlabelled series (0.0 when the worker does not export it)."""
    m = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def main(args: argparse.Namespace) -> int:
    bootstrap = args.bootstrap_servers
    try:
        settings = load_settings(args)
        security = client_config(settings)
    except SettingsError as exc:
        print(f"keyword-embedder demo: {exc}", file=sys.stderr)
        return 2
    keywords = list(read_keywords(args.input))
    if args.limit:
        keywords = keywords[: args.limit]
    texts = dict(keywords)
    run = f"demo-{time.strftime('%H%M%S')}-{uuid.uuid4().hex[:4]}"
    topic_in, topic_out, topic_dlq = f"{run}-keywords", f"{run}-embeddings", f"{run}-keywords-dlq"
    ensure_topics(bootstrap, {topic_in: args.partitions, topic_out: args.partitions, topic_dlq: 1},
                  extra_config=security)
    print(f"demo: broker {bootstrap}; topics {topic_in} ({args.partitions} partitions), {topic_out}, {topic_dlq}")

    logdir = Path(tempfile.mkdtemp(prefix="keyword-embedder-demo-"))
    threads = max(1, (os.cpu_count() or 1) // args.workers)
    procs: list[tuple[subprocess.Popen[bytes], int]] = []
    for i in range(args.workers):
        port = _free_port()
        log = (logdir / f"worker-{i}.log").open("wb")
        cmd = [sys.executable, "-m", "worker.cli", "run", "--bootstrap-servers", bootstrap, "--input-topic", topic_in,
               "--output-topic", topic_out, "--dead-letter-topic", topic_dlq, "--group-id", run,
               "--metrics-port", str(port), "--metrics-host", "127.0.0.1", "--intra-op-threads", str(threads),
               "--log-format", "json", "--processing-guarantee", args.processing_guarantee,
               "--member-id", f"demo-{i}"]
        # The workers get the client settings through the environment: a password in argv is public.
        env = {**os.environ, **client_env(settings)}
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), port))
    print(f"demo: started {args.workers} workers in group {run} ({threads} inference thread(s) each); "
          f"logs in {logdir}")
    try:
        return _run(args, bootstrap, security, keywords, texts, topic_in, topic_out, topic_dlq, procs, logdir)
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc, _ in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        if not args.keep_topics:
            from confluent_kafka.admin import AdminClient

            AdminClient({"bootstrap.servers": bootstrap, **security}).delete_topics([topic_in, topic_out, topic_dlq])


def _run(args: argparse.Namespace, bootstrap: str, security: dict[str, str], keywords: list[tuple[str, str]],
         texts: dict[str, str],
         topic_in: str, topic_out: str, topic_dlq: str, procs: list[tuple[subprocess.Popen[bytes], int]],
         logdir: Path) -> int:
    deadline = time.monotonic() + 120
    for proc, port in procs:
        while _get_status(port) != 200:
            if proc.poll() is not None:
                print(f"demo: a worker exited with {proc.returncode}; see {logdir}", file=sys.stderr)
                return 1
            if time.monotonic() > deadline:
                print(f"demo: workers not ready after 120 s; see {logdir}", file=sys.stderr)
                return 1
            time.sleep(0.1)
    print("demo: both workers joined the group and own partitions (/readyz is 200)")
    print(f"demo: inference backend {_backend_line(_metrics(procs[0][1]))}")

    sent_ms: dict[str, int] = {}

    def on_delivery(err: KafkaError | None, msg: Message) -> None:
        if err is None and msg.key() is not None:
            sent_ms[msg.key().decode()] = msg.timestamp()[1]

    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 10, "enable.idempotence": True, **security})
    start = time.time()
    for qid, text in tqdm(keywords, desc="publish", unit=" kw", file=sys.stderr, mininterval=0.3):
        while True:
            try:
                producer.produce(topic_in, key=qid.encode(), value=orjson.dumps({"id": qid, "text": text}),
                                 on_delivery=on_delivery)
                break
            except BufferError:
                producer.poll(0.05)
        producer.poll(0)
    for key, value in BROKEN:
        producer.produce(topic_in, key=key, value=value)
    producer.flush(60)

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"{topic_out}-reader",
                         "auto.offset.reset": "earliest", "enable.auto.commit": False,
                         "isolation.level": "read_committed", **security})
    consumer.subscribe([topic_out, topic_dlq])
    vectors: dict[str, np.ndarray] = {}
    out_ms: dict[str, int] = {}
    dead: dict[str, str] = {}
    expected = set(texts)
    bar = tqdm(total=len(expected), desc="embeddings", unit=" kw", file=sys.stderr, mininterval=0.3)
    last_out = start
    wait_until = time.monotonic() + args.timeout
    while (not expected <= vectors.keys() or len(dead) < len(BROKEN)) and time.monotonic() < wait_until:
        for msg in consumer.consume(500, timeout=0.2):
            if msg.error():
                continue
            value = orjson.loads(msg.value())
            if msg.topic() == topic_dlq:
                dead[value.get("key_b64") or ""] = value["reason"]
                continue
            qid = value["id"]
            if qid not in vectors:
                bar.update(1)
            vectors[qid] = decode_embedding(value["embedding"], value["encoding"])
            out_ms[qid] = msg.timestamp()[1]
            last_out = max(last_out, msg.timestamp()[1] / 1000.0)
        if any(proc.poll() is not None for proc, _ in procs):
            break
    bar.close()
    consumer.close()
    metrics_text = [_metrics(port) for _, port in procs]

    missing = expected - vectors.keys()
    elapsed = last_out - start
    latencies = np.array([out_ms[q] - sent_ms[q] for q in vectors if q in sent_ms], dtype=np.float64)
    print()
    print("=" * 72)
    print(f"processing guarantee   {args.processing_guarantee:>10}   (read back read_committed)")
    print(f"keywords published     {len(keywords):>10,}   (+{len(BROKEN)} broken messages)")
    print(f"embeddings received    {len(vectors):>10,}   missing: {len(missing)}")
    print(f"dead-lettered          {len(dead):>10,}   reasons: {', '.join(sorted(set(dead.values())))}")
    print(f"throughput             {len(vectors) / max(elapsed, 1e-9):>10,.0f} keywords/s "
          f"(first publish to last embedding, {elapsed:.1f} s, {len(procs)} workers, {os.cpu_count()} cores)")
    if latencies.size:
        p50, p99 = np.percentile(latencies, [50, 99])
        print(f"end-to-end latency     p50 {p50:,.0f} ms   p99 {p99:,.0f} ms "
              "(input timestamp to output timestamp; the whole sample is published at once, so this is queueing)")
    real: dict[str, float] = defaultdict(float)
    padded: dict[str, float] = defaultdict(float)
    for text in metrics_text:
        for b, v in _metric_sums(text, "kwe_real_tokens_total").items():
            real[b] += v
        for b, v in _metric_sums(text, "kwe_padded_tokens_total").items():
            padded[b] += v
    if padded:
        print("padding waste by bucket (bound: waste of its padded tokens, share of all tokens)")
        total = sum(padded.values())
        for b in sorted(padded, key=lambda s: int(s)):
            if padded[b]:
                print(f"    <= {int(b):>3} tokens   {1 - real[b] / padded[b]:6.1%}   {padded[b] / total:6.1%}")
        print(f"    overall        {1 - sum(real.values()) / total:6.1%}")
    cache = [sum(_metric_value(t, f"kwe_cache_{c}") for t in metrics_text)
             for c in ("hits_total", "misses_total", "evictions_total")]
    if cache[0] + cache[1]:
        print(f"embedding cache        {hit_rate_line(*cache)}")
    _neighbours(vectors, texts)
    print("=" * 72)
    if missing:
        print(f"demo: FAILED: {len(missing)} keywords missing from {topic_out}, e.g. {sorted(missing)[:5]}",
              file=sys.stderr)
        return 1
    if len(dead) < len(BROKEN):
        print(f"demo: FAILED: {len(BROKEN) - len(dead)} broken messages missing from {topic_dlq}", file=sys.stderr)
        return 1
    print("demo: OK: every keyword embedded, every broken message dead-lettered")
    return 0


def _get_status(port: int) -> int | None:
    try:
        return _get(f"http://127.0.0.1:{port}/readyz")[0]
    except OSError:
        return None


def _neighbours(vectors: dict[str, np.ndarray], texts: dict[str, str]) -> None:
    if len(vectors) < 10:
        return
    from worker import Embedder

    ids = list(vectors)
    matrix = np.stack([vectors[q] for q in ids])
    probes = Embedder().embed(list(NEIGHBOUR_PROBES))
    # Cosine even for a model whose vectors are not unit length (the packaged one's are).
    matrix /= np.maximum(np.linalg.norm(matrix, axis=1, keepdims=True), 1e-12)
    probes /= np.maximum(np.linalg.norm(probes, axis=1, keepdims=True), 1e-12)
    print("nearest neighbours among the embedded keywords (cosine):")
    for probe, vec in zip(NEIGHBOUR_PROBES, probes):
        scores = matrix @ vec
        picked: list[str] = []
        seen = {probe.lower()}
        for i in np.argsort(-scores):
            text = texts[ids[i]]
            if text.lower().strip() not in seen:  # the sample repeats popular queries; show distinct ones
                seen.add(text.lower().strip())
                picked.append(f"{text!r} {scores[i]:.2f}")
            if len(picked) == 3:
                break
        shown = "; ".join(picked)
        print(f"    {probe!r} -> {shown}")


def _backend_line(metrics_text: str) -> str:
    """What kwe_backend_info says the worker runs on: "openvino (bf16, AMD EPYC)" (auto chose it at start)."""
    for line in metrics_text.splitlines():
        if line.startswith("kwe_backend_info{"):
            labels = dict(part.split("=", 1) for part in line[line.index("{") + 1:line.rindex("}")].split('",'))
            get = {k.strip(): v.strip('"') for k, v in labels.items()}.get
            return f"{get('backend', '?')} ({get('precision', '?')}, {get('cpu', '?')})"
    return "unknown (no kwe_backend_info)"
