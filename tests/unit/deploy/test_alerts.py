"""The alert rules (deploy/prometheus/alerts.yml) and their kustomize component, with promtool.

promtool comes from Debian's `prometheus` package (2.42), which .ci/run installs; without it these
tests skip (and fail under CI, which must have it). The component's renders need kustomize
(`make tools`), as in test_deploy_k8s.py. The real Prometheus scraping a real worker is
tests/system/test_alerts_prometheus.py.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.ci_tools import missing
from tests.deploy_tools import DEPLOY, K8S, ROOT, kustomize_build
from worker.operations.metrics import Metrics
from worker.operations.probes import MetricsServer

RULES = DEPLOY / "prometheus" / "alerts.yml"
RULE_TESTS = DEPLOY / "prometheus" / "tests"
COMPONENT = K8S / "components" / "alerts"
RUNBOOK = ROOT / "docs" / "runbook.md"
# Series the rules read that the worker does not export: Prometheus's own and kube-state-metrics'.
NOT_FROM_THE_WORKER = {"up", "kube_pod_container_status_restarts_total"}
RUNBOOK_PARTS = ("**What it means.**", "**First three things to look at.**", "**Usual fixes.**")


def prometheus_tool(name: str) -> str:
    """`promtool` or `prometheus`: skips where it is not installed, fails under CI unless .ci/run
    said why it could not install it."""
    found = shutil.which(name)
    if found is None:
        missing(f"{name} not found", ci_step="install Debian's prometheus package",
                hint="`apt-get install prometheus` (Debian) to test the alert rules",
                unavailable_env="KWE_PROMETHEUS_UNAVAILABLE")
    return found


def promtool() -> str:
    return prometheus_tool("promtool")


def run_promtool(*args: str | Path) -> str:
    out = subprocess.run([promtool(), *map(str, args)], capture_output=True, text=True)
    assert out.returncode == 0, f"promtool {' '.join(map(str, args))} failed:\n{out.stdout}\n{out.stderr}"
    return out.stdout


def rules_of(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [rule for group in groups for rule in group["rules"]]


def plain_groups() -> list[dict[str, Any]]:
    groups: list[dict[str, Any]] = yaml.safe_load(RULES.read_text(encoding="utf-8"))["groups"]
    return groups


def alert_names() -> list[str]:
    return [r["alert"] for r in rules_of(plain_groups()) if "alert" in r]


def rendered_component(path: Path = COMPONENT) -> list[dict[str, Any]]:
    (rule,) = [d for d in kustomize_build(path) if d["kind"] == "PrometheusRule"]
    groups: list[dict[str, Any]] = rule["spec"]["groups"]
    return groups


def component_settings() -> dict[str, str]:
    """settings.env key -> the kwe_setting_* recording rule its replacement writes."""
    kustomization = yaml.safe_load((COMPONENT / "kustomization.yaml").read_text(encoding="utf-8"))
    out = {}
    for replacement in kustomization["replacements"]:
        source = replacement["source"]
        if source["name"] != "keyword-embedder-alert-settings":
            continue
        (target,) = replacement["targets"]
        (path,) = target["fieldPaths"]
        record = re.fullmatch(r".*\[record=(\w+)\]\.expr", path)
        assert record, path
        out[source["fieldPath"].removeprefix("data.")] = record[1]
    return out


# ------------------------------------------------------------------------------ the rule file
def test_the_rules_pass_promtool_check() -> None:
    assert "SUCCESS" in run_promtool("check", "rules", RULES)


def test_every_alert_fires_and_stays_silent_as_its_unit_tests_say() -> None:
    run_promtool("test", "rules", *sorted(RULE_TESTS.glob("*_test.yml")))


def test_every_alert_has_a_test_that_fires_it_and_one_that_keeps_it_silent() -> None:
    fired: set[str] = set()
    silent: set[str] = set()
    for path in [*RULE_TESTS.glob("*_test.yml"), *(COMPONENT / "tests").glob("*_test.yml")]:
        for case in yaml.safe_load(path.read_text(encoding="utf-8"))["tests"]:
            for check in case.get("alert_rule_test", []):
                (fired if check.get("exp_alerts") else silent).add(check["alertname"])
    names = set(alert_names())
    assert fired >= names, f"never shown firing: {sorted(names - fired)}"
    assert silent >= names, f"never shown silent: {sorted(names - silent)}"
    assert not (fired | silent) - names, f"tests of alerts that do not exist: {sorted((fired | silent) - names)}"


def test_every_worker_series_the_rules_read_is_one_the_worker_exports() -> None:
    """A renamed metric would leave an alert that can never fire; promtool cannot see that."""
    metrics = Metrics()
    # Labelled series exist once something sets them, as in a running worker.
    metrics.set_lag("keywords", 0, 5)
    metrics.count_dead_lettered("empty_text")
    with MetricsServer(metrics, "127.0.0.1", 0, lambda: (True, "ok")):
        exported = {s.name for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples}
    kube = yaml.safe_load((COMPONENT / "kube-restarts.yaml").read_text(encoding="utf-8"))["data"]["restarts-expr"]
    rules = [*rules_of(plain_groups()), {"expr": kube}]
    recorded = {r["record"] for r in rules if "record" in r}
    read = {name for rule in rules for name in re.findall(r"\b(?:kwe_|process_|kube_)\w+|\bup\b", rule["expr"])}
    read -= recorded
    missing = read - exported - NOT_FROM_THE_WORKER
    assert not missing, f"the rules read series the worker does not export: {sorted(missing)}"
    assert {"kwe_healthy", "process_start_time_seconds", "kwe_consumer_lag"} <= read


def test_every_alert_links_its_runbook_section_and_the_section_has_its_three_parts() -> None:
    text = RUNBOOK.read_text(encoding="utf-8")
    sections = dict(re.findall(r"^## (\w+)\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S))
    for rule in rules_of(plain_groups()):
        if "alert" not in rule:
            continue
        name = rule["alert"]
        assert rule["annotations"]["runbook_url"] == f"docs/runbook.md#{name.lower()}", name
        assert name in sections, f"docs/runbook.md has no section '## {name}'"
        for part in RUNBOOK_PARTS:
            assert part in sections[name], f"runbook section {name} lacks {part}"
        for label in ("severity",):
            assert rule["labels"][label] in ("warning", "critical"), name
    alerts_in_runbook = {s for s in sections if s.startswith("Kwe")}
    assert alerts_in_runbook == set(alert_names()), "runbook sections and alerts differ"


def test_the_settings_are_the_first_rules_and_the_component_sets_each_one() -> None:
    rules = rules_of(plain_groups())
    settings = [r["record"] for r in rules if r.get("record", "").startswith("kwe_setting_")]
    assert [r.get("record") for r in rules[:len(settings)]] == settings, "settings first: later rules read them"
    assert sorted(component_settings().values()) == sorted(settings)
    env = dict(line.split("=", 1) for line in (COMPONENT / "settings.env").read_text(encoding="utf-8").splitlines()
               if line and not line.startswith("#"))
    by_record = {r["record"]: r["expr"] for r in rules if "record" in r}
    assert {k: float(v) for k, v in env.items()} == {k: float(by_record[r]) for k, r in component_settings().items()}, \
        "settings.env defaults differ from deploy/prometheus/alerts.yml"


# ------------------------------------------------------------------------------ the component
def test_the_prometheusrule_is_generated_from_the_rule_file() -> None:
    out = subprocess.run([sys.executable, str(DEPLOY / "tools" / "prometheus_rule.py"), "--check"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def _write_rendered(groups: list[dict[str, Any]], folder: Path) -> Path:
    path = folder / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False), encoding="utf-8")
    return path


def test_the_component_renders_the_same_rules_and_its_tests_pass(tmp_path: Path) -> None:
    rendered = rendered_component()
    plain = plain_groups()
    restart = "KweWorkerRestarting"
    strip = [{**g, "rules": [{k: v for k, v in r.items() if not (r.get("alert") == restart and k == "expr")}
                             for g_r in [g["rules"]] for r in g_r]} for g in plain]
    strip_rendered = [{**g, "rules": [{k: v for k, v in r.items() if not (r.get("alert") == restart and k == "expr")}
                                      for r in g["rules"]]} for g in rendered]
    assert strip_rendered == strip, "the PrometheusRule's rules differ from deploy/prometheus/alerts.yml"
    (kube,) = [r for r in rules_of(rendered) if r.get("alert") == restart]
    assert "kube_pod_container_status_restarts_total" in kube["expr"]

    rules = _write_rendered(rendered, tmp_path)
    assert "SUCCESS" in run_promtool("check", "rules", rules)
    # The plain file's tests (but its restart test, which reads process_start_time_seconds) and the
    # component's own restart test, against the rendered rules.
    tests = []
    for path in [RULE_TESTS / "alerts_test.yml", *(COMPONENT / "tests").glob("*_test.yml")]:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
        doc["rule_files"] = [rules.name]
        copy = tmp_path / f"{path.parent.name}-{path.name}"
        copy.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
        tests.append(copy)
    run_promtool("test", "rules", *tests)


def test_thresholds_are_settings_of_the_component(tmp_path: Path) -> None:
    copy = tmp_path / "alerts"
    shutil.copytree(COMPONENT, copy)
    new = {key: str(100 + i) for i, key in enumerate(component_settings())}
    new["LATENCY_OBJECTIVE"] = "0.995"
    (copy / "settings.env").write_text("".join(f"{k}={v}\n" for k, v in new.items()), encoding="utf-8")
    rendered = rendered_component(copy)
    by_record = {r["record"]: r["expr"] for r in rules_of(rendered) if "record" in r}
    assert {key: by_record[record] for key, record in component_settings().items()} == new
    # The new objective moves the burn-rate thresholds with it: 10 % slow keywords now burns the
    # 0.5 % budget 20x, so the fast-burn alert fires where it stayed silent at 99 %.
    rules = _write_rendered(rendered, tmp_path)
    test = {
        "rule_files": [rules.name], "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": [
                {"series": 'kwe_end_to_end_latency_seconds_count{job="kwe"}', "values": "0+6000x60"},
                {"series": 'kwe_end_to_end_latency_seconds_bucket{job="kwe", le="0.25"}', "values": "0+5400x60"},
            ],
            "alert_rule_test": [{"eval_time": "10m", "alertname": "KweLatencySLOFastBurn", "exp_alerts": [{
                "exp_labels": {"severity": "critical", "job": "kwe"},
                "exp_annotations": next(r["annotations"] for r in rules_of(rendered)
                                        if r.get("alert") == "KweLatencySLOFastBurn") | {
                    "description": "Over the last hour and the last 5 minutes, 10% of keywords took over 250 ms "
                                   "from input to acknowledged embedding.",
                    "summary": "kwe burns its latency error budget 14.4x too fast"},
            }]}],
        }],
    }
    path = tmp_path / "objective_test.yml"
    path.write_text(yaml.safe_dump(test, sort_keys=False), encoding="utf-8")
    run_promtool("test", "rules", path)


def test_the_compose_prometheus_loads_the_rules() -> None:
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text(encoding="utf-8"))
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text(encoding="utf-8"))
    mounts = dict(v.split(":")[:2] for v in compose["services"]["prometheus"]["volumes"])
    (rule_file,) = config["rule_files"]
    (source,) = [s for s, target in mounts.items() if target == rule_file]
    assert (DEPLOY / source).resolve() == RULES


def test_an_overlay_with_the_component_renders_the_worker_and_the_rule(tmp_path: Path) -> None:
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "namespace": "kwe",
        # kustomize takes relative paths only.
        "resources": [os.path.relpath(K8S / "overlays" / "gpu", overlay)],
        "components": [os.path.relpath(K8S / "components" / "servicemonitor", overlay),
                       os.path.relpath(COMPONENT, overlay)],
    }), encoding="utf-8")
    docs = kustomize_build(overlay)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds.count("PrometheusRule") == 1 and "Deployment" in kinds and "ServiceMonitor" in kinds
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    assert rule["metadata"]["namespace"] == "kwe"
    # The local-config objects (the settings, the kube restart expression) are never applied.
    assert not [d for d in docs if d["metadata"]["name"].startswith("keyword-embedder-alert")]
