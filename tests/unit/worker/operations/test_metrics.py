"""Metrics registry and the /metrics, /healthz, /readyz server, scraped over real HTTP."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence

import pytest
from prometheus_client.parser import text_string_to_metric_families

from worker.operations.batch_stats import BatchStats
from worker.operations.metrics import Metrics
from worker.operations.probes import MetricsServer, readiness_body
from tests.conftest import DATA

STATS_SAMPLE = DATA / "librdkafka_stats.json"


def FakeBatch(*, bucket: int, bound: int, size: int, pad_len: int, real_tokens: int,  # noqa: N802
              queue_wait_s: Sequence[float] = (), backend_s: float = 0.004) -> BatchStats:
    """A batch as the bucketer reports it (the padded tokens follow from size and pad_len)."""
    return BatchStats(bucket=bucket, bound=bound, size=size, pad_len=pad_len, real_tokens=real_tokens,
                      padded_tokens=size * pad_len, queue_wait_s=list(queue_wait_s), backend_s=backend_s)


def _get(url: str, method: str = "GET") -> tuple[int, str, dict[str, str]]:
    req = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, resp.read().decode(), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(), dict(exc.headers)


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _value(text: str, name: str, **labels: str) -> float:
    return _samples(text)[(name, tuple(sorted(labels.items())))]


class Readiness:
    """A flippable readiness check, as Pipeline.ready() would report it."""

    def __init__(self) -> None:
        self.checks = {"assigned": False, "backend_loaded": True, "producer_healthy": True}

    def __call__(self) -> tuple[bool, dict[str, bool]]:
        return all(self.checks.values()), dict(self.checks)


@pytest.fixture()
def served() -> Iterator[tuple[Metrics, Readiness, str]]:
    metrics = Metrics()
    ready = Readiness()
    server = MetricsServer(metrics, "127.0.0.1", 0, ready)
    server.start()
    try:
        assert server.port > 0
        yield metrics, ready, f"http://127.0.0.1:{server.port}"
    finally:
        server.stop()


def test_healthz_is_200_while_alive_even_when_not_ready(served: tuple[Metrics, Readiness, str]) -> None:
    _, _, base = served
    status, body, _ = _get(base + "/healthz")
    assert (status, body) == (200, "ok\n")


def test_readyz_503_with_reason_then_200(served: tuple[Metrics, Readiness, str]) -> None:
    _, ready, base = served
    status, body, headers = _get(base + "/readyz")
    assert status == 503
    assert headers["Content-Type"] == "application/json"
    doc = json.loads(body)
    assert doc["ready"] is False
    assert doc["checks"] == {"assigned": False, "backend_loaded": True, "producer_healthy": True}
    assert "assigned" in doc["reason"]

    ready.checks["assigned"] = True
    status, body, _ = _get(base + "/readyz")
    assert status == 200
    assert json.loads(body) == {"ready": True, "reason": "ready",
                                "checks": {"assigned": True, "backend_loaded": True, "producer_healthy": True}}

    ready.checks["producer_healthy"] = False  # readiness can be lost again
    status, body, _ = _get(base + "/readyz")
    assert status == 503 and "producer_healthy" in json.loads(body)["reason"]


def test_readyz_with_a_string_reason_and_a_failing_check() -> None:
    state = {"ready": False}

    def check() -> tuple[bool, str]:
        if state.get("boom"):
            raise RuntimeError("backend handle gone")
        return state["ready"], "" if state["ready"] else "waiting for partition assignment"

    with MetricsServer(Metrics(), "127.0.0.1", 0, check) as server:
        base = f"http://127.0.0.1:{server.port}"
        status, body, _ = _get(base + "/readyz")
        assert status == 503 and json.loads(body)["reason"] == "waiting for partition assignment"
        state["ready"] = True
        status, body, _ = _get(base + "/readyz")
        assert status == 200 and json.loads(body) == {"ready": True, "reason": "ready"}
        state["boom"] = True
        status, body, _ = _get(base + "/readyz")
        assert status == 503 and "backend handle gone" in json.loads(body)["reason"]
        # The process is still alive: liveness must not follow readiness down.
        assert _get(base + "/healthz")[0] == 200


def test_unknown_path_is_404_and_head_has_no_body(served: tuple[Metrics, Readiness, str]) -> None:
    _, _, base = served
    assert _get(base + "/nope")[0] == 404
    status, body, headers = _get(base + "/healthz", method="HEAD")
    assert status == 200 and body == "" and headers["Content-Length"] == "3"


def test_metrics_scrape_shows_observed_values(served: tuple[Metrics, Readiness, str]) -> None:
    metrics, _, base = served
    metrics.count_consumed(10)
    metrics.count_consumed()
    metrics.count_produced(9)
    metrics.count_dead_lettered("invalid_json")
    metrics.count_dead_lettered("too_large", 2)
    metrics.set_in_flight(123)
    metrics.set_paused_partitions(2)
    metrics.count_rebalance("assign")
    metrics.set_backend_info("onnxruntime", "all-MiniLM-L6-v2", "cpu", device="cpu")
    metrics.observe_end_to_end(1_700_000_000_000, now_s=1_700_000_000.25)

    status, text, headers = _get(base + "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    assert _value(text, "kwe_consumed_messages_total") == 11
    assert _value(text, "kwe_produced_messages_total") == 9
    assert _value(text, "kwe_dead_lettered_messages_total", reason="invalid_json") == 1
    assert _value(text, "kwe_dead_lettered_messages_total", reason="too_large") == 2
    assert _value(text, "kwe_in_flight_keywords") == 123
    assert _value(text, "kwe_paused_partitions") == 2
    assert _value(text, "kwe_rebalances_total", kind="assign") == 1
    # The other kinds exist before their first event, at 0, so rate() works from the start.
    assert _value(text, "kwe_rebalances_total", kind="revoke") == 0
    assert _value(text, "kwe_rebalances_total", kind="lost") == 0
    assert _value(text, "kwe_backend_info", backend="onnxruntime", model="all-MiniLM-L6-v2", profile="cpu",
                  device="cpu") == 1
    assert _value(text, "kwe_end_to_end_latency_seconds_count") == 1
    assert _value(text, "kwe_end_to_end_latency_seconds_sum") == pytest.approx(0.25)
    assert _value(text, "kwe_end_to_end_latency_seconds_bucket", le="0.25") == 1
    assert _value(text, "kwe_end_to_end_latency_seconds_bucket", le="0.1") == 0


def test_per_bucket_histograms(served: tuple[Metrics, Readiness, str]) -> None:
    metrics, _, base = served
    # Bucket bound 8: a full batch of 256 with 3/8 of its tokens padding.
    metrics.observe_batch(FakeBatch(bucket=0, bound=8, size=256, pad_len=8, real_tokens=256 * 5,
                                    queue_wait_s=[0.002] * 256, backend_s=0.03))
    # Bucket bound 16: two small batches padded to their longest, one with no waste at all.
    metrics.observe_batch(FakeBatch(bucket=1, bound=16, size=3, pad_len=12, real_tokens=30,
                                    queue_wait_s=[0.019, 0.02, 0.0001], backend_s=0.002))
    metrics.observe_batch(FakeBatch(bucket=1, bound=16, size=2, pad_len=10, real_tokens=20,
                                    queue_wait_s=[0.001, 0.001], backend_s=0.001))
    _, text, _ = _get(base + "/metrics")

    # Labels carry the bucket bound, not the bucket index.
    assert _value(text, "kwe_batch_size_count", bucket="8") == 1
    assert _value(text, "kwe_batch_size_sum", bucket="8") == 256
    assert _value(text, "kwe_batch_size_bucket", bucket="8", le="128.0") == 0
    assert _value(text, "kwe_batch_size_bucket", bucket="8", le="256.0") == 1
    assert _value(text, "kwe_batch_size_count", bucket="16") == 2
    assert _value(text, "kwe_batch_size_sum", bucket="16") == 5
    assert _value(text, "kwe_batch_size_bucket", bucket="16", le="2.0") == 1
    assert _value(text, "kwe_batch_size_bucket", bucket="16", le="4.0") == 2

    assert _value(text, "kwe_padding_waste_ratio_sum", bucket="8") == pytest.approx(3 / 8)
    # The no-waste batch lands in the 0.0 bucket of its own.
    assert _value(text, "kwe_padding_waste_ratio_bucket", bucket="16", le="0.0") == 1
    assert _value(text, "kwe_padding_waste_ratio_bucket", bucket="16", le="0.2") == 2  # 1 - 30/36 = 0.167

    assert _value(text, "kwe_real_tokens_total", bucket="8") == 1280
    assert _value(text, "kwe_padded_tokens_total", bucket="8") == 2048
    assert _value(text, "kwe_real_tokens_total", bucket="16") == 50
    assert _value(text, "kwe_padded_tokens_total", bucket="16") == 56

    # Queue wait: one observation per keyword; backend time: one per batch.
    assert _value(text, "kwe_queue_wait_seconds_count", bucket="8") == 256
    assert _value(text, "kwe_queue_wait_seconds_count", bucket="16") == 5
    assert _value(text, "kwe_queue_wait_seconds_bucket", bucket="16", le="0.01") == 3
    assert _value(text, "kwe_backend_seconds_count", bucket="16") == 2
    assert _value(text, "kwe_backend_seconds_sum", bucket="8") == pytest.approx(0.03)


def test_end_to_end_skips_missing_timestamps_and_clamps_skew() -> None:
    m = Metrics()
    m.observe_end_to_end(0)
    m.observe_end_to_end(-1)
    text = m.render().decode()
    assert _value(text, "kwe_end_to_end_latency_seconds_count") == 0
    m.observe_end_to_end(2_000, now_s=1.0)  # producer clock 1 s ahead of ours
    text = m.render().decode()
    assert _value(text, "kwe_end_to_end_latency_seconds_count") == 1
    assert _value(text, "kwe_end_to_end_latency_seconds_sum") == 0.0


def test_update_from_stats_with_a_real_librdkafka_payload() -> None:
    # tests/data/librdkafka_stats.json is a statistics callback payload captured from
    # librdkafka 2.x against the local KRaft broker: topic "keywords" with 3 partitions of
    # 100 messages, the group committed at 80 (p0) and 20 (p1) and nothing on p2.
    raw = STATS_SAMPLE.read_text(encoding="utf-8")
    doc = json.loads(raw)
    assert doc["type"] == "consumer"
    parts = doc["topics"]["keywords"]["partitions"]
    assert parts["2"]["consumer_lag"] == -1 and parts["-1"]["consumer_lag"] == -1

    m = Metrics()
    assert m.update_from_stats(raw) == 2
    text = m.render().decode()
    assert _value(text, "kwe_consumer_lag", topic="keywords", partition="0") == 20
    assert _value(text, "kwe_consumer_lag", topic="keywords", partition="1") == 80
    lag_partitions = {dict(k[1])["partition"] for k in _samples(text) if k[0] == "kwe_consumer_lag"}
    assert lag_partitions == {"0", "1"}  # neither the unknown lag of p2 nor the internal -1

    # A later payload updates the gauge in place.
    parts["0"]["consumer_lag"] = 3
    m.update_from_stats(json.dumps(doc).encode())
    assert _value(m.render().decode(), "kwe_consumer_lag", topic="keywords", partition="0") == 3


def test_update_from_stats_respects_ownership_and_forget() -> None:
    raw = STATS_SAMPLE.read_text(encoding="utf-8")
    m = Metrics()
    assert m.update_from_stats(raw, owned={("keywords", 1)}) == 1
    text = m.render().decode()
    assert ("kwe_consumer_lag", (("partition", "0"), ("topic", "keywords"))) not in _samples(text)
    m.forget_partition("keywords", 1)
    m.forget_partition("keywords", 1)  # forgetting twice is harmless (revoke after lost)
    assert not [k for k in _samples(m.render().decode()) if k[0] == "kwe_consumer_lag"]


def test_update_from_stats_rejects_garbage() -> None:
    m = Metrics()
    with pytest.raises(ValueError):
        m.update_from_stats("{not json")
    with pytest.raises(ValueError):
        m.update_from_stats("[1, 2]")
    # A producer's payload has no consumer lag: nothing set, no error.
    assert m.update_from_stats(json.dumps({"type": "producer", "topics": {"embeddings": {"partitions": {
        "0": {"partition": 0, "consumer_lag": -1}}}}})) == 0


def test_update_from_stats_accepts_a_live_librdkafka_payload() -> None:
    # The real callback, from a consumer with no reachable broker: the payload is real
    # librdkafka output (no topics yet), and parsing it must neither fail nor set anything.
    from confluent_kafka import Consumer

    payloads: list[str] = []
    got = threading.Event()

    def on_stats(raw: str) -> None:
        payloads.append(raw)
        got.set()

    consumer = Consumer({"bootstrap.servers": "127.0.0.1:9", "group.id": "kwe-test-stats",
                         "statistics.interval.ms": 100, "stats_cb": on_stats, "logger": _Quiet()})
    try:
        for _ in range(50):
            consumer.poll(0.1)
            if got.is_set():
                break
    finally:
        consumer.close()
    assert payloads, "librdkafka emitted no statistics"
    assert Metrics().update_from_stats(payloads[-1]) == 0


class _Quiet:
    """A logging.Logger stand-in that swallows librdkafka's 'connection refused' lines."""

    def log(self, *args: object, **kwargs: object) -> None:
        pass


