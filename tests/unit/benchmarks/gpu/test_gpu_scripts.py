"""The logic of the GPU scripts in benchmarks/gpu/ (the scripts themselves need a GPU).

The TensorRT first-run check (trt_check.py) runs on the fake tensorrt/pycuda of
tests/fakes/gpu.py, whose plans compute through ONNX Runtime: in process, with a failure
injected in every stage, and as the whole shell script (trt_check.sh) in a subprocess with the
fakes installed as importable packages. That shows the script's flow, its deadlines and its
JSON; it cannot show that real TensorRT accepts the plan or how fast it is (docs/gpu.md).
The CUDA-graphs benchmark runs the worker's torch backend (tests/unit/worker/backends/test_torch_cuda.py tests it on a
numpy fake of torch); the one test here that needs real torch and a GPU skips (with its reason)
where torch or CUDA is missing.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from worker.core.profiles import load_profile
from tests.conftest import ROOT
from tests.fakes.gpu import FakeTrt, install_fakes

STAGES = ["setup", "build", "load", "buckets", "parity", "bench", "mono"]
# The `gpu` profile's bounds (so every length class is checked) with small batches, and a small
# one-bucket plan: the fake plans run ONNX Runtime on two shared cores.
SMALL_PROFILES = """
[profiles.gpu]
align = 8
token_budget = 512
pad_to = "bucket"
buckets = [
  { max_len = 8, max_batch = 16, opt_batch = 16 },
  { max_len = 16, max_batch = 8, opt_batch = 8 },
  { max_len = 32, max_batch = 8, opt_batch = 8 },
  { max_len = 64, max_batch = 4, opt_batch = 4 },
  { max_len = 256, max_batch = 2, opt_batch = 2 },
]

