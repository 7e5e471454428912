"""deploy/k8s: the kustomize overlays, rendered with real kustomize and checked against the code.

`make tools` installs kustomize (Go module proxy) into .tools/bin; .ci/run does it before the
tests. What a render cannot show is a cluster accepting and running the objects: that was not
done here (deploy/README.md says so).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy_tools import (
    DEPLOY,
    INPUT_PARTITIONS,
    K8S,
    SETTING_ENV,
    SHUTDOWN_MARGIN_S,
    dockerfile_env,
    dockerfile_instructions,
    kustomize_build,
    settings_from_env,
)
from worker.settings.schema import Settings

OVERLAYS = ["local", "gpu"]


def _render(overlay: str) -> dict[tuple[str, str], dict[str, Any]]:
    objects: dict[tuple[str, str], dict[str, Any]] = {}
    for doc in kustomize_build(K8S / "overlays" / overlay):
        key = (doc["kind"], doc["metadata"]["name"])
        assert key not in objects, f"{overlay}: two {key}"
        objects[key] = doc
    return objects


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request: pytest.FixtureRequest) -> tuple[str, dict[tuple[str, str], dict[str, Any]]]:
    return request.param, _render(request.param)


def _one(objects: dict[tuple[str, str], dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for (k, n), o in objects.items() if k == kind and (name is None or n == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def _worker_deployment(objects: dict[tuple[str, str], dict[str, Any]]) -> dict[str, Any]:
    return _one(objects, "Deployment", "keyword-embedder")


def _pod(objects: dict[tuple[str, str], dict[str, Any]]) -> dict[str, Any]:
    return _worker_deployment(objects)["spec"]["template"]["spec"]


def _container(pod: dict[str, Any], name: str, *, init: bool = False) -> dict[str, Any]:
    (found,) = [c for c in pod.get("initContainers" if init else "containers", []) if c["name"] == name]
    return found


def _image_env(overlay: str) -> dict[str, str]:
    dockerfile = "Dockerfile.gpu" if overlay == "gpu" else "Dockerfile"
    return dockerfile_env(dockerfile_instructions(DEPLOY / "docker" / dockerfile))


def _worker_settings(overlay: str, objects: dict[tuple[str, str], dict[str, Any]]) -> Settings:
    """What the worker container starts with: image ENV < ConfigMap (envFrom) < env."""
    pod = _pod(objects)
    worker = _container(pod, "worker")
    env: dict[str, Any] = dict(_image_env(overlay))
    for ref in worker["envFrom"]:
        env.update(_one(objects, "ConfigMap", ref["configMapRef"]["name"])["data"])
    env.update({e["name"]: e["value"] for e in worker.get("env", []) if "value" in e})
    return settings_from_env(env)


def _window_s(probe: dict[str, Any]) -> int:
    return probe.get("initialDelaySeconds", 0) + probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)


# ------------------------------------------------------------------ every overlay


def test_every_kwe_variable_is_a_real_setting(rendered: tuple[str, dict[Any, Any]]) -> None:
    overlay, objects = rendered
    _worker_settings(overlay, objects)
    for (kind, _), obj in objects.items():
        if kind == "ConfigMap":
            settings_from_env(obj["data"])
        if kind == "Deployment":
            pod = obj["spec"]["template"]["spec"]
            for c in [*pod.get("initContainers", []), *pod["containers"]]:
                # Names (also of Secret-fed variables) must be settings; literal values must load.
                names = {e["name"] for e in c.get("env", [])}
                assert {n for n in names if n.startswith("KWE_")} <= SETTING_ENV, c["name"]
                settings_from_env({e["name"]: e["value"] for e in c.get("env", []) if "value" in e})


def test_the_configmap_the_pods_read_is_the_rendered_one(rendered: tuple[str, dict[Any, Any]]) -> None:
    _, objects = rendered
    names = {n for (k, n) in objects if k == "ConfigMap" and n.startswith("keyword-embedder")}
    (name,) = names
    assert re.fullmatch(r"keyword-embedder-[a-z0-9]{10}", name), "generated ConfigMaps carry a content hash"
    pod = _pod(objects)
    for c in [*pod.get("initContainers", []), *pod["containers"]]:
        for ref in c.get("envFrom", []):
            assert ref["configMapRef"]["name"] == name


def test_grace_period_exceeds_the_shutdown_deadline_with_margin(rendered: tuple[str, dict[Any, Any]]) -> None:
    overlay, objects = rendered
    pod = _pod(objects)
    settings = _worker_settings(overlay, objects)
    assert pod["terminationGracePeriodSeconds"] >= settings.shutdown_timeout_s + SHUTDOWN_MARGIN_S
    # SIGTERM starts the worker's own shutdown: no preStop hook that would eat into the grace period.
    assert all("lifecycle" not in c for c in pod["containers"])


def test_probes_hit_the_metrics_server(rendered: tuple[str, dict[Any, Any]]) -> None:
    overlay, objects = rendered
    worker = _container(_pod(objects), "worker")
    settings = _worker_settings(overlay, objects)
    ports = {p["name"]: p["containerPort"] for p in worker["ports"]}
    assert settings.metrics_port > 0 and ports["metrics"] == settings.metrics_port
    assert worker["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert worker["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert worker["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    annotations = _worker_deployment(objects)["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(settings.metrics_port)
    # /healthz turns 503 on a stalled worker: liveness must not fire before the stall check can.
    assert settings.stall_timeout_s > 0


def test_one_image_named_in_one_place(rendered: tuple[str, dict[Any, Any]]) -> None:
    overlay, objects = rendered
    kustomization = yaml.safe_load((K8S / "overlays" / overlay / "kustomization.yaml").read_text())
    (entry,) = kustomization["images"]
    image = f"{entry['newName']}:{entry['newTag']}"
    pod = _pod(objects)
    used = {c["image"] for c in [*pod.get("initContainers", []), *pod["containers"]]}
    assert used == {image}
    # The name is written nowhere else under deploy/k8s (the base and patches say "keyword-embedder").
    if entry["newName"] != "keyword-embedder":
        hits = [p for p in K8S.rglob("*") if p.is_file() and entry["newName"] in p.read_text()]
        assert hits == [K8S / "overlays" / overlay / "kustomization.yaml"]


def test_broker_address_written_in_one_place(rendered: tuple[str, dict[Any, Any]]) -> None:
    overlay, objects = rendered
    broker = _worker_settings(overlay, objects).bootstrap_servers
    # The local overlay's own Kafka necessarily names its address too (advertised listener, topic
    # Job): that is the broker's definition, not a second copy of the worker's setting.
    own_kafka = K8S / "overlays" / "local" / "kafka.yaml"
    hits = [p for p in K8S.rglob("*") if p.is_file() and p != own_kafka and broker in p.read_text()]
    assert hits == [K8S / "overlays" / overlay / "kustomization.yaml"]
    assigned = [p for p in K8S.rglob("*") if p.is_file()
                and re.search(r"KWE_BOOTSTRAP_SERVERS\s*[=:]\s*\S", p.read_text())]
    assert len(assigned) == len(OVERLAYS), assigned  # one per overlay, none in the base
    for (kind, _), obj in objects.items():
        if kind == "ScaledObject":
            for trigger in obj["spec"]["triggers"]:
                assert "bootstrapServers" not in trigger["metadata"]
                assert trigger["metadata"]["bootstrapServersFromEnv"] == "KWE_BOOTSTRAP_SERVERS"


def test_selectors_match_the_pods(rendered: tuple[str, dict[Any, Any]]) -> None:
    _, objects = rendered
    deployment = _worker_deployment(objects)
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert _one(objects, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"].items() <= labels.items()
    service = _one(objects, "Service", "keyword-embedder-metrics")
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["ports"][0]["targetPort"] == "metrics"
    # The rollout must not wait on a surge pod that can never get a partition.
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] >= 1


def test_pods_run_as_non_root_on_a_read_only_root(rendered: tuple[str, dict[Any, Any]]) -> None:
    _, objects = rendered
    pod = _pod(objects)
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 10001
    for c in [*pod.get("initContainers", []), *pod["containers"]]:
        assert c["securityContext"]["readOnlyRootFilesystem"] is True, c["name"]
    volumes = {v["name"] for v in pod["volumes"]}
    for c in [*pod.get("initContainers", []), *pod["containers"]]:
        assert {m["name"] for m in c.get("volumeMounts", [])} <= volumes, c["name"]


# ------------------------------------------------------------------ local


def test_local_overlay_brings_its_own_kafka_and_topics() -> None:
    objects = _render("local")
    settings = _worker_settings("local", objects)
    host, port = settings.bootstrap_servers.split(":")
    service = _one(objects, "Service", host)
    assert int(port) in {p["port"] for p in service["spec"]["ports"]}
    kafka = _one(objects, "Deployment", host)["spec"]["template"]["spec"]
    # A Service called "kafka" would put KAFKA_PORT=tcp://... into the pod, which the image reads
    # as a broker property.
    assert kafka["enableServiceLinks"] is False
    (broker,) = kafka["containers"]
    env = {e["name"]: e["value"] for e in broker["env"]}
    assert f"PLAINTEXT://{host}:{port}" in env["KAFKA_ADVERTISED_LISTENERS"]
    assert broker["readinessProbe"] == {"tcpSocket": {"port": "plaintext"}, "periodSeconds": 5}
    job = _one(objects, "Job", "kafka-topics")["spec"]["template"]["spec"]
    script = "\n".join(job["containers"][0]["args"])
    specs = {k: int(v) for k, v in (s.split(":") for s in re.search(r"for spec in ([^;]+);", script)[1].split())}
    assert specs[settings.input_topic] == INPUT_PARTITIONS
    assert settings.output_topic in specs and settings.dead_letter_topic in specs
    assert f"--bootstrap-server {settings.bootstrap_servers}" in script
    assert _worker_deployment(objects)["spec"]["replicas"] == 2
    assert not [k for k in objects if k[0] == "ScaledObject"], "the local overlay does not need KEDA"
    wait = _container(_pod(objects), "wait-for-topics", init=True)
    assert "KWE_INPUT_TOPIC" in wait["command"][-1] and "KWE_BOOTSTRAP_SERVERS" in wait["command"][-1]


# ------------------------------------------------------------------ gpu


def test_gpu_overlay_builds_the_plan_in_an_init_container_onto_a_required_volume() -> None:
    objects = _render("gpu")
    pod = _pod(objects)
    image_env = _image_env("gpu")
    engine_dir = str(Path(image_env["KWE_ENGINE_PATH"]).parent)
    build = _container(pod, "build-engine", init=True)
    worker = _container(pod, "worker")
    build_env = {e["name"]: e["value"] for e in build["env"]}
    worker_env = {e["name"]: e.get("value") for e in worker["env"]}
    assert build_env["ENGINE_BUILD"] == "only" and worker_env["ENGINE_BUILD"] == "never"
    # Init containers are not probed (unless they are restartable sidecars): nothing kills the build.
    assert not {"startupProbe", "livenessProbe", "readinessProbe", "restartPolicy"} & set(build)
    for c, read_only in ((build, False), (worker, True)):
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1, c["name"]
        (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == engine_dir]
        assert mount.get("readOnly", False) is read_only, c["name"]
        assert mount["name"] == "engines"
    (volume,) = [v for v in pod["volumes"] if v["name"] == "engines"]
    assert "emptyDir" in volume or "persistentVolumeClaim" in volume
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    settings = _worker_settings("gpu", objects)
    assert settings.backend == "tensorrt" and settings.profile == "gpu"
    assert settings.processes == "auto"  # several processes share the GPU (docs/operating.md, Scaling)
    # No surge: a surge pod needs a spare GPU.
    assert _worker_deployment(objects)["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0


def test_gpu_startup_windows_cover_the_plan_build_allowance() -> None:
    objects = _render("gpu")
    deployment = _worker_deployment(objects)
    pod = deployment["spec"]["template"]["spec"]
    build = _container(pod, "build-engine", init=True)
    budget = int({e["name"]: e["value"] for e in build["env"]}["ENGINE_BUILD_TIMEOUT_S"])
    kill_after = int(re.search(r"timeout --kill-after=(\d+)", (DEPLOY / "docker" / "gpu-entrypoint.sh").read_text())[1])
    worker_window = _window_s(_container(pod, "worker")["startupProbe"])
    # The rollout is reported failed after progressDeadlineSeconds without progress: it must
    # outlast the longest allowed build plus the worker's own start.
    assert deployment["spec"]["progressDeadlineSeconds"] > budget + kill_after + worker_window
    # Loading a TensorRT plan takes longer than the CPU start the base allows for.
    base = yaml.safe_load((K8S / "base" / "deployment.yaml").read_text())
    (base_worker,) = base["spec"]["template"]["spec"]["containers"]
    assert worker_window > _window_s(base_worker["startupProbe"])


def test_keda_scales_on_lag_and_scales_down_as_its_comments_say() -> None:
    objects = _render("gpu")
    scaled = _one(objects, "ScaledObject")
    deployment = _worker_deployment(objects)
    spec = scaled["spec"]
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    assert spec["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert spec["scaleTargetRef"]["envSourceContainerName"] == "worker"
    assert spec["minReplicaCount"] >= 1 and spec["maxReplicaCount"] == INPUT_PARTITIONS
    # cooldownPeriod only governs scaling to zero; with a minimum of 1 it would do nothing.
    assert "cooldownPeriod" not in spec
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    down = behavior["scaleDown"]
    assert down["stabilizationWindowSeconds"] >= 300
    assert down["selectPolicy"] == "Min"
    (policy,) = down["policies"]
    assert policy == {"type": "Pods", "value": 1, "periodSeconds": policy["periodSeconds"]}
    # One leaver at a time, and the next only after the previous one's whole grace period.
    assert policy["periodSeconds"] > deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    (trigger,) = spec["triggers"]
    meta = trigger["metadata"]
    settings = _worker_settings("gpu", objects)
    assert trigger["type"] == "kafka"
    # Read from the worker container's environment, i.e. the same ConfigMap the worker reads.
    configmap = _one(objects, "ConfigMap")["data"]
    for param, env in (("bootstrapServersFromEnv", "KWE_BOOTSTRAP_SERVERS"),
                       ("consumerGroupFromEnv", "KWE_GROUP_ID"), ("topicFromEnv", "KWE_INPUT_TOPIC")):
        assert meta[param] == env and env in configmap
    assert configmap["KWE_GROUP_ID"] == settings.group_id
    assert int(meta["lagThreshold"]) > 0
    assert meta.get("allowIdleConsumers", "false") == "false"
    comments = (K8S / "components" / "keda" / "scaledobject.yaml").read_text()
    assert f"one pod per {policy['periodSeconds'] // 60} minutes" in comments
    assert f"last {down['stabilizationWindowSeconds'] // 60} minutes" in comments


def test_partition_count_agrees_between_compose_local_kafka_and_keda() -> None:
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    script = "\n".join(compose["services"]["topic-init"]["command"])
    keda = yaml.safe_load((K8S / "components" / "keda" / "scaledobject.yaml").read_text())
    local = (K8S / "overlays" / "local" / "kafka.yaml").read_text()
    for text in (script, local):
        assert f"keywords:{keda['spec']['maxReplicaCount']}" in text


def test_servicemonitor_component_selects_the_metrics_service(tmp_path: Path) -> None:
    # An overlay of the gpu overlay that adds the optional component, as the README says to.
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(K8S / "overlays" / "gpu", tmp_path)],
        "components": [os.path.relpath(K8S / "components" / "servicemonitor", tmp_path)],
    }))
    docs = kustomize_build(tmp_path, "--load-restrictor", "LoadRestrictionsNone")
    objects = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    monitor = _one(objects, "ServiceMonitor")
    service = _one(objects, "Service", "keyword-embedder-metrics")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"


def test_overlays_are_the_only_entry_points() -> None:
    # `kubectl apply -f deploy/k8s` cannot work on kustomizations; the README says -k on an overlay.
    assert not list(K8S.glob("*.yaml"))
    for overlay in OVERLAYS:
        k = yaml.safe_load((K8S / "overlays" / overlay / "kustomization.yaml").read_text())
        assert "../../base" in k["resources"]
        assert f"kubectl apply -k deploy/k8s/overlays/{overlay}" in (DEPLOY / "README.md").read_text()
