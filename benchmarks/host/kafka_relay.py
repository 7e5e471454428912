"""The floor under the worker's CPU per keyword through Kafka: a relay with the worker's own
consumer and producer settings (worker/kafka/consumer.py, producer.py) that does nothing but move
records. It consumes a poll's records at a time, writes one output record per input, keyed by the
input's key, with a prebuilt value of the null worker's size (a 384-float unit vector as JSON), and
counts the delivery reports; it commits once a second. No decode, no validation, no tokenizer, no
batching, no encoding, no offset tracking: what is left is confluent-kafka and librdkafka's own cost,
which no change inside the worker's Python can remove. For benchmarks/host/kafka_cpu.py (side
`relay`; `relay-batch`: the outputs through `Producer.produce_batch`, one call per poll;
`relay-headers`: each output with the worker's own headers, the default model's: what every
produce call and delivery report of the worker carries, and the relay's floor for its output).

    python -m kwe_host.kafka_relay run --bootstrap-servers ... --input-topic ... --output-topic ... \\
        --group-id ... --metrics-port N [--batch]

It answers /readyz on the metrics port once it holds partitions, as the worker does.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import orjson
from confluent_kafka import Consumer, Producer


def main(argv: list[str] | None = None) -> int:
    from worker.intake.flow import CONSUME_BATCH
    from worker.kafka.client_config import consumer_config, producer_config
    from worker.settings.schema import Settings

    ap = argparse.ArgumentParser()
    ap.add_argument("command", choices=["run"])
    ap.add_argument("--bootstrap-servers", required=True)
    ap.add_argument("--input-topic", required=True)
    ap.add_argument("--output-topic", required=True)
    ap.add_argument("--group-id", required=True)
    ap.add_argument("--metrics-port", type=int, required=True)
    ap.add_argument("--metrics-host", default="127.0.0.1")
    ap.add_argument("--batch", action="store_true", help="produce_batch, one call per poll")
    ap.add_argument("--headers", action="store_true", help="the worker's output headers on every record")
    args, _ = ap.parse_known_args(argv)

    settings = Settings(bootstrap_servers=args.bootstrap_servers, input_topic=args.input_topic,
                        output_topic=args.output_topic, group_id=args.group_id, metrics_port=0)
    cconf = consumer_config(settings)
    cconf.pop("logger", None)
    pconf = producer_config(settings)
    pconf.pop("logger", None)
    ready = threading.Event()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())

    class Probe(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200 if ready.is_set() else 503)
            self.end_headers()

        def log_message(self, *_: Any) -> None:
            pass

    server = ThreadingHTTPServer((args.metrics_host, args.metrics_port), Probe)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    consumer = Consumer(cconf)
    producer = Producer(pconf)
    consumer.subscribe([args.input_topic], on_assign=lambda c, parts: ready.set() if parts else None)
    # The null worker's value: a unit vector's 384 floats as JSON, the ID spliced in.
    head = b'{"id":"'
    tail = b'","embedding":' + orjson.dumps([1.0] + [0.0] * 383) + b"}"
    # The headers the worker writes on every output record (worker/formats/messages.py's OutputCodec,
    # the default model's, with a fingerprint of the length the worker writes).
    headers = ([("kwe-model", b"all-MiniLM-L6-v2"), ("kwe-encoding", b"float-list"),
                ("kwe-dim", b"384"), ("kwe-fingerprint", b"v1-0123456789abcdef")] if args.headers else None)
    delivered = [0]

    def on_delivery(err: Any, msg: Any) -> None:
        delivered[0] += 1

    out = args.output_topic
    last_commit = time.monotonic()
    while not stop.is_set():
        msgs = consumer.consume(CONSUME_BATCH, 0.1)
        if msgs:
            if args.batch:
                batch = [{"key": m.key(), "value": head + m.key() + tail} for m in msgs if m.error() is None]
                producer.produce_batch(out, batch, on_delivery=on_delivery)
            else:
                for m in msgs:
                    if m.error() is None:
                        key = m.key()
                        producer.produce(out, key=key, value=head + key + tail, on_delivery=on_delivery,
                                         headers=headers)
        producer.poll(0)
        now = time.monotonic()
        if now - last_commit > 1.0 and consumer.assignment():
            last_commit = now
            positions = [tp for tp in consumer.position(consumer.assignment()) if tp.offset >= 0]
            if positions:
                consumer.commit(offsets=positions, asynchronous=True)
    producer.flush(30)
    consumer.close()
    server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
