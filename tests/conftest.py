"""Shared fixtures: the real Kafka brokers and per-test topics.

The plain broker comes from KAFKA_BOOTSTRAP_SERVERS when set (`make test` sets it), otherwise the
session starts one with deploy/local/kafka.sh and stops it at the end (one it found running, it
leaves running). The secured broker
(`kafka_secure`) comes from KAFKA_SECURE_BOOTSTRAP_SERVERS + KAFKA_SECURE_CONFIG_DIR when set,
otherwise it is started lazily, by the first test that needs it (`kafka.sh start --secure`), and
stopped at the end of the session if this session started it.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
DATA = TESTS / "data"
KAFKA_SH = ROOT / "deploy" / "local" / "kafka.sh"
REGISTRY_SH = ROOT / "deploy" / "local" / "registry.sh"


# The suite's layers (docs/development.md, Tests by layer) and the markers that put a test in one:
# tests/unit takes none of them, tests/broker needs the broker or the registry and nothing heavier,
# tests/system is what takes a cluster, an image or a minute or more.
BROKER_MARKS = frozenset({"kafka", "registry"})
SYSTEM_MARKS = frozenset({"cluster", "image", "slow"})


def _misplaced(item: pytest.Item) -> str | None:
    """Why a collected test is in the wrong layer, or None."""
    try:
        layer = item.path.relative_to(TESTS).parts[0]
    except ValueError:
        return None
    marks = {m.name for m in item.iter_markers()} & (BROKER_MARKS | SYSTEM_MARKS)
    if layer == "unit" and marks:
        return f"marked {', '.join(sorted(marks))}: it belongs in tests/broker or tests/system"
    if layer == "broker" and not marks & BROKER_MARKS:
        return "needs neither the broker nor the registry: it belongs in tests/unit"
    if layer == "broker" and marks & SYSTEM_MARKS:
        return f"marked {', '.join(sorted(marks & SYSTEM_MARKS))}: it belongs in tests/system"
    if layer == "system" and not marks:
        return "has none of the markers kafka, registry, cluster, image, slow: it belongs in tests/unit"
    if layer not in ("unit", "broker", "system"):
        return "is outside tests/unit, tests/broker and tests/system"
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        names = getattr(item, "fixturenames", ())
        if "kafka_bootstrap" in names or "kafka_secure" in names:
            item.add_marker(pytest.mark.kafka)
        if "schema_registry" in names or "own_registry" in names:
            item.add_marker(pytest.mark.registry)
    misplaced = [f"{item.nodeid} {why}" for item in items if (why := _misplaced(item))]
    if misplaced:
        raise pytest.UsageError("tests in the wrong layer:\n" + "\n".join(misplaced))


@pytest.fixture(scope="session")
def kafka_bootstrap() -> Iterator[str]:
    given = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if given:
        yield given
        return
    out = subprocess.run(["bash", str(KAFKA_SH), "start"], check=True, capture_output=True, text=True)
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith("KAFKA_BOOTSTRAP_SERVERS="), out.stdout + out.stderr
    # A broker this session found running (another session's: `make test` in another checkout
    # shares the run folder) is left running: stopping it would fail that session's tests.
    started = "reusing" not in out.stderr
    try:
        yield line.split("=", 1)[1]
    finally:
        if started:
            subprocess.run(["bash", str(KAFKA_SH), "stop"], check=False)


@dataclass(frozen=True)
class SecureCluster:
    """The local secured broker: its address and the folder of per-user librdkafka properties files."""

    bootstrap: str
    config_dir: Path

    def properties(self, user: str) -> Path:
        return self.config_dir / f"{user}.properties"

    def config(self, user: str) -> dict[str, str]:
        """librdkafka config for one of admin, worker, producer, reader, intruder."""
        from worker.kafka.client_config import read_properties

        return {"bootstrap.servers": self.bootstrap, **read_properties(self.properties(user))}

    def passwords(self) -> list[str]:
        return [self.config(u)["sasl.password"] for u in ("admin", "worker", "producer", "reader", "intruder")]


@pytest.fixture(scope="session")
def kafka_secure() -> Iterator[SecureCluster]:
    bootstrap, config_dir = os.environ.get("KAFKA_SECURE_BOOTSTRAP_SERVERS"), os.environ.get("KAFKA_SECURE_CONFIG_DIR")
    if bootstrap and config_dir:
        yield SecureCluster(bootstrap, Path(config_dir))
        return
    was_running = subprocess.run(["bash", str(KAFKA_SH), "status", "--secure"], capture_output=True).returncode == 0
    out = subprocess.run(["bash", str(KAFKA_SH), "start", "--secure"], check=True, capture_output=True, text=True)
    lines = out.stdout.strip().splitlines()
    assert lines[-1].startswith("KAFKA_BOOTSTRAP_SERVERS=") and lines[-2].startswith("KAFKA_SECURE_CONFIG_DIR="), \
        out.stdout + out.stderr
    try:
        yield SecureCluster(lines[-1].split("=", 1)[1], Path(lines[-2].split("=", 1)[1]))
    finally:
        if not was_running:
            subprocess.run(["bash", str(KAFKA_SH), "stop", "--secure"], check=False)


@pytest.fixture()
def make_topic(kafka_bootstrap: str) -> Iterator[Callable[..., str]]:
    """Creates uniquely named topics with N partitions; deletes them after the test."""
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    created: list[str] = []

    def make(prefix: str = "t", partitions: int = 1) -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:10]}"
        futures = admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=1)],
                                      operation_timeout=30)
        futures[name].result(timeout=30)
        created.append(name)
        return name

    yield make
    if created:
        for fut in admin.delete_topics(created, operation_timeout=30).values():
            try:
                fut.result(timeout=30)
            except Exception:  # noqa: BLE001 - best-effort cleanup must not hide the test's own outcome
                pass


@pytest.fixture()
def group_id() -> str:
    return f"g-{uuid.uuid4().hex[:10]}"


@pytest.fixture()
def own_broker(tmp_path: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """A broker of the test's own (a restart or an outage must not hit the shared one): (address, env)."""
    env = {**os.environ, "KWE_KAFKA_RUN": str(tmp_path / "broker")}
    env.pop("KAFKA_PORT", None)
    out = subprocess.run(["bash", str(KAFKA_SH), "start"], env=env, capture_output=True, text=True, check=True)
    try:
        yield out.stdout.strip().splitlines()[-1].split("=", 1)[1], env
    finally:
        subprocess.run(["bash", str(KAFKA_SH), "stop"], env=env, capture_output=True, check=False)


