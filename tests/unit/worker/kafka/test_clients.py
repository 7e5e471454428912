"""The worker's two Kafka clients opened together (worker/kafka/clients.py)."""

from __future__ import annotations

from typing import Any

from worker.kafka.client_config import WorkerConfigs
from worker.kafka.clients import WorkerClients
from worker.latch import FatalLatch
from worker.ledger.committer import Committer
from worker.operations.metrics import Metrics


def test_each_client_gets_its_configuration_and_both_judge_failures_alike() -> None:
    made: dict[str, dict[str, Any]] = {}

    def factory(kind: str) -> Any:
        def make(config: dict[str, Any]) -> object:
            made[kind] = config
            return object()
        return make

    configs = WorkerConfigs(consumer={"group.id": "g", "k": "consumer"}, producer={"k": "producer"})
    clients = WorkerClients.open(configs, Committer(None, interval_s=1.0), FatalLatch(), Metrics(), group="g",
                                 topic="keywords", revoke_wait_s=lambda: 0.0, producer_factory=factory("producer"),
                                 consumer_factory=factory("consumer"))
    assert made["producer"]["k"] == "producer" and made["consumer"]["k"] == "consumer"
    # The member adds its callbacks to its own configuration only.
    assert {"error_cb", "on_commit", "stats_cb"} <= made["consumer"].keys()
    assert "on_commit" not in made["producer"]
    assert (clients.member.group, clients.member.topic) == ("g", "keywords")
    assert clients.producer._failures is clients.member._failures
