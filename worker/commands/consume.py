"""`keyword-embedder consume`: read records from a topic into a JSONL file.

Each line is the record's JSON value (an embedding, or a dead letter) with a "_kafka" object
added: key, partition, offset, timestamp_ms and headers. Values that are not JSON objects are
kept under "value" as text. Stops after --max-messages records, or when no record came for
--idle-timeout seconds.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import orjson
from confluent_kafka import Consumer, KafkaError, Message

from worker.kafka.client_config import add_client_flags, client_config
from worker.kafka.errors import fatal_reason
from worker.settings.loader import load_settings


def record_of(msg: Message) -> dict[str, Any]:
    raw = msg.value()
    try:
        value = orjson.loads(raw) if raw is not None else None
    except orjson.JSONDecodeError:
        value = None
    record: dict[str, Any] = value if isinstance(value, dict) else {
        "value": raw.decode("utf-8", "replace") if raw is not None else None}
    ts_type, ts = msg.timestamp()
    key = msg.key()
    record["_kafka"] = {
        "key": key.decode("utf-8", "replace") if key is not None else None,
        "partition": msg.partition(),
        "offset": msg.offset(),
        "timestamp_ms": ts if ts_type else None,
        "headers": {k: (v.decode("utf-8", "replace") if v is not None else None) for k, v in (msg.headers() or [])},
    }
    return record


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bootstrap-servers", required=True)
    parser.add_argument("--topic", required=True)
    parser.add_argument("--output", required=True, type=Path, help="JSONL file ('-' for stdout).")
    parser.add_argument("--group", default="", help="Consumer group (default: a fresh one, reading from the start).")
    parser.add_argument("--max-messages", type=int, default=0, help="Stop after N records (0: no limit).")
    parser.add_argument("--idle-timeout", type=float, default=10.0,
                        help="Stop when no record arrived for this many seconds (0: never).")
    parser.add_argument("--read-uncommitted", action="store_true",
                        help="Also show records of open and aborted transactions (default: read_committed, "
                             "what a downstream reader of an exactly-once worker must use).")
    add_client_flags(parser)


def main(args: argparse.Namespace) -> int:
    config: dict[str, Any] = {
        "bootstrap.servers": args.bootstrap_servers,
        "group.id": args.group or f"keyword-embedder-consume-{uuid.uuid4().hex[:8]}",
        "auto.offset.reset": "earliest",
        "enable.auto.commit": bool(args.group),
        "enable.partition.eof": False,
        "isolation.level": "read_uncommitted" if args.read_uncommitted else "read_committed",
    }
    # A bad setting is a SettingsError: the CLI prints its one line, exit 2.
    config.update(client_config(load_settings(args)))
    fatal: list[str] = []

    def on_error(err: KafkaError, topic: str | None = None) -> None:
        # Wrong credentials, an untrusted certificate, a missing ACL: stop instead of retrying.
        reason = fatal_reason(err, topic=topic or args.topic, op="read", group=config["group.id"])
        if reason is not None and not fatal:
            fatal.append(reason)

    consumer = Consumer({**config, "error_cb": on_error})
    consumer.subscribe([args.topic])
    out = sys.stdout.buffer if str(args.output) == "-" else args.output.open("wb")
    count = 0
    start = last = time.monotonic()
    try:
        while (not args.max_messages or count < args.max_messages) and not fatal:
            want = min(500, args.max_messages - count) if args.max_messages else 500
            msgs = consumer.consume(num_messages=want, timeout=0.2)
            now = time.monotonic()
            for msg in msgs:
                err = msg.error()
                if err is not None:
                    on_error(err, msg.topic())
                    if err.code() != KafkaError._PARTITION_EOF and not fatal:
                        print(f"keyword-embedder consume: {err}", file=sys.stderr)
                    continue
                out.write(orjson.dumps(record_of(msg)) + b"\n")
                count += 1
                last = now
            if args.idle_timeout and now - last >= args.idle_timeout:
                break
    except KeyboardInterrupt:
        pass
    finally:
        consumer.close()
        if out is not sys.stdout.buffer:
            out.close()
    elapsed = time.monotonic() - start
    if fatal:
        print(f"keyword-embedder consume: {fatal[0]}", file=sys.stderr)
        return 1
    print(f"consumed {count} records from {args.topic} in {elapsed:.2f} s", file=sys.stderr)
    return 0
