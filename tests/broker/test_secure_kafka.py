"""Against the real secured broker (deploy/local/kafka.sh start --secure): SASL_SSL with SCRAM-SHA-512,
a local CA, the StandardAuthorizer and the ACLs of docs/security.md.

Topics and groups are named `keywords.<id>`, `embeddings.<id>`, `keywords-dlq.<id>`,
`keyword-embedder.<id>`, `keyword-embedder-reader-<id>`: the ACLs grant the default names
literally and these through prefixed patterns, so each test has fresh topics and offsets.
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import orjson
import pytest
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from tests.conftest import SecureCluster
from tests.kafka_tools import ROOT, WorkerProcess, committed_offsets, http_get, load_queries, produce, produce_queries
from worker.formats.messages import decode_embedding

FATAL_EVENT = "worker stopped on a fatal error"
EXIT_BOUND_S = 30.0


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "worker.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def assert_no_secret(text: str, cluster: SecureCluster, where: str) -> None:
    for pw in cluster.passwords():
        assert pw not in text, f"a password leaked into {where}"


@pytest.fixture()
def secure_topics(kafka_secure: SecureCluster) -> Iterator[Callable[..., str]]:
    """make(name, partitions) creates `name` as admin (the super user); all are deleted afterwards."""
    admin = AdminClient(kafka_secure.config("admin"))
    created: list[str] = []

    def make(name: str, partitions: int = 1) -> str:
        admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=1)],
                            operation_timeout=30)[name].result(timeout=30)
        created.append(name)
        return name

    yield make
    if created:
        for fut in admin.delete_topics(created, operation_timeout=30).values():
            try:
                fut.result(timeout=30)
            except Exception:  # noqa: BLE001 - best-effort cleanup
                pass


def _id() -> str:
    return uuid.uuid4().hex[:10]


def _worker(cluster: SecureCluster, tmp_path: Path, inp: str, out: str, dlq: str, group: str,
            *extra: str) -> WorkerProcess:
    return WorkerProcess(cluster.bootstrap, inp, out, dlq, group, tmp_path / f"worker-{_id()}.log",
                         extra=("--intra-op-threads", "1", *extra))


# ------------------------------------------------------------------ the happy path, least privilege


def test_producer_worker_reader_end_to_end(kafka_secure: SecureCluster, secure_topics: Callable[..., str],
                                           tmp_path: Path) -> None:
    run = _id()
    inp = secure_topics(f"keywords.{run}", 3)
    out = secure_topics(f"embeddings.{run}", 3)
    dlq = secure_topics(f"keywords-dlq.{run}", 1)
    queries = load_queries(0, 300)
    src = tmp_path / "q.tsv"
    src.write_text("".join(f"{q}\t{t}\n" for q, t in queries), encoding="utf-8")

    # producer, through the CLI and its properties file
    got = cli("produce", "--bootstrap-servers", kafka_secure.bootstrap, "--topic", inp, "--input", str(src),
              "--no-progress", "--kafka-config-file", str(kafka_secure.properties("producer")))
    assert got.returncode == 0, got.stderr
    produce(kafka_secure.bootstrap, inp, [(b"bad-1", b"{not json")], kafka_secure.config("producer"))

    # worker, through the typed settings and a password file (as a Kubernetes secret mounts it)
    pw_file = tmp_path / "worker-password"
    pw_file.write_text(kafka_secure.config("worker")["sasl.password"] + "\n", encoding="utf-8")
    worker = _worker(kafka_secure, tmp_path, inp, out, dlq, f"keyword-embedder.{run}",
                     "--security-protocol", "SASL_SSL", "--sasl-mechanism", "SCRAM-SHA-512",
                     "--sasl-username", "worker", "--sasl-password-file", str(pw_file),
                     "--ssl-ca-location", str(kafka_secure.config_dir / "ca.pem")).start()
    try:
        worker.wait_ready()
        # reader, through the CLI, with a group its prefixed ACL allows
        dst = tmp_path / "out.jsonl"
        got = cli("consume", "--bootstrap-servers", kafka_secure.bootstrap, "--topic", out, "--output", str(dst),
                  "--group", f"keyword-embedder-reader-{run}", "--max-messages", str(len(queries)),
                  "--idle-timeout", "60", "--kafka-config-file", str(kafka_secure.properties("reader")))
        assert got.returncode == 0, got.stderr
        dead = tmp_path / "dlq.jsonl"
        got = cli("consume", "--bootstrap-servers", kafka_secure.bootstrap, "--topic", dlq, "--output", str(dead),
                  "--group", f"keyword-embedder-reader-dlq-{run}", "--max-messages", "1", "--idle-timeout", "60",
                  "--kafka-config-file", str(kafka_secure.properties("reader")))
        assert got.returncode == 0, got.stderr
        status, metrics = http_get(worker.url + "/metrics")
        assert status == 200
    finally:
        assert worker.stop() == 0, worker.log()[-3000:]

    records = {r["id"]: r for r in map(orjson.loads, dst.read_bytes().splitlines())}
    assert set(records) == {q for q, _ in queries}
    from worker import Embedder

    texts = [t for _, t in queries]
    expected = Embedder(backend="onnxruntime").embed(texts)
    got_vectors = np.stack([decode_embedding(records[q]["embedding"], records[q]["encoding"]) for q, _ in queries])
    assert np.abs(got_vectors - expected).max() < 1e-5
    [dead_letter] = [orjson.loads(line) for line in dead.read_bytes().splitlines()]
    assert dead_letter["reason"] == "malformed_json"
    assert b"kwe_produced_messages_total 300.0" in metrics
    assert_no_secret(worker.log(), kafka_secure, "the worker's log")
    assert_no_secret(metrics.decode(), kafka_secure, "/metrics")


# ------------------------------------------------------------------ clear, fast failures


def _fail_case(kafka_secure: SecureCluster, secure_topics: Callable[..., str], tmp_path: Path, case: str,
               other_ca: Path) -> tuple[WorkerProcess, str, str, str, str]:
    run = _id()
    props = str(kafka_secure.properties("worker"))
    inp, out, dlq = f"keywords.{run}", f"embeddings.{run}", f"keywords-dlq.{run}"
    extra: list[str] = ["--kafka-config-file", props]
    if case == "wrong_password":
        extra = ["--kafka-config-file", str(kafka_secure.properties("intruder"))]
    elif case == "unknown_user":
        extra += ["--kafka-config", f"sasl.username=nobody-{run}"]
    elif case == "untrusted_ca":
        extra += ["--kafka-config", f"ssl.ca.location={other_ca}"]
    elif case == "no_read_on_input":
        inp = f"forbidden.{run}"
    elif case == "no_write_on_output":
        out = f"forbidden-out.{run}"
    elif case == "no_write_on_dead_letter":
        dlq = f"forbidden-dlq.{run}"
    secure_topics(inp, 1)
    secure_topics(out, 1)
    secure_topics(dlq, 1)
    if case == "no_write_on_dead_letter":
        # A broken record first, so that the dead-letter case fails before anything could be committed.
        produce(kafka_secure.bootstrap, inp, [(b"k", b"{broken")], kafka_secure.config("admin"))
    produce_queries(kafka_secure.bootstrap, inp, load_queries(0, 40), kafka_secure.config("admin"))
    group = f"keyword-embedder.{run}"
    return _worker(kafka_secure, tmp_path, inp, out, dlq, group, *extra), inp, out, dlq, group


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA that did not sign the broker's certificate."""
    folder = tmp_path_factory.mktemp("other-ca")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(folder / "ca.key"),
                    "-out", str(folder / "ca.pem"), "-days", "2", "-subj", "/CN=not the broker's CA"],
                   check=True, capture_output=True)
    return folder / "ca.pem"


