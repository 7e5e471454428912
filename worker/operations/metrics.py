"""The Prometheus series: what an operator watches, in a registry of their own.

The HTTP server that exposes them (/metrics, beside /healthz and /readyz) is worker/operations/probes.py;
librdkafka's statistics are read into lags by worker/operations/rdkafka_stats.py.

Nothing here is module-level state: each `Metrics` owns its own `CollectorRegistry`, so two
workers in one process (tests, the demo) never share or collide on series, and tests can
build as many as they like. The pipeline gets a `Metrics` handed in and calls the small
methods below; it never touches prometheus_client itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Container, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from worker.operations.batch_stats import BatchStats
from worker.operations.bulk_histogram import BulkHistogram
from worker.operations.health import LiveCheck, always_alive
from worker.operations.rdkafka_stats import partition_lags

PREFIX = "kwe_"
REBALANCE_KINDS = ("assign", "revoke", "lost")

# Powers of two: the bucketer's batch limits are powers of two up to 256, so every full
# batch lands exactly on a bucket edge.
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# 0.0 is its own bucket: pad-to-longest batches of equal lengths waste nothing, and that is
# worth seeing apart from "a little".
WASTE_BUCKETS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
# Queue waits are bounded by max_queue_delay_ms (20 ms by default) unless the backend is the
# bottleneck, so resolution is finest around 1-50 ms.
QUEUE_WAIT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
BACKEND_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# End to end includes time spent in the topic before the worker read it, so a backlog after a
# restart shows up here as minutes.
E2E_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# Exactly-once: a transaction lasts about transaction_interval_ms plus its drain.
TRANSACTION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0)
# The hops of a keyword's way through the worker besides the bucket queue and the backend (which
# have their own histograms), in order (see Metrics.observe_hop); fine from 0.1 ms, since a
# healthy hop takes well under a millisecond and a starved one tens to hundreds.
Hop = Literal["input_to_poll", "poll_to_submit", "output_queue", "encode", "produce_call", "produce_to_ack"]
HOPS: tuple[Hop, ...] = ("input_to_poll", "poll_to_submit", "output_queue", "encode", "produce_call",
                         "produce_to_ack")
HOP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
               10.0, 30.0)


def _seconds_since(now_s: float, timestamps_ms: Sequence[int] | np.ndarray) -> list[float]:
    """Seconds from each timestamp (ms since the epoch) to now_s, skipping records without one (0
    or less). A list comprehension, not numpy: see worker/operations/bulk_histogram.py for why."""
    if isinstance(timestamps_ms, np.ndarray):
        timestamps_ms = timestamps_ms.tolist()
    return [now_s - t / 1000.0 for t in timestamps_ms if t > 0]


@dataclass(frozen=True, slots=True)
class _BatchSeries:
    """One bucket's labelled children of the per-batch metrics."""

    batch_size: Any
    padding_waste: Any
    real_tokens: Any
    padded_tokens: Any
    queue_wait: Any
    backend_time: Any
    merged_batches: Any


