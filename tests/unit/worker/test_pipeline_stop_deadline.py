"""A stop ends within shutdown_timeout_s + 2 s whatever librdkafka does: every step after the signal
waits at most until its view of the one deadline, and what still runs EXIT_GRACE_S past it does not
hold the process (`Pipeline.on_overrun`). With fake clients; the real broker's case, several members
stopped at once while a rebalance is parked, is tests/system/test_faults_kafka.py's.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from confluent_kafka import TopicPartition

from tests.fakes.consumer import FakeGroupConsumer
from tests.fakes.pipeline import AckingProducer, HalvesBackend, ThreeTokens
from worker.app import wire_pipeline
from worker.formats.messages import OutputCodec
from worker.core.profiles import Bucket, Profile
from worker.deadline import Deadline, Overrun
from worker.pipeline import EXIT_GRACE_S
from worker.settings.schema import Settings

WAIT_S = 20.0  # only a guard against a hang


class _Stuck(FakeGroupConsumer):
    """Once the stop began, consume() blocks as librdkafka's did with a synchronous commit still
    unanswered (measured: until the rebalance ended, 20 s), and close() never returns."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config, partitions=2, records=50)
        self.stopping = threading.Event()
        self.release = threading.Event()

    def subscribe(self, topics: list[str], on_assign: Any = None, on_revoke: Any = None, on_lost: Any = None) -> None:
        super().subscribe(topics, on_assign, on_revoke, on_lost)
        self.queue.append(self.assign_op([0, 1]))

    def commit(self, offsets: list[TopicPartition], asynchronous: bool = True) -> list[TopicPartition] | None:
        answer = [TopicPartition(tp.topic, tp.partition, tp.offset) for tp in offsets]
        if asynchronous:
            self.config["on_commit"](None, answer)
            return None
        return answer

    def consume(self, num_messages: int = 1, timeout: float = -1) -> list[Any]:
        if self.stopping.is_set():
            self.release.wait(WAIT_S)
        return super().consume(num_messages, timeout)

    def close(self) -> None:
        self.release.wait(WAIT_S)


def test_a_stop_stuck_in_librdkafka_exits_at_the_deadline_plus_the_grace() -> None:
    made: dict[str, Any] = {}
    profile = Profile("test", (Bucket(8, 16, 16),), token_budget=256, pad_to="bucket")
    s = Settings(input_format="raw", pad_to="bucket", shutdown_timeout_s=1.0, max_queue_delay_ms=1, dispatchers=1)
    exits: list[tuple[int, float]] = []
    exited = threading.Event()

    def on_overrun(code: int) -> None:  # what `run` does: os._exit(code)
        exits.append((code, time.monotonic()))
        exited.set()

    pipeline = wire_pipeline(s, tokenizer=ThreeTokens(), backend=HalvesBackend(), profile=profile, model_name="m",
                             codec=OutputCodec(model="m", dim=4, encoding="float-list"),
                             consumer_factory=lambda c: made.setdefault("consumer", _Stuck(c)),
                             producer_factory=lambda c: made.setdefault("producer", AckingProducer(c)),
                             on_overrun=on_overrun)
    runner = threading.Thread(target=pipeline.run, daemon=True)
    runner.start()
    deadline = time.monotonic() + WAIT_S
    while "producer" not in made or len(set(made["producer"].acked)) < 100:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    consumer: _Stuck = made["consumer"]
    try:
        consumer.stopping.set()
        stopped_at = time.monotonic()
        pipeline.request_stop()
        # Before: nothing watched the stop; it ended when librdkafka let go (here WAIT_S).
        assert exited.wait(s.shutdown_timeout_s + 2.0), "the stop went on past shutdown_timeout_s + 2 s"
        code, at = exits[0]
        assert code == 0
        assert s.shutdown_timeout_s + EXIT_GRACE_S - 0.2 <= at - stopped_at <= s.shutdown_timeout_s + 2.0
    finally:
        consumer.release.set()
        runner.join(WAIT_S)


def test_the_overrun_acts_once_past_the_deadline_and_follows_a_shortening() -> None:
    d = Deadline()
    acted: list[float] = []
    Overrun(d, 0.2, lambda: acted.append(time.monotonic())).start()
    time.sleep(0.3)
    assert acted == []  # not started: nothing to overrun
    start = time.monotonic()
    d.start(5.0)
    d.shorten(0.1)  # a second signal
    deadline = start + WAIT_S
    while not acted and time.monotonic() < deadline:
        time.sleep(0.01)
    assert acted and 0.25 <= acted[0] - start <= 1.0
    time.sleep(0.3)
    assert len(acted) == 1


def test_a_cancelled_overrun_does_not_act() -> None:
    acted: list[int] = []
    o = Overrun(Deadline.after(0.1), 0.0, lambda: acted.append(1))
    o.start()
    o.cancel()
    time.sleep(0.4)
    assert acted == []
