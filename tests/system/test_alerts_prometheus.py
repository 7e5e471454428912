"""A real Prometheus (Debian's 2.42, started here on loopback) scraping a real worker, with the
rules of deploy/prometheus/alerts.yml: the worker's model calls hang, the stall alerts fire in
Prometheus's /api/v1/alerts, and they clear when the model answers again; a `keyword-embedder run`
process stopped with SIGSTOP fires KweWorkerDown, which clears on SIGCONT.

The rules are loaded time-scaled so that the test takes a minute, not a quarter of an hour: every
alert's `for:` becomes 10 s and KweWorkerNoProgress's 5-minute rate window becomes 15 s. Each
expression is otherwise the file's, byte for byte (the test checks it). The worker runs in-process
(the only way to hand it a backend that hangs) against the real broker; Prometheus scrapes its
/metrics over HTTP every second and evaluates the rules every second.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.kafka_tools import WorkerProcess, free_port, http_get, load_queries, produce_queries
from tests.unit.deploy.test_alerts import RULES, prometheus_tool
from tests.in_process import in_process, loaded, topics  # noqa: F401 - loaded is a fixture
from worker.operations.probes import MetricsServer

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

SCALED_FOR = "10s"
SCALED_WINDOW = ("[5m]", "[15s]")
STALL_TIMEOUT_S = 3.0
# On top of the condition's own time (for:, the rate window): a scrape and an evaluation (1 s
# each), librdkafka's statistics interval for the lag (5 s), and a noisy shared machine.
BOUND_S = 15.0
STALL_ALERTS = ("KweWorkerUnhealthy", "KweWorkerNoProgress")


def scaled_rules() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(RULES.read_text(encoding="utf-8"))
    for group in doc["groups"]:
        for rule in group["rules"]:
            if "alert" not in rule:
                continue
            if "for" in rule:
                rule["for"] = SCALED_FOR
            if rule["alert"] == "KweWorkerNoProgress":
                assert rule["expr"].count(SCALED_WINDOW[0]) == 1
                rule["expr"] = rule["expr"].replace(*SCALED_WINDOW)
    return doc


class Prometheus:
    """`prometheus` on a free loopback port, its data in a temporary folder; stop() ends it."""

    def __init__(self, folder: Path, target: str) -> None:
        binary = prometheus_tool("prometheus")
        (folder / "rules.yml").write_text(yaml.safe_dump(scaled_rules(), sort_keys=False), encoding="utf-8")
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
            "rule_files": ["rules.yml"],
            "scrape_configs": [{"job_name": "keyword-embedder", "static_configs": [{"targets": [target]}]}],
        }
        (folder / "prometheus.yml").write_text(yaml.safe_dump(config), encoding="utf-8")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = (folder / "prometheus.log").open("wb")
        self._proc = subprocess.Popen(
            [binary, f"--config.file={folder / 'prometheus.yml'}", f"--storage.tsdb.path={folder / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self._log, stderr=subprocess.STDOUT, cwd=folder)
        self.log_path = folder / "prometheus.log"
        deadline = time.monotonic() + 30
        while not self._ready():
            assert self._proc.poll() is None, f"prometheus exited:\n{self.log_path.read_text()}"
            assert time.monotonic() < deadline, f"prometheus not ready in 30 s:\n{self.log_path.read_text()}"
            time.sleep(0.2)

    def _ready(self) -> bool:
        try:
            return http_get(f"{self.url}/-/ready")[0] == 200
        except OSError:  # not listening yet
            return False

    def api(self, path: str) -> Any:
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}", timeout=5) as resp:
            body = json.load(resp)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, promql: str) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.api(f"query?query={urllib.parse.quote(promql)}")["result"]
        return result

    def alerts(self) -> dict[str, str]:
        """alertname -> state (pending, firing) of the active alerts."""
        return {a["labels"]["alertname"]: a["state"] for a in self.api("alerts")["alerts"]}

    def stop(self) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(15)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(5)
        self._log.close()


def wait_for(condition: Callable[[], bool], seconds: float, what: str,
             detail: Callable[[], object] = lambda: "") -> float:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < seconds, f"not within {seconds:.0f} s: {what} {detail()}"
        time.sleep(0.25)
    return time.monotonic()


def produced(p: Any) -> float:
    value = p.metrics.registry.get_sample_value("kwe_produced_messages_total")
    return float(value or 0.0)


@pytest.fixture()
def gate() -> Iterator[threading.Event]:
    """Open: the model answers. Cleared: every model call waits until it is set again."""
    event = threading.Event()
    event.set()
    yield event
    event.set()  # never leave a backend thread waiting behind a failed test


def test_the_time_scaled_rules_differ_from_the_file_only_in_durations() -> None:
    original = yaml.safe_load(RULES.read_text(encoding="utf-8"))["groups"]
    scaled = scaled_rules()["groups"]
    for group_o, group_s in zip(original, scaled, strict=True):
        for rule_o, rule_s in zip(group_o["rules"], group_s["rules"], strict=True):
            differ = {k for k in rule_o.keys() | rule_s.keys() if rule_o.get(k) != rule_s.get(k)}
            assert differ <= {"for", "expr"}, rule_o
            if "expr" in differ:
                assert rule_s["expr"] == rule_o["expr"].replace(*SCALED_WINDOW)


def test_stalled_model_calls_fire_the_stall_alerts_in_a_real_prometheus_and_they_clear(
        kafka_bootstrap: str, make_topic: Callable[..., str], group_id: str, loaded: tuple[Any, Any, Any],  # noqa: F811
        gate: threading.Event, tmp_path: Path) -> None:
    names = topics(make_topic, 2)
    # The worker's own setting, as `run` would serve it (it also turns on librdkafka's statistics,
    # the source of kwe_consumer_lag).
    port = free_port()
    worker, _ = in_process(loaded, kafka_bootstrap, names, group_id, lambda _call, _ids: not gate.wait(300),
                           stall_timeout_s=STALL_TIMEOUT_S, metrics_port=port, metrics_host="127.0.0.1")
    p = worker.pipeline
    with MetricsServer(p.metrics, "127.0.0.1", port, p.ready, p.liveness) as server:
        healthz = f"http://127.0.0.1:{server.port}/healthz"
        prometheus = Prometheus(tmp_path, f"127.0.0.1:{server.port}")
        worker.start()
        try:
            # A healthy start: a first batch goes through and is committed (librdkafka reports a
            # partition's lag only once the group has a committed offset there).
            produce_queries(kafka_bootstrap, names[0], load_queries(0, 100))
            wait_for(lambda: produced(p) >= 100, 60, "the first 100 embeddings")
            wait_for(lambda: bool(prometheus.query("sum(kwe_consumer_lag) == 0")), 30,
                     "Prometheus sees the committed lag of 0",
                     lambda: (prometheus.query("kwe_consumer_lag"), prometheus.query("up"),
                              p.metrics.render().decode()))
            assert not set(STALL_ALERTS) & set(prometheus.alerts()), "stall alerts on a healthy worker"

            # The model hangs; more keywords arrive and wait.
            gate.clear()
            produce_queries(kafka_bootstrap, names[0], load_queries(100, 200))
            stalled_at = time.monotonic()
            unhealthy_at = wait_for(lambda: http_get(healthz)[0] == 503, 30, "/healthz 503")
            for_s = float(SCALED_FOR.removesuffix("s"))
            fired_unhealthy = wait_for(lambda: prometheus.alerts().get("KweWorkerUnhealthy") == "firing",
                                       for_s + BOUND_S, "KweWorkerUnhealthy firing")
            assert fired_unhealthy - unhealthy_at >= for_s - 1.0, "fired before its for: time"
            window_s = 15.0
            fired_no_progress = wait_for(lambda: prometheus.alerts().get("KweWorkerNoProgress") == "firing",
                     max(0.0, stalled_at + window_s + for_s + BOUND_S - time.monotonic()),
                     "KweWorkerNoProgress firing")
            assert "KweWorkerDown" not in prometheus.alerts(), "the worker answers its scrapes"

            # The model answers again: the work drains, the commit point moves, both alerts clear.
            gate.set()
            resumed_at = time.monotonic()
            cleared_at = wait_for(lambda: not set(STALL_ALERTS) & set(prometheus.alerts()), 30 + BOUND_S,
                                  "the stall alerts clear")
            print(f"KweWorkerUnhealthy firing {fired_unhealthy - unhealthy_at:.1f} s after /healthz 503 "
                  f"(for: {SCALED_FOR}); KweWorkerNoProgress firing {fired_no_progress - stalled_at:.1f} s after "
                  f"the stall (window 15 s + for: {SCALED_FOR}); both cleared {cleared_at - resumed_at:.1f} s after "
                  "the model answered again")
            assert http_get(healthz)[0] == 200
            # The stalled keywords arrived tens of seconds late: two thirds of all keywords over
            # 250 ms burns the latency budget far past 14.4x, in both windows.
            wait_for(lambda: prometheus.alerts().get("KweLatencySLOFastBurn") == "firing", for_s + BOUND_S,
                     "KweLatencySLOFastBurn firing")
            assert produced(p) >= 300
            # Every rule evaluated against the real series without an error (a many-to-many match,
            # a missing series used as a scalar, ...).
            bad = [(r.get("name"), r.get("lastError")) for g in prometheus.api("rules")["groups"]
                   for r in g["rules"] if r["health"] != "ok"]
            assert not bad, bad
        finally:
            gate.set()
            assert worker.stop(60) == 0
            prometheus.stop()


def test_a_stopped_worker_process_fires_worker_down_and_it_clears_when_it_continues(
        kafka_bootstrap: str, make_topic: Callable[..., str], group_id: str, tmp_path: Path) -> None:
    names = topics(make_topic, 2)
    worker = WorkerProcess(kafka_bootstrap, *names, group=group_id, log_path=tmp_path / "worker.log",
                           extra=("--intra-op-threads", "1"))
    prometheus = Prometheus(tmp_path, f"127.0.0.1:{worker.metrics_port}")
    worker.start()
    try:
        worker.wait_ready()
        produce_queries(kafka_bootstrap, names[0], load_queries(0, 50))
        wait_for(lambda: bool(prometheus.query("kwe_produced_messages_total >= 50")), 60,
                 "Prometheus sees the first 50 embeddings")
        assert "KweWorkerDown" not in prometheus.alerts()

        worker.signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        for_s = float(SCALED_FOR.removesuffix("s"))
        fired = wait_for(lambda: prometheus.alerts().get("KweWorkerDown") == "firing", for_s + BOUND_S,
                         "KweWorkerDown firing")
        assert fired - stopped_at >= for_s - 1.0, "fired before its for: time"

        worker.signal(signal.SIGCONT)
        continued_at = time.monotonic()
        cleared = wait_for(lambda: "KweWorkerDown" not in prometheus.alerts(), BOUND_S, "KweWorkerDown clears")
        print(f"KweWorkerDown firing {fired - stopped_at:.1f} s after SIGSTOP (for: {SCALED_FOR}); "
              f"cleared {cleared - continued_at:.1f} s after SIGCONT")
    finally:
        if worker.proc is not None and worker.proc.poll() is None:
            worker.signal(signal.SIGCONT)
        assert worker.stop(60) == 0, worker.log()[-3000:]
        prometheus.stop()
