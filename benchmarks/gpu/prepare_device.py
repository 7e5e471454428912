"""Builds .device/ for the GPU scripts (carried to the GPU machine, 64 MiB limit).

- model/: the default model's folder (config, modules, pooling, tokenizer, ...) with
  model.safetensors stored as float16 (45 MB instead of 90 MB): what the worker's torch backend
  (`--backend torch`, benchmarks/gpu/torch_graphs.py) and the ONNX export read there; weights are
  widened to float32 when read, so only their storage is rounded (cos >= 0.9999994 to the
  reference on the golden rows, measured on the ONNX of the same rounding);
- tokenizer.json of the model (the scripts that take a tokenizer file);
- with --onnx, minilm-f16store.onnx: the plain ONNX export with every large float32 initializer
  stored as float16 plus a Cast back to float32 (45 MB; for the TensorRT check and ONNX Runtime's
  CUDA provider; with model/ it no longer fits the limit, so it is left out by default);
- pylibs/: what the lent machine's Python (3.12, PyTorch 2.11; benchmarks/results/device/2026-12-04/
  host.txt) lacks: safetensors (an abi3 wheel), structlog and tomli (pure Python); pylibs-cp312/:
  orjson (a cp312 wheel); shim/tomllib.py for a Python older than 3.11. Its tokenizers (0.23.2) is
  used, not a copy (11 MB);
- wheels/: confluent-kafka, prometheus-client and tqdm at the pinned versions (cp312), which
  benchmarks/gpu/device_run.sh installs there for the broker-free host path.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import onnx
import safetensors
import structlog
from onnx import TensorProto, helper, numpy_helper

from engines.onnx_export.export import ensure_onnx
from worker.core.model import default_model_dir

ROOT = Path(__file__).resolve().parents[2]
DEV = ROOT / ".device"
DEVICE_PYTHON = "3.12"
# Installed from wheels there (device_run.sh): what the worker's pipeline imports and that machine
# lacks (benchmarks/results/device/2026-12-04/host.txt).
DEVICE_WHEELS = ("confluent-kafka", "prometheus-client", "tqdm")


def f16_store(src: Path, dst: Path) -> None:
    m = onnx.load(str(src))
    g = m.graph
    casts, stored = [], []
    for init in list(g.initializer):
        arr = numpy_helper.to_array(init)
        if arr.dtype == np.float32 and arr.size > 1024:
            stored.append(numpy_helper.from_array(arr.astype(np.float16), init.name + "__f16"))
            casts.append(helper.make_node("Cast", [init.name + "__f16"], [init.name], to=TensorProto.FLOAT))
            g.initializer.remove(init)
    g.initializer.extend(stored)
    nodes = list(g.node)
    del g.node[:]
    g.node.extend(casts + nodes)
    onnx.checker.check_model(m)
    onnx.save(m, str(dst))


def f16_model_folder(src: Path, dst: Path) -> None:
    """A copy of the model folder `src` whose model.safetensors stores its float32 tensors as float16."""
    from safetensors.numpy import load_file, save_file

    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model.safetensors", "*.onnx"))
    tensors = load_file(str(src / "model.safetensors"))
    save_file({k: v.astype(np.float16) if v.dtype == np.float32 else v for k, v in tensors.items()},
              str(dst / "model.safetensors"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--onnx", action="store_true", help="also write minilm-f16store.onnx (over the 64 MiB "
                                                            "limit together with model/)")
    args = parser.parse_args()
    (DEV / "pylibs").mkdir(parents=True, exist_ok=True)
    f16_model_folder(default_model_dir(), DEV / "model")
    if args.onnx:
        f16_store(ensure_onnx(optimize=False), DEV / "minilm-f16store.onnx")
    shutil.copy(default_model_dir() / "tokenizer.json", DEV / "tokenizer.json")
    for module in (safetensors, structlog):  # abi3 / pure Python: this machine's copies run there
        shutil.copytree(Path(module.__file__).parent, DEV / "pylibs" / module.__name__, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__"))
    # orjson is built per CPython version: into pylibs-cp312, which device_env.sh puts on the path only
    # for a 3.12 interpreter (this machine's own orjson must win here, e.g. in the scripts' dry runs).
    tag = "cp" + DEVICE_PYTHON.replace(".", "")
    for spec, implementation, folder in (("tomli", "py", "pylibs"), ("orjson", "cp", f"pylibs-{tag}")):
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                            "--platform", "manylinux2014_x86_64", "--platform", "any", "--python-version",
                            DEVICE_PYTHON, "--implementation", implementation, spec, "-d", tmp], check=True)
            for whl in Path(tmp).glob("*.whl"):
                zipfile.ZipFile(whl).extractall(DEV / folder)
    # The pipeline's own dependencies that machine lacks (benchmarks/host/ runs the whole pipeline
    # there, without a broker), as wheels at the versions constraints.txt pins: device_run.sh
    # installs them out of tree (confluent-kafka is 5 MB as a wheel, 15 MB unpacked).
    wheels = DEV / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    wheels.mkdir()
    pins = dict(line.split("==", 1) for line in (ROOT / "constraints.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    lower = {k.lower().replace("_", "-"): v for k, v in pins.items()}  # as PEP 503 normalises names
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", DEVICE_PYTHON, "--implementation", "cp",
                    *(f"--platform={p}" for p in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64",
                                                  "manylinux2014_x86_64", "any")),
                    *(f"{name}=={lower[name]}" for name in DEVICE_WHEELS), "-d", str(wheels)], check=True)
    (DEV / "shim").mkdir(exist_ok=True)
    (DEV / "shim" / "tomllib.py").write_text("from tomli import *  # noqa: F403  (Python < 3.11 on the device)\n"
                                             "from tomli import TOMLDecodeError, load, loads  # noqa: F401\n")
    print(f"{DEV}: {sum(f.stat().st_size for f in DEV.rglob('*') if f.is_file()) / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