[profiles.mono]
align = 8
token_budget = 4096
pad_to = "bucket"
buckets = [{ max_len = 256, max_batch = 16, opt_batch = 16 }]
"""


def test_the_graphs_script_pairs_every_configuration() -> None:
    from benchmarks.gpu.torch_graphs import config_names, ratio_pairs, render

    names = config_names()
    assert names == ["mono-eager", "gpu-eager", "cpu-eager", "mono-graphs", "gpu-graphs", "cpu-graphs"]
    pairs = ratio_pairs()
    assert ("gpu-graphs", "mono-graphs") in pairs and ("cpu-eager", "mono-eager") in pairs
    assert ("mono-graphs", "mono-eager") in pairs and all(a in names and b in names for a, b in pairs)
    q = {"median": 2.0, "q1": 1.5, "q3": 2.5}
    md = render({"n": 10, "rounds": 1, "device": "x",
                 "bench": {"keywords_per_s": {n: q for n in names}, "ratios": {f"{a}/{b}": q for a, b in pairs}}})
    assert "| gpu-graphs/mono-graphs | 2.00 (1.50-2.50) |" in md


def test_graphs_mode_matches_eager_on_a_gpu() -> None:
    """The worker's torch backend (what torch_graphs.py runs) on a real GPU; tests/unit/worker/backends/test_torch_cuda.py runs it
    on the numpy fake of torch everywhere else."""
    torch = pytest.importorskip("torch", reason="torch is not installed here (the torch extra, for GPU hosts)")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: the graphs mode captures CUDA graphs")
    from worker.backends.torch_cuda import TorchCudaBackend
    from worker.core.model import ModelInfo, default_model_dir

    info = ModelInfo.from_dir(default_model_dir())
    gpu = load_profile("gpu")
    eager, graphs = TorchCudaBackend(info, gpu, graphs=False), TorchCudaBackend(info, gpu)
    rng = np.random.default_rng(0)
    ids = rng.integers(1000, 30000, size=(5, 12))
    mask = np.ones_like(ids)
    mask[1, 6:] = 0
    contexts = [b.create_context(1) for b in (eager, graphs)]  # bucket 1: lengths 9-16
    np.testing.assert_allclose(contexts[1].run(ids, mask), contexts[0].run(ids, mask), atol=2e-3)
    for ctx, backend in zip(contexts, (eager, graphs)):
        ctx.close()
        backend.close()


# ============================================================================ trt_check.py on the fakes
@pytest.fixture(scope="module")
def plain_onnx(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engines.onnx_export.export import ensure_onnx

    return ensure_onnx(cache_dir=tmp_path_factory.mktemp("kwe-cache") / "onnx", optimize=False)


@pytest.fixture()
def small_profiles(tmp_path: Path) -> Path:
    path = tmp_path / "profiles.toml"
    path.write_text(SMALL_PROFILES)
    return path


@pytest.fixture()
def computing_gpu(monkeypatch: pytest.MonkeyPatch) -> FakeTrt:
    """Fake tensorrt/pycuda whose plans compute the ONNX file they were built from."""
    return install_fakes(monkeypatch, compute="onnxruntime")


def _read(out: Path, name: str = "check") -> dict[str, Any]:
    return json.loads((out / f"trt-{name}.json").read_text())


def _raise(stage: str) -> Any:
    def fail(*_a: Any, **_k: Any) -> Any:
        raise RuntimeError(f"injected failure in {stage}")
    return fail


# How each stage is made to fail, the stages that then cannot run, and those that fail too.
INJECT = {
    "setup": ({"env": "KWE_MODEL_DIR"}, ["build", "load", "buckets", "parity", "bench", "mono"], []),
    "build": ({"fake": "fail_build"}, ["load", "buckets", "parity", "bench", "mono"], []),
    "load": ({"fake": "fail_deserialize"}, ["buckets", "parity", "bench", "mono"], []),
    # NaN out of the 33-64 profile: parity's long rows run there too.
    "buckets": ({"fake": "nan_profiles"}, [], ["parity"]),
    "parity": ({"patch": "benchmarks.gpu.trt_check.embed_through_bucketer"}, [], []),
    "bench": ({"patch": "worker.benchmark.suite.run_benchmark"}, [], []),
    "mono": ({"patch": "benchmarks.gpu.trt_check.paired_bucketed"}, [], []),
}


def test_trt_check_passes_every_stage_on_plans_that_compute(
        tmp_path: Path, computing_gpu: FakeTrt, plain_onnx: Path, small_profiles: Path) -> None:
    from benchmarks.gpu import trt_check

    out = tmp_path / "out"
    rc = trt_check.main(out, onnx=plain_onnx, limit=200, rounds=2, profiles_file=small_profiles)
    summary = _read(out)
    assert rc == 0 and summary["ok"] and summary["complete"] and summary["first_failure"] is None
    assert list(summary["stages"]) == STAGES
    assert all(s["status"] == "ok" and s["deadline_s"] > 0 for s in summary["stages"].values())
    buckets = _read(out, "buckets")["buckets"]
    assert [b["shape"] for b in buckets] == [[16, 8], [8, 16], [8, 32], [4, 64], [2, 256]]
    # Every length class is checked against ONNX Runtime, the long ones included, each up to its bound.
    assert [b["tokens"][1] for b in buckets] == [8, 16, 32, 64, 256]
    assert buckets[3]["tokens"][0] >= 33 and buckets[4]["tokens"][0] >= 65
    assert all(b["ok"] and b["norms_match"] and b["min_cosine_vs_onnxruntime"] > 0.9999 for b in buckets)
    parity = _read(out, "parity")
    assert parity["long_rows"] == 16 and parity["rows"] == parity["golden_rows"] + 16
    assert parity["min_cosine_long_rows_vs_onnxruntime"] > 0.9999 and parity["min_cosine_vs_reference"] > 0.999
    assert set(_read(out, "bench")["ratios"]) >= {"bucketed/monolithic", "bucketed/sorted"}
    mono = _read(out, "mono")
    assert set(mono["ratios"]) == {"bucketed/monolithic"} and mono["rounds_run"] == 2
    cuda = computing_gpu.cuda
    assert cuda.memory == {} and cuda.host_live == set() and cuda.stack() == []


@pytest.mark.parametrize("stage", list(INJECT))
def test_a_failure_in_any_stage_is_recorded_with_its_stage(
        stage: str, tmp_path: Path, computing_gpu: FakeTrt, plain_onnx: Path, small_profiles: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks.gpu import trt_check

    how, blocked, also_failed = INJECT[stage]
    onnx: Path | None = plain_onnx
    if "env" in how:  # a model folder without a model: the export fails
        monkeypatch.setenv(how["env"], str(tmp_path / "no-model"))
        onnx = None
    elif how.get("fake") == "nan_profiles":
        computing_gpu.nan_profiles.add(3)
    elif "fake" in how:
        setattr(computing_gpu, how["fake"], True)
    else:
        monkeypatch.setattr(how["patch"], _raise(stage))
    out = tmp_path / "out"
    rc = trt_check.main(out, onnx=onnx, limit=60, rounds=1, profiles_file=small_profiles)
    summary = _read(out)
    assert rc == 1 and summary["ok"] is False
    assert summary["first_failure"]["stage"] == stage and summary["first_failure"]["message"]
    assert summary["stages"][stage]["status"] == "failed"
    for name in blocked:  # what needed the failed stage says so instead of failing again
        assert summary["stages"][name]["status"] == "not_run"
        assert summary["stages"][name]["message"].endswith("which did not pass")
    # The stages that do not depend on the failed one still ran.
    later = STAGES[STAGES.index(stage) + 1:]
    assert all(summary["stages"][n]["status"] == "ok" for n in later if n not in blocked + also_failed), \
        summary["stages"]
    assert all(summary["stages"][n]["status"] == "failed" for n in also_failed)
    detail = _read(out, stage)
    if stage == "buckets":  # a check that failed, not an exception: the JSON says which bucket and why
        bad = [b for b in detail["buckets"] if not b["ok"]]
        assert [b["bucket"] for b in bad] == [3] and bad[0]["finite"] is False
        assert "bucket(s) [3] failed" in summary["stages"][stage]["message"]
    else:
        err = detail["error"]
        assert err["stage"] == stage and err["message"] and "Traceback" in err["traceback"]
    assert computing_gpu.cuda.memory == {} and computing_gpu.cuda.stack() == []


def test_a_stage_past_its_deadline_ends_the_run_with_the_json_written(tmp_path: Path) -> None:
    from benchmarks.gpu.trt_check import DEADLINE_EXIT, Stage, Stages

    exited: list[int] = []
    ended = threading.Event()

    def stuck(_deadline: float) -> dict[str, Any]:
        ended.wait(10)  # a TensorRT build that does not return in time
        return {"ok": True}

    def exit_(code: int) -> None:
        exited.append(code)
        ended.set()

    stages = Stages(tmp_path, 30, exit=exit_)
    ran: list[str] = []
    summary = stages.run_all([Stage("a", lambda d: ran.append("a") or {"ok": True}, 5),
                              Stage("b", stuck, 0.3, needs=("a",)),
                              Stage("c", lambda d: ran.append("c") or {}, 5)])
    assert exited == [DEADLINE_EXIT] and ran == ["a"]
    on_disk = json.loads((tmp_path / "trt-check.json").read_text())
    assert on_disk == summary and on_disk["ok"] is False and on_disk["complete"] is False
    assert on_disk["first_failure"]["stage"] == "b" and on_disk["first_failure"]["status"] == "timed_out"
    assert [on_disk["stages"][n]["status"] for n in "abc"] == ["ok", "timed_out", "not_run"]
    detail = json.loads((tmp_path / "trt-b.json").read_text())["error"]
    assert detail["type"] == "Deadline" and "stuck" in detail["traceback"]  # where it was stuck


def test_a_stage_without_enough_budget_is_skipped_and_says_so(tmp_path: Path) -> None:
    from benchmarks.gpu.trt_check import Stage, Stages

    clock = [0.0]
    stages = Stages(tmp_path, 100, clock=lambda: clock[0])

    def slow(_deadline: float) -> dict[str, Any]:
        clock[0] += 70
        return {"ok": True}

    summary = stages.run_all([Stage("a", slow, 200, reserve_s=20), Stage("b", lambda d: {}, 60, min_s=45)])
    # a's deadline leaves the 20 s it reserves for what follows
    assert summary["stages"]["a"] == {"status": "ok", "deadline_s": 80, "seconds": 70.0}
    assert summary["stages"]["b"]["status"] == "skipped" and "30 s of the budget left" in summary["stages"]["b"]["message"]
    assert summary["ok"] is False and summary["first_failure"] is None


def test_long_rows_reach_every_length_class_with_real_word_pieces() -> None:
    from benchmarks.gpu.trt_check import bucket_batches, long_rows

    pool = [np.array([101, *range(1000 + k, 1000 + k + n), 102]) for k, n in enumerate([1, 3, 5, 2, 9, 4] * 20)]
    rows = long_rows(pool, 65, 256, 8)
    assert len(rows) == 8 and len(rows[0]) == 256 and all(65 <= len(r) <= 256 for r in rows)
    assert all(r[0] == 101 and r[-1] == 102 and 101 not in r[1:-1] and 102 not in r[1:-1] for r in rows)
    gpu = load_profile("gpu")
    batches = bucket_batches(gpu, pool)
    assert [len(b) for b in batches] == [b.max_batch for b in gpu.buckets]
    lo = 1
    for b, rows in zip(gpu.buckets, batches):
        assert all(lo <= len(r) <= b.max_len for r in rows) and max(map(len, rows)) <= b.max_len
        lo = b.max_len + 1


# ============================================================================ trt_check.sh on the fakes, in a subprocess
def _dry_run(tmp_path: Path, plain_onnx: Path, small_profiles: Path, **env: str) -> tuple[int, str, dict[str, Any]]:
    out = tmp_path / "out"
    full = {**os.environ, "OUT": str(out), "TRT_CHECK_ONNX": str(plain_onnx), "TRT_CHECK_LIMIT": "60",
            "TRT_CHECK_ROUNDS": "1", "TRT_CHECK_PROFILES": str(small_profiles),
            # The fake tensorrt and pycuda packages first on the path: device_env.sh then picks this
            # interpreter, as it would pick the one that has the real ones.
            "PYTHONPATH": f"{ROOT / 'tests' / 'fakes' / 'gpu_modules'}:{ROOT}", **env}
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu" / "trt_check.sh")], env=full, cwd=tmp_path,
                          capture_output=True, text=True, timeout=400)
    return proc.returncode, proc.stdout + proc.stderr, json.loads((out / "trt-check.json").read_text())


@pytest.mark.parametrize("version", ["10.3.0", "11.1.0"])
def test_dry_run_of_the_shell_script_passes_on_the_fakes(tmp_path: Path, plain_onnx: Path,
                                                          small_profiles: Path, version: str) -> None:
    """As on a GPU machine without the model package: the carried export and tokenizer.json, no model
    folder; on TensorRT 10's API and on 11's (no weak typing, no v1 memory sizes)."""
    from worker.core.model import default_model_dir

    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_bytes((default_model_dir() / "tokenizer.json").read_bytes())
    rc, log, summary = _dry_run(tmp_path, plain_onnx, small_profiles, TRT_CHECK_TOKENIZER=str(tokenizer),
                                KWE_MODEL_DIR=str(tmp_path / "no-model-here"), FAKE_TRT_VERSION=version)
    assert rc == 0, log[-3000:]
    assert summary["ok"] and list(summary["stages"]) == STAGES
    assert (tmp_path / "out" / "trt-check.log").read_text().count("== ") == len(STAGES)
    env = json.loads((tmp_path / "out" / "trt-setup.json").read_text())["environment"]
    assert env["tensorrt"] == version and env["gpu"] == "NVIDIA L40S (sm 8.9)"  # the fakes, as the JSON says
    # The fp16 plan was parsed from the fp16 graph (the fake plan computes it in ONNX Runtime) and still
    # passed the buckets and parity stages (cos >= 0.999 against the fp32 graph).
    build = json.loads((tmp_path / "out" / "trt-build.json").read_text())
    assert build["sidecar"]["extra"]["fp16_onnx"].endswith(".plan.fp16.onnx"), build


@pytest.mark.parametrize("fail,stage,code", [("build", "build", 1), ("nan-profile-4", "buckets", 1)])
def test_dry_run_of_the_shell_script_names_the_failed_stage(
        tmp_path: Path, plain_onnx: Path, small_profiles: Path, fail: str, stage: str, code: int) -> None:
    rc, log, summary = _dry_run(tmp_path, plain_onnx, small_profiles, FAKE_TRT_FAIL=fail)
    assert rc == code, log[-3000:]
    assert summary["first_failure"]["stage"] == stage and summary["stages"][stage]["status"] == "failed"


def test_dry_run_of_a_stage_past_its_deadline_still_writes_the_json(
        tmp_path: Path, plain_onnx: Path, small_profiles: Path) -> None:
    """A plan that takes two minutes to load: the watchdog ends the run at the load's 20 s, JSON written."""
    t0 = time.monotonic()
    rc, log, summary = _dry_run(tmp_path, plain_onnx, small_profiles, FAKE_TRT_DESERIALIZE_SLEEP_S="120")
    assert rc == 3, log[-3000:]
    assert time.monotonic() - t0 < 100  # ended by the watchdog, not by the fake or the wrapper
    assert summary["first_failure"]["stage"] == "load" and summary["stages"]["load"]["status"] == "timed_out"
    assert summary["stages"]["load"]["deadline_s"] == 20
    assert [summary["stages"][n]["status"] for n in STAGES[:2]] == ["ok", "ok"]
    assert all(summary["stages"][n]["status"] == "not_run" for n in STAGES[3:])
    stacks = json.loads((tmp_path / "out" / "trt-load.json").read_text())["error"]["traceback"]
    assert "deserialize_cuda_engine" in stacks  # where it was stuck