def test_rebalance_kind_is_checked_and_registries_are_separate() -> None:
    a, b = Metrics(), Metrics()
    with pytest.raises(ValueError, match="kind"):
        a.count_rebalance("moved")
    a.count_consumed(5)
    assert _value(b.render().decode(), "kwe_consumed_messages_total") == 0


def test_readiness_body_shapes() -> None:
    assert readiness_body(False, {"assigned": False, "backend_loaded": False}) == {
        "ready": False, "reason": "not ready: assigned, backend_loaded false",
        "checks": {"assigned": False, "backend_loaded": False}}
    assert readiness_body(True, "") == {"ready": True, "reason": "ready"}


def test_server_stop_releases_the_port_and_start_twice_fails() -> None:
    server = MetricsServer(Metrics(), "127.0.0.1", 0, lambda: (True, {}))
    server.start()
    port = server.port
    with pytest.raises(RuntimeError):
        server.start()
    server.stop()
    server.stop()  # idempotent
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2)
    # The same port can be bound again right away (SO_REUSEADDR), e.g. after a restart.
    again = MetricsServer(Metrics(), "127.0.0.1", port, lambda: (True, {}))
    again.start()
    try:
        assert _get(f"http://127.0.0.1:{port}/healthz")[0] == 200
    finally:
        again.stop()


