"""The one place where the settings and the guarantee become librdkafka configuration.

The worker's consumer (`consumer_config`), its producer under either guarantee (`producer_config`:
exactly once makes it transactional, `transactional_keys`; both from one reading of the
client settings, `worker_configs`) and the admin client (`admin_config`)
are built here. Every Kafka client of every command (those, and the `produce`, `consume` and `demo`
commands) gets its security and pass-through keys from `client_config(settings)`:

    kafka_config_file (properties)  <  kafka_config items (--kafka-config)  +  typed settings

The raw layers (file, then --kafka-config items) override each other key by key, as flags
override files. A typed setting (security_protocol, sasl_mechanism, sasl_username,
sasl_password / sasl_password_file, ssl_ca_location) that names a key the raw layers also set to
a different value is an error, not a silent winner. Keys the worker owns (bootstrap.servers,
group.id, the offset-commit keys) are refused in the file as on the command line.
"""

from __future__ import annotations

import argparse
import logging
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worker.operations.redact import is_secret_key
from worker.settings.kafka_overrides import RESERVED_KAFKA_KEYS
from worker.settings.loader import add_setting_flags, env_name
from worker.settings.schema import CLIENT_SETTINGS, Settings, SettingsError, kafka_pairs

# What one fetch takes of each partition (about 200 keywords) and waits for: consumer_config says why.
FETCH_PARTITION_BYTES = 16 * 1024
FETCH_MIN_BYTES = FETCH_PARTITION_BYTES
FETCH_WAIT_MS = 10
# How soon a partition whose prefetch queue is full is looked at again: consumer_config says why.
FETCH_QUEUE_BACKOFF_MS = 10
# The group session and heartbeat: consumer_config says why.
SESSION_TIMEOUT_MS = 30_000
HEARTBEAT_INTERVAL_MS = 1000
# An outage shorter than this is ridden out by librdkafka's own retries.
MESSAGE_TIMEOUT_MS = 3_600_000

# Typed setting -> librdkafka key.
TYPED_KEYS: dict[str, str] = {
    "security_protocol": "security.protocol",
    "sasl_mechanism": "sasl.mechanism",
    "sasl_username": "sasl.username",
    "sasl_password": "sasl.password",
    "ssl_ca_location": "ssl.ca.location",
}
# librdkafka spells some keys two ways; conflicts are checked on one spelling.
_ALIASES = {"sasl.mechanisms": "sasl.mechanism"}


def read_properties(path: str | Path) -> dict[str, str]:
    """A librdkafka properties file: `key=value` lines, blank lines and `#`/`!` comments skipped."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SettingsError(f"setting 'kafka_config_file': cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise SettingsError(f"setting 'kafka_config_file': {path} is not UTF-8 text") from None
    items: list[str] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not stripped or stripped.startswith(("#", "!")):
            continue
        items.append(stripped)
        # The line number, not the line: a malformed line may still hold a secret.
        kafka_pairs([stripped], source=f"{path}:{lineno}:")
    return kafka_pairs(items)


def _read_secret_file(name: str, path: str) -> str:
    try:
        value = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise SettingsError(f"setting {name!r}: cannot read {path}: {exc.strerror}") from None
    # A Kubernetes secret or `echo pw > file` ends with a newline that is not part of the password.
    value = value.rstrip("\r\n")
    if not value:
        raise SettingsError(f"setting {name!r}: {path} is empty")
    return value


def raw_config(settings: Settings) -> dict[str, str]:
    """The file's keys overridden by the --kafka-config items (the pass-through layers)."""
    raw: dict[str, str] = {}
    if settings.kafka_config_file:
        from_file = read_properties(settings.kafka_config_file)
        for key in from_file:
            if key in RESERVED_KAFKA_KEYS:
                raise SettingsError(f"setting 'kafka_config_file': {settings.kafka_config_file} sets {key!r}, "
                                    f"which cannot be overridden ({RESERVED_KAFKA_KEYS[key]})")
        raw.update(from_file)
    raw.update(settings.librdkafka_overrides())
    return raw


def typed_config(settings: Settings) -> dict[str, str]:
    """The typed settings that are set, as librdkafka keys (the password file read)."""
    typed = {key: getattr(settings, name) for name, key in TYPED_KEYS.items() if getattr(settings, name)}
    if settings.sasl_password_file:
        typed["sasl.password"] = _read_secret_file("sasl_password_file", settings.sasl_password_file)
    return typed


def client_config(settings: Settings) -> dict[str, str]:
    """Security and pass-through librdkafka keys for any client built from these settings."""
    typed = typed_config(settings)
    raw = raw_config(settings)
    normalised = {_ALIASES.get(k, k): (k, v) for k, v in raw.items()}
    for key, value in typed.items():
        if key in normalised and normalised[key][1] != value:
            name = ("sasl_password_file" if key == "sasl.password" and settings.sasl_password_file
                    else next(n for n, k in TYPED_KEYS.items() if k == key))
            raise SettingsError(f"setting {name!r} and kafka_config/kafka_config_file both set {normalised[key][0]!r} "
                                "to different values: keep one")
    merged = {k: v for k, v in raw.items() if _ALIASES.get(k, k) not in typed}
    merged.update(typed)
    return merged


