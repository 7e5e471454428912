"""`keyword-embedder produce`: publish keywords from a TSV (id<TAB>text) or JSONL file to a topic."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import orjson
from confluent_kafka import KafkaError, Message, Producer
from tqdm import tqdm

from worker.config import SettingsError, kafka_pairs
from worker.keyword_files import FORMATS, BadLines, KeywordFileError, read_keywords


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bootstrap-servers", required=True)
    parser.add_argument("--topic", required=True)
    parser.add_argument("--input", required=True, type=Path, help="id<TAB>text TSV, or JSONL with id and text.")
    parser.add_argument("--format", choices=FORMATS, default="auto")
    parser.add_argument("--value-format", choices=("json", "raw"), default="json",
                        help="json: {\"id\", \"text\"} values; raw: the text as the value, the ID as the key.")
    parser.add_argument("--limit", type=int, default=0, help="Publish at most N keywords (0: all).")
    parser.add_argument("--kafka-config", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--strict", action="store_true",
                        help="Refuse a file with a bad line (not UTF-8, not id<TAB>text / JSON); default: skip "
                             "and count them.")
    parser.add_argument("--no-progress", action="store_true")


def main(args: argparse.Namespace) -> int:
    config = {"bootstrap.servers": args.bootstrap_servers, "enable.idempotence": True, "acks": "all",
              "linger.ms": 20}
    try:
        config.update(kafka_pairs(args.kafka_config))
    except SettingsError as exc:
        print(f"keyword-embedder produce: {exc}", file=sys.stderr)
        return 2
    producer = Producer(config)
    failures: list[str] = []

    def on_delivery(err: KafkaError | None, msg: Message) -> None:
        if err is not None:
            failures.append(f"{msg.key()!r}: {err}")

    sent = 0
    bad = None if args.strict else BadLines()
    start = time.perf_counter()
    bar = tqdm(unit=" keywords", disable=args.no_progress or None, desc=f"produce {args.topic}",
               file=sys.stderr, mininterval=0.5)
    try:
        for qid, text in read_keywords(args.input, args.format, bad=bad):
            if args.limit and sent >= args.limit:
                break
            value = text.encode("utf-8") if args.value_format == "raw" else orjson.dumps({"id": qid, "text": text})
            while True:
                try:
                    producer.produce(args.topic, key=qid.encode("utf-8"), value=value, on_delivery=on_delivery)
                    break
                except BufferError:
                    producer.poll(0.05)
            producer.poll(0)
            sent += 1
            bar.update(1)
    except KeywordFileError as exc:
        print(f"keyword-embedder produce: {exc}", file=sys.stderr)
        return 2
    finally:
        remaining = producer.flush(60)
        bar.close()
    elapsed = time.perf_counter() - start
    if bad is not None and bad.count:
        print(f"keyword-embedder produce: {bad.summary(args.input)}", file=sys.stderr)
    if remaining or failures:
        print(f"keyword-embedder produce: {len(failures) + remaining} of {sent} keywords not delivered"
              + (f"; first error: {failures[0]}" if failures else ""), file=sys.stderr)
        return 1
    print(f"produced {sent} keywords to {args.topic} in {elapsed:.2f} s ({sent / max(elapsed, 1e-9):,.0f} keywords/s)")
    return 0
