"""`keyword-embedder produce`: publish keywords from a TSV (id<TAB>text) or JSONL file to a topic."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
from confluent_kafka import KafkaError, Message, Producer
from tqdm import tqdm


class InputFileError(ValueError):
    """A line of the input file cannot be read; the message names the file and line."""


def read_keywords(path: Path, fmt: str = "auto") -> Iterator[tuple[str, str]]:
    """(id, text) pairs from `id<TAB>text` TSV or JSONL objects with "id" and "text"."""
    if fmt == "auto":
        fmt = "jsonl" if path.suffix in (".jsonl", ".json", ".ndjson") else "tsv"
    with path.open("r", encoding="utf-8", newline="\n") as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\n").rstrip("\r")
            if not line.strip():
                continue
            if fmt == "tsv":
                qid, sep, text = line.partition("\t")
                if not sep:
                    raise InputFileError(f"{path}:{lineno}: expected id<TAB>text")
                yield qid, text
            else:
                try:
                    obj = orjson.loads(line)
                    yield str(obj["id"]), str(obj["text"])
                except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
                    raise InputFileError(f"{path}:{lineno}: expected a JSON object with id and text ({exc})") from None


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bootstrap-servers", required=True)
    parser.add_argument("--topic", required=True)
    parser.add_argument("--input", required=True, type=Path, help="id<TAB>text TSV, or JSONL with id and text.")
    parser.add_argument("--format", choices=("auto", "tsv", "jsonl"), default="auto")
    parser.add_argument("--value-format", choices=("json", "raw"), default="json",
                        help="json: {\"id\", \"text\"} values; raw: the text as the value, the ID as the key.")
    parser.add_argument("--limit", type=int, default=0, help="Publish at most N keywords (0: all).")
    parser.add_argument("--kafka-config", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--no-progress", action="store_true")


def main(args: argparse.Namespace) -> int:
    config = {"bootstrap.servers": args.bootstrap_servers, "enable.idempotence": True, "acks": "all",
              "linger.ms": 20, "compression.type": "lz4"}
    for item in args.kafka_config:
        key, sep, value = item.partition("=")
        if not sep:
            print(f"keyword-embedder produce: --kafka-config {item!r}: expected key=value", file=sys.stderr)
            return 2
        config[key.strip()] = value.strip()
    producer = Producer(config)
    failures: list[str] = []

    def on_delivery(err: KafkaError | None, msg: Message) -> None:
        if err is not None:
            failures.append(f"{msg.key()!r}: {err}")

    sent = 0
    start = time.perf_counter()
    bar = tqdm(unit=" keywords", disable=args.no_progress or None, desc=f"produce {args.topic}",
               file=sys.stderr, mininterval=0.5)
    try:
        for qid, text in read_keywords(args.input, args.format):
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
    except (InputFileError, OSError) as exc:
        print(f"keyword-embedder produce: {exc}", file=sys.stderr)
        return 2
    finally:
        remaining = producer.flush(60)
        bar.close()
    elapsed = time.perf_counter() - start
    if remaining or failures:
        print(f"keyword-embedder produce: {len(failures) + remaining} of {sent} keywords not delivered"
              + (f"; first error: {failures[0]}" if failures else ""), file=sys.stderr)
        return 1
    print(f"produced {sent} keywords to {args.topic} in {elapsed:.2f} s ({sent / max(elapsed, 1e-9):,.0f} keywords/s)")
    return 0