# ============================================================================ device_run.sh on the fakes, in a subprocess
FAKE_NVIDIA_SMI = """#!/usr/bin/env bash
# nvidia-smi as device_run.sh calls it: the sampler (-lms) prints a CSV row every 0.1 s; anything else, a name.
case " $* " in
  *" -lms "*) while true; do printf '%s.%03d, 37, 1024\\n' "$(date '+%Y/%m/%d %H:%M:%S')" 0; sleep 0.1; done;;
  *) echo "name, driver_version, memory.total [MiB]"; echo "NVIDIA H200 (fake), 580.0, 143771 MiB";;
esac
"""


def test_dry_run_of_the_device_run_on_the_fake_torch(tmp_path: Path) -> None:
    """The one prepared GPU run, end to end on the numpy fake of torch and a fake nvidia-smi, with the
    tiny BERT fixture and small profiles so it takes seconds: every stage runs and writes its files
    (the CUDA-graphs comparison is left to the GPU: it runs the shipped profiles)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(FAKE_NVIDIA_SMI)
    (bin_dir / "nvidia-smi").chmod(0o755)
    profiles = tmp_path / "profiles.toml"
    profiles.write_text(SMALL_PROFILES)
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PATH": f"{bin_dir}:{os.environ['PATH']}",
           "PYTHONPATH": f"{ROOT / 'tests' / 'fakes' / 'gpu_modules'}:{ROOT}",
           "KWE_MODEL_DIR": str(ROOT / "tests" / "data" / "families" / "bert"), "KWE_PROFILES_FILE": str(profiles),
           "KWE_CACHE_DIR": str(tmp_path / "cache"), "DEVICE_SKIP": "torch-graphs", "DEVICE_HOST_PROCESSES": "1 2",
           "DEVICE_HOST_ROUNDS": "1", "DEVICE_HOST_N": "120", "DEVICE_HOST_WARMUP": "40", "DEVICE_HOST_WARMUP_S": "0",
           "DEVICE_DRY_RUN": "1", "DEVICE_SHAPE_CALLS": "2"}
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu" / "device_run.sh")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=400)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    opened = json.loads((out / "open.json").read_text())
    assert opened["profile"] == "gpu" and opened["precision"] in ("fp16", "bf16", "fp32"), opened
    parity = json.loads((out / "parity.json").read_text())
    # The tiny model is no MiniLM: against its own fp32 ONNX export, as the gate is.
    assert parity["rows"] == 224 and parity["passed"] and "ONNX Runtime" in parity["reference"], parity
    shapes = json.loads((out / "shapes.json").read_text())["shapes"]
    assert [(s["batch"], s["len"]) for s in shapes][:4] == [(16, 8), (8, 16), (8, 32), (4, 64)]
    assert shapes[-1]["batch"] == 2 and all(s["ms"] > 0 and s["rows_per_s"] > 0 for s in shapes)
    host = json.loads((out / "host-path.json").read_text())
    assert set(host["sides"]) == {"new-p1", "new-p2", "new-p1-held", "new-p2-held", "new-p1-off", "new-p2-off"} \
        and host["backend"] == "torch"
    assert {"p1 held/default keywords_per_s", "p2 default/off keywords_per_s"} <= host["ratios"].keys()
    assert all(s["keywords_per_s"]["median"] > 0 for s in host["sides"].values())
    summary = (out / "summary.md").read_text()
    for stage in ("open", "parity", "shapes", "host-path"):
        assert f"| {stage} |" in summary, summary
    assert "37%" in summary, "the sampler's utilisation is attributed to the stages"