EXPECTED = {
    "wrong_password": lambda inp, out, dlq: "authentication failed",
    "unknown_user": lambda inp, out, dlq: "authentication failed",
    "untrusted_ca": lambda inp, out, dlq: "TLS verification failed",
    "no_read_on_input": lambda inp, out, dlq: f"not authorised to read topic '{inp}'",
    "no_write_on_output": lambda inp, out, dlq: f"not authorised to write topic '{out}'",
    "no_write_on_dead_letter": lambda inp, out, dlq: f"not authorised to write topic '{dlq}'",
}


@pytest.mark.parametrize("case", list(EXPECTED))
def test_misconfiguration_stops_the_worker_fast_with_one_clear_message(
        kafka_secure: SecureCluster, secure_topics: Callable[..., str], tmp_path: Path, other_ca: Path,
        case: str) -> None:
    worker, inp, out, dlq, group = _fail_case(kafka_secure, secure_topics, tmp_path, case, other_ca)
    start = time.monotonic()
    worker.start()
    assert worker.proc is not None
    try:
        rc = worker.proc.wait(60)
    except subprocess.TimeoutExpired:
        worker.kill()
        raise AssertionError(f"the worker did not stop:\n{worker.log()[-3000:]}") from None
    elapsed = time.monotonic() - start
    print(f"\n{case}: exit {rc} after {elapsed:.1f} s, {len(worker.log().splitlines())} log lines")
    log = worker.log()
    # The start-up check finds each of these before the model loads (exit 2, "cannot start").
    assert rc == 2, log[-3000:]
    assert elapsed < EXIT_BOUND_S, log[-3000:]
    fatal = worker.events("cannot start the worker")
    assert len(fatal) == 1, log[-3000:]
    phrase = EXPECTED[case](inp, out, dlq)
    assert fatal[0]["error"].startswith(phrase), fatal[0]["error"]
    print(f"{case}: {fatal[0]['error'][:160]}")
    # Throttled: no line-per-retry storm before the exit.
    assert len(log.splitlines()) < 60, log[-3000:]
    # Nothing committed: every input record was left for a worker that works.
    offsets = committed_offsets(kafka_secure.bootstrap, group, inp, 1, kafka_secure.config("admin"))
    assert all(off < 0 for off in offsets.values()), offsets
    assert_no_secret(log, kafka_secure, "the worker's log")


