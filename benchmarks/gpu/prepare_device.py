"""Builds .device/ for benchmarks/gpu/device_run.sh (carried to the GPU machine, 64 MiB limit).

- minilm-f16store.onnx: the plain ONNX export with every large float32 initializer stored as
  float16 plus a Cast back to float32 (computed in float32; 45 MB instead of 90 MB);
- tokenizer.json of the model;
- pylibs/: tokenizers (an abi3 wheel: any CPython >= 3.9) and tomli (pure Python), the only
  runtime pieces the device image may lack; shim/tomllib.py for a Python older than 3.11.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import onnx
import tokenizers
from onnx import TensorProto, helper, numpy_helper

from engines.onnx_export.export import ensure_onnx
from worker.core.model import default_model_dir

ROOT = Path(__file__).resolve().parents[2]
DEV = ROOT / ".device"


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


def main() -> int:
    (DEV / "pylibs").mkdir(parents=True, exist_ok=True)
    f16_store(ensure_onnx(optimize=False), DEV / "minilm-f16store.onnx")
    shutil.copy(default_model_dir() / "tokenizer.json", DEV / "tokenizer.json")
    shutil.copytree(Path(tokenizers.__file__).parent, DEV / "pylibs" / "tokenizers", dirs_exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--platform", "any", "--python-version", "3.10", "--implementation", "py", "tomli",
                        "-d", tmp], check=True)
        for whl in Path(tmp).glob("*.whl"):
            zipfile.ZipFile(whl).extractall(DEV / "pylibs")
    (DEV / "shim").mkdir(exist_ok=True)
    (DEV / "shim" / "tomllib.py").write_text("from tomli import *  # noqa: F403  (Python < 3.11 on the device)\n"
                                             "from tomli import TOMLDecodeError, load, loads  # noqa: F401\n")
    print(f"{DEV}: {sum(f.stat().st_size for f in DEV.rglob('*') if f.is_file()) / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
