"""A worker's two Kafka clients, the output producer and the group member, opened together.

They share one reading of the client settings (`WorkerConfigs`: the properties and password
files are read once) and one `FailurePolicy`, so an authorisation or TLS failure is judged the
same way whichever client meets it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from confluent_kafka import Consumer, Producer

from worker.kafka.client_config import WorkerConfigs
from worker.kafka.consumer import GroupMember, Ledger
from worker.kafka.errors import FailurePolicy
from worker.kafka.producer import OutputProducer
from worker.latch import FatalLatch
from worker.operations.metrics import Metrics


@dataclass(frozen=True)
class WorkerClients:
    producer: OutputProducer
    member: GroupMember

    @classmethod
    def open(cls, configs: WorkerConfigs, ledger: Ledger, latch: FatalLatch, metrics: Metrics, *,
             group: str, topic: str, revoke_wait_s: Callable[[], float],
             producer_factory: Callable[[dict[str, Any]], Any] = Producer,
             consumer_factory: Callable[[dict[str, Any]], Any] = Consumer) -> WorkerClients:
        failures = FailurePolicy()
        producer = OutputProducer(configs.producer, latch, failures=failures, producer_factory=producer_factory)
        member = GroupMember(configs.consumer, ledger, latch, metrics, revoke_wait_s=revoke_wait_s, group=group,
                             topic=topic, failures=failures, consumer_factory=consumer_factory)
        return cls(producer, member)
