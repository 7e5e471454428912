"""Topic creation for the demo and tests (a real deployment creates its topics with its own tooling)."""

from __future__ import annotations

from collections.abc import Mapping

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient, NewTopic


def ensure_topics(bootstrap_servers: str, topics: Mapping[str, int], *, extra_config: Mapping[str, str] | None = None,
                  timeout_s: float = 30.0) -> list[str]:
    """Creates each topic with its partition count unless it exists; returns the ones created.

    The replication factor is the cluster's own (default.replication.factor, replication_factor=-1),
    so that a topic made on a three-broker cluster is replicated as its operators configured it,
    not kept on one broker that a restart takes away.

    `extra_config`: the security keys (worker.kafka.client_config.client_config) for a secured cluster.
    """
    admin = AdminClient({"bootstrap.servers": bootstrap_servers, **(extra_config or {})})
    existing = set(admin.list_topics(timeout=timeout_s).topics)
    wanted = [NewTopic(name, num_partitions=n, replication_factor=-1) for name, n in topics.items()
              if name not in existing]
    if not wanted:
        return []
    created = []
    for name, future in admin.create_topics(wanted, operation_timeout=timeout_s).items():
        try:
            future.result(timeout_s)
            created.append(name)
        except KafkaException as exc:
            if exc.args[0].name() != "TOPIC_ALREADY_EXISTS":
                raise
    return created