def test_hop_histograms_exist_from_the_start_and_clamp_clock_steps() -> None:
    from worker.operations.metrics import HOPS

    metrics = Metrics()
    text = metrics.render().decode()
    for hop in HOPS:
        assert _value(text, "kwe_hop_seconds_count", hop=hop) == 0
    metrics.observe_hop("encode", 0.003)
    metrics.observe_hops("input_to_poll", [0.02, -1.0])
    text = metrics.render().decode()
    assert _value(text, "kwe_hop_seconds_count", hop="encode") == 1
    assert _value(text, "kwe_hop_seconds_bucket", hop="encode", le="0.0025") == 0
    assert _value(text, "kwe_hop_seconds_bucket", hop="encode", le="0.005") == 1
    assert _value(text, "kwe_hop_seconds_count", hop="input_to_poll") == 2
    assert _value(text, "kwe_hop_seconds_sum", hop="input_to_poll") == pytest.approx(0.02)


def test_kwe_healthy_follows_what_healthz_answers_and_restarts_can_be_counted() -> None:
    """The alert rules read /healthz as kwe_healthy, and restarts from process_start_time_seconds."""
    state: dict[str, object] = {"alive": True}

    def live() -> tuple[bool, str]:
        if isinstance(state["alive"], Exception):
            raise state["alive"]
        return bool(state["alive"]), "ok" if state["alive"] else "stalled: work has waited 9 s for a commit"

    metrics = Metrics()
    with MetricsServer(metrics, "127.0.0.1", 0, lambda: (True, "ok"), live) as server:
        base = f"http://127.0.0.1:{server.port}"
        seen = []
        for alive in (True, False, RuntimeError("check broke"), True):
            state["alive"] = alive
            status = _get(base + "/healthz")[0]
            text = _get(base + "/metrics")[1]
            seen.append((status, _value(text, "kwe_healthy")))
        assert seen == [(200, 1.0), (503, 0.0), (503, 0.0), (200, 1.0)]
        start = _value(text, "process_start_time_seconds")
        assert 0 < start <= time.time()