def secret_values(settings: Settings) -> list[str]:
    """The secret values these settings configure (for the log redactor); [] if they cannot be read."""
    try:
        config = client_config(settings)
    except SettingsError:
        return [settings.sasl_password] if settings.sasl_password else []
    return [v for k, v in config.items() if is_secret_key(k) and v]


def admin_config(settings: Settings) -> dict[str, Any]:
    """An AdminClient for the worker's own cluster: the same address and security as its clients."""
    return {"bootstrap.servers": settings.bootstrap_servers, "client.id": f"keyword-embedder-{settings.group_id}",
            # librdkafka's own log lines go through the stdlib logger into the structured log stream.
            "logger": logging.getLogger("librdkafka"), **client_config(settings)}


# ------------------------------------------------------------------ commands other than `run`


def add_client_flags(parser: argparse.ArgumentParser) -> None:
    """The client settings' flags (and --config) for commands that are not the worker."""
    add_setting_flags(parser, only=CLIENT_SETTINGS)


def client_env(settings: Settings) -> dict[str, str]:
    """The client settings that are set, as KWE_* variables for a child `keyword-embedder run`.

    The environment, not argv: a password on a command line is visible to every user of the host.
    """
    env: dict[str, str] = {}
    for name in CLIENT_SETTINGS:
        value = getattr(settings, name)
        if value:
            env[env_name(name)] = ",".join(value) if isinstance(value, tuple) else str(value)
    return env


def consumer_config(settings: Settings) -> dict[str, Any]:
    """The worker's consumer configuration."""
    return worker_configs(settings).consumer


def producer_config(settings: Settings) -> dict[str, Any]:
    """The output producer's configuration under the settings' guarantee (exactly once: transactional)."""
    return worker_configs(settings).producer


@dataclass(frozen=True)
class WorkerConfigs:
    """A worker's two clients: the group member's consumer and the output producer."""

    consumer: dict[str, Any]
    producer: dict[str, Any]


def worker_configs(settings: Settings) -> WorkerConfigs:
    """Both clients' configurations from one reading of the client settings (the properties file and
    the password file are read once, not once a client): the worker's keys, the transactional keys
    under exactly once, then the security and pass-through keys over both."""
    consumer = _consumer_keys(settings)
    producer = _producer_keys(settings)
    if settings.processing_guarantee == "exactly-once":
        transactional = transactional_keys(group=settings.group_id, member=settings.member_id or socket.gethostname(),
                                           transaction_timeout_ms=settings.transaction_timeout_ms)
    else:
        transactional = {}
    # Security and --kafka-config / --kafka-config-file keys, merged in one place.
    shared = client_config(settings)
    consumer.update(shared)
    producer.update(shared)
    producer.update(transactional)
    if transactional:
        # librdkafka refuses a message timeout above the transaction timeout (the --kafka-config one
        # too): a write that cannot succeed while its transaction is open fails the transaction,
        # which is then aborted.
        producer["message.timeout.ms"] = min(int(producer["message.timeout.ms"]),
                                             transactional["transaction.timeout.ms"])
    return WorkerConfigs(consumer=consumer, producer=producer)


