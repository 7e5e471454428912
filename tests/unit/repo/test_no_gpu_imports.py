"""The CPU install never imports tensorrt, pycuda (the optional `gpu` extra) or torch (the `torch` extra).

Each check runs in a fresh interpreter, so modules imported by other tests cannot hide an
import, and the result does not depend on whether the extras happen to be installed:
the second check installs a meta-path finder that makes every tensorrt/pycuda/torch import fail.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from tests.conftest import ROOT


# Imports every module of the worker and engines packages, runs the CLI's help paths, and
# reports what got imported. BLOCK, when true, first installs a finder that refuses the gpu extra.
SCRIPT = textwrap.dedent("""
    import contextlib, importlib, io, json, pkgutil, sys

    BLOCK = {block}
    GPU = ("tensorrt", "pycuda", "torch")

    class BlockGpu:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in GPU:
                raise ImportError(f"{{name}} is blocked by the test (no gpu extra)")
            return None

    if BLOCK:
        sys.meta_path.insert(0, BlockGpu())

    import worker, engines
    modules, failed = [], {{}}
    for pkg in (worker, engines):
        for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            try:
                importlib.import_module(info.name)
                modules.append(info.name)
            except Exception as exc:
                failed[info.name] = f"{{type(exc).__name__}}: {{exc}}"

    from worker.cli import main
    codes = {{}}
    for argv in (["--help"], ["build-engine", "--help"], ["run", "--help"]):
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            try:
                codes[" ".join(argv)] = main(argv)
            except SystemExit as exc:
                codes[" ".join(argv)] = exc.code

    extra = {{}}
    if BLOCK:
        from worker.core.errors import BackendError
        from worker.backend_choice.select import choose_backend, missing_gpu_packages
        from worker.settings.schema import Settings
        extra["missing"] = missing_gpu_packages()
        extra["auto"] = choose_backend(Settings(engine_path=sys.executable), has_gpu=lambda: True).backend
        try:
            choose_backend(Settings(backend="tensorrt", engine_path=sys.executable), has_gpu=lambda: True)
        except BackendError as exc:
            extra["tensorrt_error"] = str(exc)
        try:
            choose_backend(Settings(backend="torch"), has_gpu=lambda: True)
        except BackendError as exc:
            extra["torch_error"] = str(exc)
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            extra["build_rc"] = main(["build-engine", "--onnx", sys.executable, "--output", "/nonexistent/p.plan"])
        extra["build_err"] = err.getvalue()

    gpu_loaded = sorted(m for m in sys.modules if m.split(".")[0] in GPU)
    print(json.dumps({{"modules": modules, "failed": failed, "codes": codes, "gpu_loaded": gpu_loaded,
                      "extra": extra}}))
""")


def _run(block: bool) -> dict:
    proc = subprocess.run([sys.executable, "-c", SCRIPT.format(block=block)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_importing_everything_and_the_cli_help_never_loads_the_gpu_extra() -> None:
    result = _run(block=False)
    assert result["failed"] == {}
    # The walk really covered the GPU-facing modules, not just the package roots.
    for name in ("worker.backends.tensorrt", "worker.backends.torch_cuda", "worker.backend_choice.torch_choice",
                 "worker.backend_choice.select", "engines.build_engine", "engines.fp16_onnx",
                 "worker.commands.build_engine", "worker.cli"):
        assert name in result["modules"]
    assert result["codes"] == {"--help": 0, "build-engine --help": 0, "run --help": 0}
    assert result["gpu_loaded"] == []


def test_everything_cpu_still_works_when_the_gpu_extra_cannot_be_imported() -> None:
    result = _run(block=True)
    assert result["failed"] == {}
    assert result["codes"] == {"--help": 0, "build-engine --help": 0, "run --help": 0}
    extra = result["extra"]
    assert extra["missing"] == ["tensorrt", "pycuda"]
    assert extra["auto"] == "onnxruntime"
    assert "missing: tensorrt, pycuda" in extra["tensorrt_error"]
    assert "pip install 'keyword-embedder[gpu]'" in extra["tensorrt_error"]
    assert extra["torch_error"].startswith("backend 'torch' needs the torch extra: pip install 'keyword-embedder[torch]'")
    assert extra["build_rc"] == 2
    assert "tensorrt" in extra["build_err"] and "Traceback" not in extra["build_err"]
    assert result["gpu_loaded"] == []


def test_gpu_extra_is_optional_in_the_package_metadata() -> None:
    import tomllib

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = " ".join(meta["dependencies"]).lower()
    assert "tensorrt" not in core and "pycuda" not in core
    gpu = " ".join(meta["optional-dependencies"]["gpu"]).lower()
    assert "tensorrt" in gpu and "pycuda" in gpu
    assert "torch" not in core and meta["optional-dependencies"]["torch"][0].startswith("torch>=")
    assert json.dumps(meta["scripts"]) == '{"keyword-embedder": "worker.cli:main"}'
