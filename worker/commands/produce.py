"""`keyword-embedder produce`: publish keywords from a TSV (id<TAB>text) or JSONL file to a topic.

As fast as the broker takes them (the default), or open-loop at `--rate` keywords per second
(see worker/benchmark/loadgen.py): each record's timestamp is set when it is sent, so an embedding's
output timestamp minus its input's is the end-to-end latency.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
from confluent_kafka import KafkaError, Message, Producer
from tqdm import tqdm

from worker.benchmark.loadgen import SPACINGS, Lateness, arrivals, cycled
from worker.formats.keyword_files import FORMATS, BadLines, KeywordFileError, read_keywords
from worker.kafka.client_config import add_client_flags, client_config
from worker.kafka.errors import fatal_reason
from worker.settings.loader import load_settings


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bootstrap-servers", required=True)
    parser.add_argument("--topic", required=True)
    parser.add_argument("--input", required=True, type=Path, help="id<TAB>text TSV, or JSONL with id and text.")
    parser.add_argument("--format", choices=FORMATS, default="auto")
    parser.add_argument("--value-format", choices=("json", "raw"), default="json",
                        help="json: {\"id\", \"text\"} values; raw: the text as the value, the ID as the key.")
    parser.add_argument("--limit", type=int, default=0, help="Publish at most N keywords (0: all).")
    parser.add_argument("--strict", action="store_true",
                        help="Refuse a file with a bad line (not UTF-8, not id<TAB>text / JSON); default: skip "
                             "and count them.")
    parser.add_argument("--rate", type=float, default=0.0,
                        help="Open loop: send N keywords per second on a fixed schedule, whatever the consumers "
                             "do (0: as fast as the broker takes them). Each record is timestamped when sent.")
    parser.add_argument("--spacing", choices=SPACINGS, default="poisson",
                        help="With --rate: Poisson arrivals or evenly spaced ones.")
    parser.add_argument("--duration", type=float, default=0.0,
                        help="With --rate: send for S seconds, cycling the file (repeated IDs get a ~N suffix); "
                             "0: until the file ends.")
    parser.add_argument("--seed", type=int, default=0, help="With --rate --spacing poisson: the schedule's seed.")
    parser.add_argument("--no-progress", action="store_true")
    add_client_flags(parser)


def main(args: argparse.Namespace) -> int:
    if args.rate < 0 or args.duration < 0 or (args.duration and not args.rate):
        print("keyword-embedder produce: --rate and --duration must be >= 0, and --duration needs --rate",
              file=sys.stderr)
        return 2
    # Open loop measures latency: a record should reach the broker when it is stamped, not up
    # to linger.ms later (--kafka-config linger.ms=... still overrides).
    config = {"bootstrap.servers": args.bootstrap_servers, "enable.idempotence": True, "acks": "all",
              "linger.ms": 0 if args.rate else 20}
    # A bad setting is a SettingsError: the CLI prints its one line, exit 2.
    config.update(client_config(load_settings(args)))
    failures: list[str] = []
    fatal: list[str] = []

    def on_error(err: KafkaError) -> None:
        # Wrong credentials, an untrusted certificate, a missing ACL: stop instead of retrying.
        reason = fatal_reason(err, topic=args.topic, op="write")
        if reason is not None and not fatal:
            fatal.append(reason)

    def on_delivery(err: KafkaError | None, msg: Message) -> None:
        if err is not None:
            failures.append(f"{msg.key()!r}: {err}")
            on_error(err)

    producer = Producer({**config, "error_cb": on_error})

    sent = 0
    bad = None if args.strict else BadLines()
    late = Lateness()
    schedule: Iterator[float] = iter(())
    start = time.perf_counter()
    bar = tqdm(unit=" keywords", disable=args.no_progress or None, desc=f"produce {args.topic}",
               file=sys.stderr, mininterval=0.5)
    try:
        rows = read_keywords(args.input, args.format, bad=bad)
        if args.rate:
            rows = cycled(rows) if args.duration else rows
            schedule = arrivals(args.rate, args.duration or float("inf"), args.spacing, seed=args.seed)
        for qid, text in rows:
            if args.limit and sent >= args.limit:
                break
            if args.rate:
                at = next(schedule, None)
                if at is None:
                    break
                wait = start + at - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
                else:
                    late.add(-wait)
            value = text.encode("utf-8") if args.value_format == "raw" else orjson.dumps({"id": qid, "text": text})
            while not fatal:
                try:
                    # Stamped here, at send, not when the broker or a linger timer gets to it.
                    producer.produce(args.topic, key=qid.encode("utf-8"), value=value, on_delivery=on_delivery,
                                     timestamp=int(time.time() * 1000))
                    break
                except BufferError:
                    producer.poll(0.05)
            producer.poll(0)
            if fatal:
                break
            sent += 1
            bar.update(1)
    except KeywordFileError as exc:
        print(f"keyword-embedder produce: {exc}", file=sys.stderr)
        return 2
    finally:
        remaining = _flush(producer, fatal)
        bar.close()
    elapsed = time.perf_counter() - start
    if bad is not None and bad.count:
        print(f"keyword-embedder produce: {bad.summary(args.input)}", file=sys.stderr)
    if fatal:
        print(f"keyword-embedder produce: {fatal[0]}", file=sys.stderr)
        return 1
    if remaining or failures:
        print(f"keyword-embedder produce: {len(failures) + remaining} of {sent} keywords not delivered"
              + (f"; first error: {failures[0]}" if failures else ""), file=sys.stderr)
        return 1
    print(f"produced {sent} keywords to {args.topic} in {elapsed:.2f} s ({sent / max(elapsed, 1e-9):,.0f} keywords/s)"
          + (f"; open loop at {args.rate:g}/s ({args.spacing}), behind schedule: max {late.max_s * 1000:.0f} ms"
             if args.rate else ""))
    return 0


def _flush(producer: Producer, fatal: list[str], timeout_s: float = 60.0) -> int:
    """Waits for outstanding deliveries, giving up at once when a fatal error came."""
    deadline = time.monotonic() + timeout_s
    remaining = len(producer)
    while remaining and not fatal and time.monotonic() < deadline:
        remaining = producer.flush(0.2)
    return remaining