class Metrics:
    """All the worker's instruments, in a registry of their own."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self._batch_series: dict[int, _BatchSeries] = {}  # by bucket bound (observe_batch)
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self.consumed = Counter(f"{PREFIX}consumed_messages", "Input messages consumed.", registry=r)
        self.produced = Counter(f"{PREFIX}produced_messages",
                                "Embeddings acknowledged by the broker on the output topic.", registry=r)
        self.dead_lettered = Counter(f"{PREFIX}dead_lettered_messages",
                                     "Messages acknowledged on the dead-letter topic, by reason.", ["reason"],
                                     registry=r)
        self.in_flight = Gauge(f"{PREFIX}in_flight_keywords",
                               "Keywords consumed and not yet acknowledged by the broker.", registry=r)
        self.paused_partitions = Gauge(f"{PREFIX}paused_partitions",
                                       "Assigned partitions paused by flow control.", registry=r)
        self.interpreter_cpu = Gauge(f"{PREFIX}interpreter_cpu", "The CPU the worker's Python threads are held "
                                     "on (interpreter_cpu); -1 where they run unheld.", registry=r)
        self.interpreter_cpu.set(-1)
        self.intake_holds = Counter(f"{PREFIX}intake_holds", "Times intake held at the in-flight bound (consumed "
                                    "nothing while room came back, partitions not paused).", registry=r)
        self.batch_size = Histogram(f"{PREFIX}batch_size", "Keywords per dispatched batch, by bucket bound.",
                                    ["bucket"], buckets=BATCH_SIZE_BUCKETS, registry=r)
        self.padding_waste = Histogram(f"{PREFIX}padding_waste_ratio",
                                       "Per batch: padded tokens that are padding (1 - real/padded).",
                                       ["bucket"], buckets=WASTE_BUCKETS, registry=r)
        # The histogram weighs every batch alike; these two let a dashboard compute the
        # token-weighted waste exactly: 1 - rate(real) / rate(padded).
        self.real_tokens = Counter(f"{PREFIX}real_tokens", "Non-padding tokens sent to the backend.",
                                   ["bucket"], registry=r)
        self.padded_tokens = Counter(f"{PREFIX}padded_tokens",
                                     "Tokens sent to the backend including padding (batch x pad length).",
                                     ["bucket"], registry=r)
        # The per-keyword latencies are observed a batch at a time (worker/operations/bulk_histogram.py).
        self.queue_wait = BulkHistogram(f"{PREFIX}queue_wait_seconds",
                                        "Per keyword: time in its bucket queue before its batch was dispatched.",
                                        labelnames=["bucket"], buckets=QUEUE_WAIT_BUCKETS, registry=r)
        self.backend_time = Histogram(f"{PREFIX}backend_seconds", "Per batch: time in the inference backend.",
                                      ["bucket"], buckets=BACKEND_BUCKETS, registry=r)
        self.end_to_end = BulkHistogram(f"{PREFIX}end_to_end_latency_seconds",
                                        "Kafka timestamp of the input message to broker ack of its output.",
                                        buckets=E2E_BUCKETS, registry=r)
        self.hop = BulkHistogram(
            f"{PREFIX}hop_seconds",
            "Per keyword (per batch for output_queue, encode, produce_call), time spent in one hop: input_to_poll "
            "(input record timestamp to the poll that returned it: time in the topic, fetch and the prefetch "
            "queue), poll_to_submit (decode, validate, tokenize), output_queue (batch finished to the output "
            "thread taking it), encode (output values of a batch), produce_call (producer.produce calls of a "
            "batch), produce_to_ack (produce call to the broker's acknowledgement).",
            labelnames=["hop"], buckets=HOP_BUCKETS, registry=r)
        self.consumer_lag = Gauge(f"{PREFIX}consumer_lag", "Messages behind the high watermark, per partition.",
                                  ["topic", "partition"], registry=r)
        self.rebalances = Counter(f"{PREFIX}rebalances", "Partition rebalance callbacks, by kind.", ["kind"],
                                  registry=r)
        # The last rebalance callback (kind, monotonic time): readiness tells a standby member from
        # one still joining by it (worker/operations/health.py, Readiness).
        self._last_rebalance: tuple[str, float] | None = None
        # The embedding cache (worker/embedding_cache.py) counts for itself; its series are read from it at
        # scrape time (watch_cache), so the per-keyword path pays for no metric update.
        self._cache_stats: Callable[[], Any] | None = None
        r.register(_CacheCollector(lambda: self._cache_stats))
        self.merged_batches = Counter(f"{PREFIX}merged_batches",
                                      "Batches that hold more than one length bucket "
                                      "(worker/batching/batch_policy.py), by the bound they were padded in.",
                                      ["bucket"], registry=r)
        # The cost model's prices, read from it at scrape time (watch_costs).
        self._costs: Any = None
        r.register(_CostCollector(lambda: self._costs))
        self.transactions = Counter(f"{PREFIX}transactions", "Exactly-once transactions, by outcome.",
                                    ["outcome"], registry=r)
        self.transaction_time = Histogram(f"{PREFIX}transaction_seconds",
                                          "Exactly-once: begin to commit (or abort) of a transaction.",
                                          buckets=TRANSACTION_BUCKETS, registry=r)
        self.take_overs = Counter(f"{PREFIX}producer_take_overs",
                                  "Exactly-once: a new producer took over the member's transactional id, by reason "
                                  "(hung: a transactional call did not return; fenced: the broker timed the "
                                  "transaction out, as after a coordinator outage).", ["reason"], registry=r)
        self.backend_info = Info(f"{PREFIX}backend", "Inference backend, model and bucket profile in use.",
                                 registry=r)
        self.model_info = Info(f"{PREFIX}model", "The model fingerprint of the vectors written (equal: comparable), "
                                                 "with the model, its precision, encoding and width.", registry=r)
        # What /healthz answers, as a series (read at scrape time), so an alert sees a worker that is
        # up but failing its liveness check; and process_start_time_seconds, whose changes count
        # restarts where kube-state-metrics is not there (deploy/prometheus/alerts.yml).
        self._live: LiveCheck = always_alive
        r.register(_HealthCollector(lambda: self._live))
        ProcessCollector(registry=r)
        # Series that exist from the start read 0 instead of "no data", so rate() and
        # alerts on them work before the first event.
        for kind in REBALANCE_KINDS:
            self.rebalances.labels(kind=kind)
        for hop in HOPS:
            self.hop.labels(hop=hop)
        for outcome in ("committed", "aborted", "taken_over"):
            self.transactions.labels(outcome=outcome)
        for reason in ("hung", "fenced"):
            self.take_overs.labels(reason=reason)

    def observe_transaction(self, outcome: str, seconds: float) -> None:
        self.transactions.labels(outcome=outcome).inc()
        self.transaction_time.observe(seconds)

    def count_take_over(self, reason: str) -> None:
        self.take_overs.labels(reason=reason).inc()

    # --- messages ----------------------------------------------------------------------
    def count_consumed(self, n: int = 1) -> None:
        self.consumed.inc(n)

    def count_produced(self, n: int = 1) -> None:
        self.produced.inc(n)

    def count_dead_lettered(self, reason: str, n: int = 1) -> None:
        self.dead_lettered.labels(reason=reason).inc(n)

    def observe_end_to_end(self, timestamp_ms: int, now_s: float | None = None) -> None:
        """Latency from a Kafka message timestamp (ms since the epoch) to now.

        Messages without a timestamp (librdkafka gives 0 or -1) are skipped. Clock skew
        between producer and worker can make the difference negative; it is clamped to 0
        rather than dragging the histogram's sum below the truth.
        """
        self.observe_end_to_end_many([timestamp_ms], now_s)

    def observe_end_to_end_many(self, timestamps_ms: Sequence[int] | np.ndarray, now_s: float | None = None) -> None:
        """observe_end_to_end of many records at once (the delivery thread's acknowledgements of one poll)."""
        # Negative ages (clock skew) are clamped to 0 by the histogram.
        self.end_to_end.observe_many(_seconds_since(time.time() if now_s is None else now_s, timestamps_ms))

    def observe_hop(self, hop: Hop, seconds: float) -> None:
        """One keyword's (or batch's) time in a hop; clock steps below 0 count as 0."""
        self.hop.labels(hop=hop).observe(max(0.0, seconds))

    def observe_hops(self, hop: Hop, seconds: Sequence[float] | np.ndarray) -> None:
        """Many keywords' times in a hop, at once; clock steps below 0 count as 0."""
        self.hop.labels(hop=hop).observe_many(seconds)

    def observe_hop_since(self, hop: Hop, timestamps_ms: Sequence[int], now_s: float) -> None:
        """A hop that began at each record's Kafka timestamp (ms since the epoch; 0 or less: none)
        and ends at `now_s`."""
        self.hop.labels(hop=hop).observe_many(_seconds_since(now_s, timestamps_ms))

    def observe_hop_repeated(self, hop: Hop, seconds: float, n: int) -> None:
        """`n` keywords that spent the same time in a hop (a poll's, submitted together)."""
        self.hop.labels(hop=hop).observe_repeated(seconds, n)

    # --- flow control --------------------------------------------------------------------
    def set_in_flight(self, n: int) -> None:
        self.in_flight.set(n)

    def set_paused_partitions(self, n: int) -> None:
        self.paused_partitions.set(n)

    def set_interpreter_cpu(self, cpu: int) -> None:
        self.interpreter_cpu.set(cpu)

    def count_intake_hold(self) -> None:
        self.intake_holds.inc()

    # --- batches -------------------------------------------------------------------------
    def observe_batch(self, stats: BatchStats) -> None:
        # The bound, not the index, labels the series: "bucket=16" reads on a dashboard,
        # "bucket=7" needs the profile file open beside it.
        series = self._batch_series.get(stats.bound)
        if series is None:
            # Looked up once per bucket: labels() validates and locks on every call, six times a
            # batch, which a stream of small batches paid more for than the observations.
            label = str(stats.bound)
            series = self._batch_series.setdefault(stats.bound, _BatchSeries(
                self.batch_size.labels(bucket=label), self.padding_waste.labels(bucket=label),
                self.real_tokens.labels(bucket=label), self.padded_tokens.labels(bucket=label),
                self.queue_wait.labels(bucket=label), self.backend_time.labels(bucket=label),
                self.merged_batches.labels(bucket=label)))
        series.batch_size.observe(stats.size)
        series.padding_waste.observe(stats.padding_waste)
        series.real_tokens.inc(stats.real_tokens)
        series.padded_tokens.inc(stats.padded_tokens)
        series.queue_wait.observe_many(stats.queue_wait_s)
        series.backend_time.observe(stats.backend_s)
        if stats.merged > 1:
            series.merged_batches.inc()

    # --- cost model (worker.batching.cost_model.CostModel) ------------------------------------------
    def watch_costs(self, costs: Any) -> None:
        """Export the prices of this CostModel (calibrated and live), read at scrape time."""
        self._costs = costs

    # --- embedding cache (worker.embedding_cache.CacheObserver) -----------------------------------
    def watch_cache(self, stats: Callable[[], Any]) -> None:
        """Export the cache whose `stats()` (a worker.embedding_cache.CacheStats) is given, read at scrape time."""
        self._cache_stats = stats

    def watch_liveness(self, live: LiveCheck) -> None:
        """Export `live` (the /healthz check) as kwe_healthy, 1 or 0, read at scrape time."""
        self._live = live

    # --- consumer group ------------------------------------------------------------------
    def set_lag(self, topic: str, partition: int, lag: int) -> None:
        self.consumer_lag.labels(topic=topic, partition=str(partition)).set(max(0, lag))

    def update_from_stats(self, stats_json: str | bytes,
                          owned: Container[tuple[str, int]] | None = None) -> int:
        """Sets the per-partition lag gauge from a librdkafka statistics callback payload
        (worker/operations/rdkafka_stats.py reads it); returns how many partitions were set.

        Raises ValueError when the payload is not a librdkafka statistics object, so a
        caller can log it; the stats callback must not take the worker down either way.
        """
        lags = partition_lags(stats_json, owned)
        for lag in lags:
            self.set_lag(lag.topic, lag.partition, lag.lag)
        return len(lags)

    def forget_partition(self, topic: str, partition: int) -> None:
        """Drops the lag series of a partition this worker no longer owns.

        Left in place, a revoked partition's last lag would be summed with the new owner's
        on the dashboard and keep a lag alert firing on the wrong worker.
        """
        try:
            self.consumer_lag.remove(topic, str(partition))
        except KeyError:
            pass

    def count_rebalance(self, kind: str, n: int = 1) -> None:
        if kind not in REBALANCE_KINDS:
            raise ValueError(f"rebalance kind {kind!r} is not one of {', '.join(REBALANCE_KINDS)}")
        self.rebalances.labels(kind=kind).inc(n)
        self._last_rebalance = (kind, time.monotonic())

    def last_rebalance(self) -> tuple[str, float] | None:
        return self._last_rebalance

    # --- identity ------------------------------------------------------------------------
    def set_backend_info(self, backend: str, model: str, profile: str, **extra: str) -> None:
        """Identity labels on `kwe_backend_info` (value 1); `extra` adds e.g. device=... ."""
        self.backend_info.info({"backend": backend, "model": model, "profile": profile,
                                **{k: str(v) for k, v in extra.items()}})

    def set_model_info(self, fingerprint: str, model: str, **extra: str) -> None:
        """`kwe_model_info{fingerprint,model,...} 1`: which vectors this worker writes."""
        self.model_info.info({"fingerprint": fingerprint, "model": model, **{k: str(v) for k, v in extra.items()}})

    def render(self) -> bytes:
        """The registry in the Prometheus text exposition format."""
        return generate_latest(self.registry)


# (series name, kind, help, CacheStats field)
CACHE_SERIES = (
    ("cache_hits", "counter", "Keywords whose vector came from the embedding cache.", "hits"),
    ("cache_joined", "counter", "Keywords that joined the in-flight computation of the same tokens "
     "(answered with its vector, no model run).", "joined"),
    ("cache_misses", "counter", "Keywords looked up in the embedding cache and not found (sent to the model).",
     "misses"),
    ("cache_evictions", "counter", "Vectors evicted from the embedding cache to keep it within cache_bytes.",
     "evictions"),
    ("cache_entries", "gauge", "Vectors held by the embedding cache.", "entries"),
    ("cache_bytes", "gauge", "Bytes held by the embedding cache (keys, vectors and map overhead).", "nbytes"),
)


class _CacheCollector(Collector):
    """The cache's own counters as Prometheus series; zeros until a cache is watched."""

    def __init__(self, source: Callable[[], Callable[[], Any] | None]) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        stats_fn = self._source()
        stats = stats_fn() if stats_fn is not None else None
        for name, kind, help_text, attr in CACHE_SERIES:
            value = float(getattr(stats, attr)) if stats is not None else 0.0
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield family(f"{PREFIX}{name}", help_text, value=value)


class _CostCollector(Collector):
    """kwe_cost_model_seconds{term, source}: the prices of a backend call; kwe_cost_model_slowdown:
    what a call of 4 rows x 8 tokens costs now against the start-up calibration (1.0: as when idle)."""

    def __init__(self, source: Callable[[], Any]) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        costs = self._source()
        if costs is None:
            return
        live, calibrated = costs.prices(), costs.calibrated
        prices = GaugeMetricFamily(f"{PREFIX}cost_model_seconds",
                                   "Backend call price t = fixed + per_row x B + per_token x B x L, by term, as "
                                   "calibrated at start and as refined from live calls.", labels=["term", "source"])
        for source, p in (("calibrated", calibrated), ("live", live)):
            prices.add_metric(["fixed", source], p.fixed_s)
            prices.add_metric(["per_row", source], p.per_row_s)
            prices.add_metric(["per_token", source], p.per_token_s)
        yield prices
        reference = calibrated.cost(4, 8)
        yield GaugeMetricFamily(f"{PREFIX}cost_model_slowdown",
                                "A 4 x 8 call's live price over its calibrated (idle) price.",
                                value=live.cost(4, 8) / reference if reference > 0 else 0.0)


class _HealthCollector(Collector):
    """kwe_healthy: 1 when the liveness check passes (/healthz 200), 0 when it fails or raises."""

    def __init__(self, source: Callable[[], LiveCheck]) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        try:
            alive = bool(self._source()()[0])
        except Exception:  # noqa: BLE001 - a failing check is a failing worker, as on /healthz
            alive = False
        yield GaugeMetricFamily(f"{PREFIX}healthy", "1 when the liveness check passes (/healthz answers 200), "
                                "0 when it fails (fatal error, dead thread, stalled commit point).",
                                value=1.0 if alive else 0.0)