def start_registry(env: dict[str, str] | None = None) -> str:
    """deploy/local/registry.sh start; returns its SCHEMA_REGISTRY_URL."""
    out = subprocess.run(["bash", str(REGISTRY_SH), "start"], check=True, capture_output=True, text=True, env=env)
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith("SCHEMA_REGISTRY_URL="), out.stdout + out.stderr
    return line.split("=", 1)[1]


@pytest.fixture(scope="session")
def schema_registry() -> Iterator[str]:
    """A real Confluent-compatible Schema Registry (Apicurio): SCHEMA_REGISTRY_URL when set (.ci/run
    sets it), otherwise started by this session with deploy/local/registry.sh and stopped at its end."""
    given = os.environ.get("SCHEMA_REGISTRY_URL")
    if given:
        yield given
        return
    was_running = subprocess.run(["bash", str(REGISTRY_SH), "status"], capture_output=True).returncode == 0
    url = start_registry()
    try:
        yield url
    finally:
        if not was_running:
            subprocess.run(["bash", str(REGISTRY_SH), "stop"], check=False)


@dataclass
class OwnRegistry:
    """A registry of the test's own, which the test may stop (an outage must not hit the shared one)."""

    url: str
    env: dict[str, str]

    def stop(self) -> None:
        subprocess.run(["bash", str(REGISTRY_SH), "stop"], env=self.env, capture_output=True, check=False)


@pytest.fixture()
def own_registry(tmp_path: Path) -> Iterator[OwnRegistry]:
    env = {**os.environ, "KWE_REGISTRY_RUN": str(tmp_path / "registry")}
    env.pop("REGISTRY_PORT", None)
    reg = OwnRegistry(start_registry(env), env)
    try:
        yield reg
    finally:
        reg.stop()