def _consumer_keys(settings: Settings) -> dict[str, Any]:
    config: dict[str, Any] = {
        "bootstrap.servers": settings.bootstrap_servers,
        "group.id": settings.group_id,
        # Incremental rebalances: a joining member does not stop the others' partitions.
        "partition.assignment.strategy": "cooperative-sticky",
        # Commit-after-write: the pipeline commits explicit offsets (the lowest unfinished
        # offset per partition) itself; nothing is stored or committed behind its back.
        "enable.auto.offset.store": False,
        "enable.auto.commit": False,
        "auto.offset.reset": "earliest",
        # A session must outlive a broker's failover: librdkafka drops every partition as lost
        # (nothing committed, the new owners redo the uncommitted window) once no heartbeat was
        # answered for session.timeout.ms. A SIGKILLed coordinator's group had none for 8.8-13.6 s
        # on the three-node cluster (30 groups hit: 8.8-10.0 s, then 11.1-13.6 s when the node was
        # the active KRaft controller too; benchmarks/results/faults/coordinator_outage.json and
        # benchmarks/results/faults/coordinator_outage_run1.json), and any node's loss stalls the
        # live coordinators about as long (a dead broker stays in the offsets
        # topic's ISR until fenced): 10 s sessions expired under a backlog after either kind of kill
        # (issue 46: 29% of a stream duplicated). The price: a member that dies without leaving
        # (SIGKILL, OOM, a lost node) holds its partitions until this expires before the others take
        # them; a stop (SIGTERM) leaves the group at once and costs nothing. docs/faults.md, "Sessions".
        "session.timeout.ms": SESSION_TIMEOUT_MS,
        # A member hears of a rebalance at its next heartbeat: 1 s keeps joins and leaves as quick
        # as before (Kafka's 3 s default would add up to 2 s to each).
        "heartbeat.interval.ms": HEARTBEAT_INTERVAL_MS,
        "max.poll.interval.ms": 300000,
        # Transactional output is visible only once committed; at-least-once ignores aborted
        # writes of an upstream transactional producer too.
        "isolation.level": "read_committed",
        # Small slices of every partition, not 1 MiB of one (librdkafka's default): flow control
        # pauses every partition at max_in_flight, which throws away what librdkafka prefetched,
        # and the first fetch after the resume lists the partitions in the same order again. With
        # 1 MiB a partition, that first partition's records filled all the room a resume gives,
        # so after an overload the partitions drained one after another (the last 67 s after the
        # first); with 16 KiB each fetch brings every partition's (5 s apart), at the same backlog
        # throughput (1.06x, paired). docs/performance.md, "A fair drain".
        "max.partition.fetch.bytes": FETCH_PARTITION_BYTES,
        # The prefetch queue holds whole records in memory before flow control sees them: keep
        # it within the in-flight byte budget.
        "queued.max.messages.kbytes": max(1024, min(65536, settings.max_in_flight_bytes // 1024 // 4)),
        # A partition whose prefetch queue is at that bound (or queued.min.messages) is not fetched
        # again for fetch.queue.backoff.ms, 1 s by default (rdkafka_fetcher.c), however soon the
        # queue empties. Large records fill the queue with a few: 500 KB records under an 8 MiB
        # budget went through at 4 per partition per second, the process idle in between.
        "fetch.queue.backoff.ms": FETCH_QUEUE_BACKOFF_MS,
        # librdkafka's defaults (fetch.min.bytes 1) answer a fetch the moment one record is there:
        # a stream of 600 keywords/s becomes hundreds of one-record fetches a second, each a
        # wake-up of the broker and of this process. Waiting up to FETCH_WAIT_MS for one
        # partition's slice gathers them: the broker spent 10-20% less CPU per keyword and p99 fell
        # 1.6x at 25% and 2.9x at 50% load on 2 shared cores (docs/performance.md, "Fewer, fuller
        # fetches"). A backlog has a slice ready and never waits: the minimum is never more than
        # one fetch can bring, whatever the partition count.
        "fetch.wait.max.ms": FETCH_WAIT_MS,
        "fetch.min.bytes": FETCH_MIN_BYTES,
        "client.id": f"keyword-embedder-{settings.group_id}",
    }
    if settings.metrics_port:
        config["statistics.interval.ms"] = 5000  # per-partition consumer lag for /metrics
    # librdkafka's own log lines go through the stdlib logger into the structured log stream,
    # instead of raw "%6|...|FAIL|..." lines on stderr.
    config["logger"] = logging.getLogger("librdkafka")
    return config


def _producer_keys(settings: Settings) -> dict[str, Any]:
    config: dict[str, Any] = {
        "bootstrap.servers": settings.bootstrap_servers,
        # Idempotent + acks=all: a broker restart neither loses nor duplicates an acknowledged write.
        "enable.idempotence": True,
        "acks": "all",
        "linger.ms": 5,
        # Embeddings are float text or float bytes, which compress poorly; lz4 cost about 7% of
        # the throughput of a 2-core worker (benchmarks/kafka_vs_offline.py). Where bandwidth
        # matters more, pass --kafka-config compression.type=lz4 (or zstd).
        "compression.type": "none",
        # Room for every in-flight keyword plus dead letters: produce() should not meet a full
        # queue in steady state, because the in-flight bound already limits what is outstanding.
        "queue.buffering.max.messages": max(100000, 4 * settings.max_in_flight),
        "message.timeout.ms": MESSAGE_TIMEOUT_MS,
        "client.id": f"keyword-embedder-{settings.group_id}",
    }
    # librdkafka's own log lines go through the stdlib logger into the structured log stream,
    # instead of raw "%6|...|FAIL|..." lines on stderr.
    config["logger"] = logging.getLogger("librdkafka")
    return config


def transactional_id(group: str, member: str) -> str:
    """Stable per member (a pod name survives its own restart), unique among live members; the
    prefix keyword-embedder is what the secured deployment's transactional-id ACL grants."""
    return f"keyword-embedder-{group}-{member}"


def transactional_keys(*, group: str, member: str, transaction_timeout_ms: int) -> dict[str, Any]:
    """The keys that make an exactly-once member's producer transactional."""
    return {"transactional.id": transactional_id(group, member), "transaction.timeout.ms": transaction_timeout_ms}
