"""A bucketer callback that raises stops the worker (issue 46): the whole pipeline with fake clients.

Before, the dispatcher logged the exception and went on; the batch's records stayed in flight, their
offsets never finished and the commit point stalled behind them while the worker kept running
(until /healthz's stall timeout). Now the run ends with exit 1 and a ThreadDiedError naming the
callback, and what was committed covers only records whose output the broker acknowledged.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from confluent_kafka import TopicPartition

from worker.core.profiles import Bucket, Profile
from tests.fakes.consumer import FakeGroupConsumer
from tests.fakes.pipeline import AckingProducer, HalvesBackend, ThreeTokens
from worker.app import wire_pipeline
from worker.formats.messages import OutputCodec
from worker.batching.bucketer import Bucketer
from worker.errors import ThreadDiedError
from worker.operations.batch_stats import BatchStats
from worker.settings.schema import Settings

WAIT_S = 10.0  # only a guard against a hang


class _Consumer(FakeGroupConsumer):
    """Assigned both partitions at once; commits are recorded and answered as librdkafka would."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config, partitions=2, records=40)
        self.commits: list[tuple[int, int]] = []

    def subscribe(self, topics: list[str], on_assign: Any = None, on_revoke: Any = None, on_lost: Any = None) -> None:
        super().subscribe(topics, on_assign, on_revoke, on_lost)
        self.queue.append(self.assign_op([0, 1]))

    def commit(self, offsets: list[TopicPartition], asynchronous: bool = True) -> list[TopicPartition] | None:
        answer = [TopicPartition(tp.topic, tp.partition, tp.offset) for tp in offsets]
        self.commits += [(tp.partition, tp.offset) for tp in offsets]
        if asynchronous:
            self.config["on_commit"](None, answer)
            return None
        return answer


def test_a_callback_that_raises_stops_the_worker_and_nothing_past_its_batch_is_committed() -> None:
    consumers: list[_Consumer] = []
    producers: list[AckingProducer] = []
    calls = [0]

    def consumer(config: dict[str, Any]) -> _Consumer:
        consumers.append(_Consumer(config))
        return consumers[-1]

    def producer(config: dict[str, Any]) -> AckingProducer:
        producers.append(AckingProducer(config))
        return producers[-1]

    def bucketer(profile: Profile, backend: Any, on_complete: Any, **kw: Any) -> Bucketer:
        def failing(seqs: Sequence[int], rows: np.ndarray, stats: BatchStats) -> None:
            calls[0] += 1
            if calls[0] == 3:
                # A bug on the third batch, once the first two are out and committed: the commits
                # after it must stay below its records.
                deadline = time.monotonic() + WAIT_S
                while not consumers[0].commits and time.monotonic() < deadline:
                    time.sleep(0.01)
                raise KeyError("a bug in the output stage")
            on_complete(seqs, rows, stats)

        return Bucketer(profile, backend, failing, **kw)

    profile = Profile("test", (Bucket(8, 4, 4),), token_budget=64, pad_to="bucket")
    s = Settings(input_format="raw", pad_to="bucket", shutdown_timeout_s=2.0, commit_interval_ms=10,
                 max_queue_delay_ms=1, dispatchers=1)
    pipeline = wire_pipeline(s, tokenizer=ThreeTokens(), backend=HalvesBackend(), profile=profile, model_name="m",
                             codec=OutputCodec(model="m", dim=4, encoding="float-list"),
                             consumer_factory=consumer, producer_factory=producer, bucketer_factory=bucketer)
    codes: list[int] = []
    runner = threading.Thread(target=lambda: codes.append(pipeline.run()), daemon=True)
    runner.start()
    runner.join(WAIT_S)
    if runner.is_alive():  # before issue 46: the run went on, its commit point stalled for good
        pipeline.request_stop()
        runner.join(WAIT_S)
        raise AssertionError(f"the worker kept running {WAIT_S} s after the callback raised; commits "
                             f"{consumers[0].commits[-2:]}")
    assert codes == [1]
    error = pipeline.latch.error
    assert isinstance(error, ThreadDiedError), error
    assert "on_complete callback raised" in str(error) and "a bug in the output stage" in str(error)
    # Every committed offset covers only records whose output was acknowledged: nothing past the failure.
    acked = {key.decode() for p in producers for key in p.acked}
    committed = {p: max((o for q, o in consumers[0].commits if q == p), default=0) for p in (0, 1)}
    for p, upto in committed.items():
        missing = [f"{p}-{o}" for o in range(upto) if f"{p}-{o}" not in acked]
        assert not missing, f"partition {p} committed up to {upto} without outputs for {missing[:5]}"
    assert 0 < sum(committed.values()) < 80, committed  # the first batches committed, not the failed one