# ------------------------------------------------------------------ the ACLs hold for the other users


def test_producer_cannot_read_the_output_topic(kafka_secure: SecureCluster, secure_topics: Callable[..., str],
                                               tmp_path: Path) -> None:
    out = secure_topics(f"embeddings.{_id()}", 1)
    produce(kafka_secure.bootstrap, out, [(b"k", b"{}")], kafka_secure.config("admin"))
    c = Consumer({**kafka_secure.config("producer"), "group.id": f"keyword-embedder-reader-{_id()}",
                  "auto.offset.reset": "earliest", "enable.auto.commit": False})
    try:
        # The broker refuses the producer user twice over: no Read ACL on the topic, and no ACL on
        # any group (librdkafka asks for the group coordinator first, so that is the error it sees).
        c.subscribe([out])
        codes: set[int] = set()
        read = 0
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            for m in c.consume(10, timeout=0.5):
                if m.error() is None:
                    read += 1
                else:
                    codes.add(m.error().code())
        assert read == 0
        assert codes and codes <= {KafkaError.GROUP_AUTHORIZATION_FAILED, KafkaError.TOPIC_AUTHORIZATION_FAILED}, codes
    finally:
        c.close()
    # The CLI says it in one line and exits non-zero (the producer has no group ACL either).
    got = cli("consume", "--bootstrap-servers", kafka_secure.bootstrap, "--topic", out, "--output",
              str(tmp_path / "x.jsonl"), "--idle-timeout", "20", "--kafka-config-file",
              str(kafka_secure.properties("producer")))
    assert got.returncode == 1 and "not authorised to" in got.stderr, got.stderr
    assert_no_secret(got.stderr, kafka_secure, "consume's output")


def test_reader_cannot_write_the_input_topic(kafka_secure: SecureCluster, secure_topics: Callable[..., str],
                                             tmp_path: Path) -> None:
    inp = secure_topics(f"keywords.{_id()}", 1)
    errors: list[KafkaError] = []
    p = Producer({**kafka_secure.config("reader"), "message.timeout.ms": 20000})
    p.produce(inp, b"v", on_delivery=lambda err, _msg: errors.append(err))
    p.flush(30)
    assert errors and errors[0] is not None and errors[0].code() == KafkaError.TOPIC_AUTHORIZATION_FAILED, errors
    src = tmp_path / "q.tsv"
    src.write_text("q-1\tcheap flights\n", encoding="utf-8")
    start = time.monotonic()
    got = cli("produce", "--bootstrap-servers", kafka_secure.bootstrap, "--topic", inp, "--input", str(src),
              "--no-progress", "--kafka-config-file", str(kafka_secure.properties("reader")))
    assert got.returncode == 1, got.stderr
    assert f"not authorised to write topic '{inp}'" in got.stderr
    assert time.monotonic() - start < EXIT_BOUND_S
    assert_no_secret(got.stderr, kafka_secure, "produce's output")


def test_the_secured_broker_listens_on_loopback_only_and_refuses_plaintext(kafka_secure: SecureCluster) -> None:
    from worker.kafka.client_config import read_properties

    server = read_properties(kafka_secure.config_dir.parent / "server.properties")
    listeners = dict(item.split("://") for item in server["listeners"].split(","))
    assert set(listeners) == {"SASL_SSL", "CONTROLLER"}
    assert all(addr.startswith("127.0.0.1:") for addr in listeners.values())
    assert server["listener.security.protocol.map"] == "CONTROLLER:SSL,SASL_SSL:SASL_SSL"
    assert server["listener.name.controller.ssl.client.auth"] == "required"
    # Behaviour, not just configuration: a client without TLS and SASL gets no metadata.
    admin = AdminClient({"bootstrap.servers": kafka_secure.bootstrap})
    with pytest.raises(Exception):  # noqa: B017 - librdkafka's timeout or transport error, either refuses
        admin.list_topics(timeout=5)
    # With TLS but no credentials the broker refuses too.
    ca_only = {"bootstrap.servers": kafka_secure.bootstrap, "security.protocol": "SSL",
               "ssl.ca.location": str(kafka_secure.config_dir / "ca.pem")}
    with pytest.raises(Exception):  # noqa: B017
        AdminClient(ca_only).list_topics(timeout=5)
    assert AdminClient(kafka_secure.config("admin")).list_topics(timeout=10).topics is not None
