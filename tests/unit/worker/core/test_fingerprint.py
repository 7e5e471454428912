"""The model fingerprint (worker/core/fingerprint.py): equal for the same model and settings on every
folder, process and backend; different when anything that changes a vector changes, one test per
input. Written once per start: the codec's header and field are constants.

Runs on the tiny fixture models of tests/data/pipelines (copied, so each test may edit a file), and
once on the installed default model; about 3 s.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import orjson
import pytest

from worker.formats.codec_choice import output_codec
from worker.core import fingerprint as fp
from worker.core.fingerprint import FINGERPRINT_VERSION, VectorSettings, model_fingerprint
from worker.core.model import ModelInfo, Prompt, default_model_dir
from worker.families.dense import pipeline_folder
from worker.formats.messages import H_FINGERPRINT
from worker.settings.schema import Settings
from tests.conftest import DATA

DENSE = "distilbert-mean-dense-tanh"  # a pipeline with a Dense layer: config and weights of its own
PATTERN = re.compile(rf"^v{FINGERPRINT_VERSION}-[0-9a-f]{{16}}$")


def _model(tmp_path: Path, name: str = DENSE) -> Path:
    """A real (not linked) copy of a fixture model folder, free to edit."""
    linked = pipeline_folder(DATA / "pipelines" / name, tmp_path / "linked", families=DATA / "families")
    folder = tmp_path / "model"
    shutil.copytree(linked, folder, symlinks=False)
    return folder


def _fp(folder: Path, settings: VectorSettings = VectorSettings()) -> str:
    return model_fingerprint(ModelInfo.from_dir(folder), settings).value


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def _edit_json(path: Path, **changes: object) -> None:
    obj = json.loads(path.read_text())
    obj.update(changes)
    path.write_text(json.dumps(obj))


def test_the_value_is_short_versioned_and_stable_across_folders(tmp_path: Path) -> None:
    a = _model(tmp_path / "a")
    b = _model(tmp_path / "b")
    assert PATTERN.match(_fp(a)), _fp(a)
    # Another folder (another machine's path) with the same files: the same fingerprint.
    assert _fp(a) == _fp(b)
    inputs = model_fingerprint(ModelInfo.from_dir(a)).inputs
    names = [name for name, _ in inputs["files"]]
    assert names == sorted(names) and {"config.json", "model.safetensors", "tokenizer.json", "modules.json",
                                        "1_Pooling/config.json", "2_Dense/config.json",
                                        "2_Dense/model.safetensors"} <= set(names)
    assert str(a) not in json.dumps(inputs)  # no path in what is hashed


def test_the_same_in_another_process(tmp_path: Path) -> None:
    folder = _model(tmp_path)
    code = ("import sys; from worker.core.fingerprint import model_fingerprint; "
            "from worker.core.model import ModelInfo; print(model_fingerprint(ModelInfo.from_dir(sys.argv[1])))")
    out = subprocess.run([sys.executable, "-c", code, str(folder)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == _fp(folder)


def test_not_the_backend_nor_its_precision(tmp_path: Path) -> None:
    info = ModelInfo.from_dir(_model(tmp_path))
    values = {output_codec(Settings(**kw), info, Prompt()).fingerprint  # type: ignore[arg-type]
              for kw in ({}, {"backend": "onnxruntime", "precision": "int8"},
                         {"backend": "openvino", "openvino_precision": "bf16"}, {"backend": "tensorrt"},
                         {"dispatchers": 1, "intra_op_threads": 3, "cache_bytes": 0})}
    assert len(values) == 1, values


@pytest.mark.parametrize("file", ["model.safetensors", "config.json", "tokenizer.json", "2_Dense/model.safetensors",
                                  "2_Dense/config.json", "1_Pooling/config.json", "modules.json"])
def test_each_model_file_changes_it(tmp_path: Path, file: str) -> None:
    folder = _model(tmp_path)
    before = _fp(folder)
    path = folder / file
    if file.endswith(".safetensors"):
        _flip_last_byte(path)  # a weight's last bits: same shapes, another model
    else:
        path.write_text(path.read_text() + "\n")  # the same JSON, other bytes: content is what counts
    fp._file_sha256.cache_clear()  # a rewrite within one mtime tick must not hide behind the cache
    assert _fp(folder) != before


def test_the_pipeline_modules_change_it(tmp_path: Path) -> None:
    folder = _model(tmp_path)
    before = _fp(folder)
    _edit_json(folder / "1_Pooling" / "config.json", pooling_mode_mean_tokens=False, pooling_mode_cls_token=True)
    assert _fp(folder) != before


def test_normalisation_changes_it(tmp_path: Path) -> None:
    folder = _model(tmp_path, "bert-cls-normalize")
    info = ModelInfo.from_dir(folder)
    assert info.normalized
    before = model_fingerprint(info)
    modules = json.loads((folder / "modules.json").read_text())
    (folder / "modules.json").write_text(json.dumps([m for m in modules if not m["type"].endswith("Normalize")]))
    after = model_fingerprint(ModelInfo.from_dir(folder))
    assert after.inputs["normalized"] is False and before.inputs["normalized"] is True
    assert after.value != before.value


def test_the_token_limit_changes_it(tmp_path: Path) -> None:
    folder = _model(tmp_path)
    before = model_fingerprint(ModelInfo.from_dir(folder))
    _edit_json(folder / "sentence_bert_config.json", max_seq_length=before.inputs["max_seq_length"] - 1)
    assert _fp(folder) != before.value


@pytest.mark.parametrize("changed", [
    VectorSettings(prompt="query: "),
    VectorSettings(truncate_dim=8),
    VectorSettings(encoding="base64-f16"),
    VectorSettings(encoding="binary"),
    VectorSettings(encoding="int8", int8_range=(-0.3, 0.3)),
], ids=["prompt", "truncate_dim", "encoding", "binary", "int8"])
def test_each_vector_setting_changes_it(tmp_path: Path, changed: VectorSettings) -> None:
    folder = _model(tmp_path)
    assert _fp(folder, changed) != _fp(folder)


def test_the_int8_range_changes_it_and_truncating_to_the_full_width_does_not(tmp_path: Path) -> None:
    folder = _model(tmp_path)
    info = ModelInfo.from_dir(folder)
    assert _fp(folder, VectorSettings(encoding="int8", int8_range=(-0.3, 0.3))) != \
        _fp(folder, VectorSettings(encoding="int8", int8_range=(-0.31, 0.31)))
    # truncate_dim equal to the model's width writes the same vectors as none.
    assert _fp(folder, VectorSettings(truncate_dim=info.dim)) == _fp(folder)


def test_the_worker_settings_reach_it_through_the_codec() -> None:
    info = ModelInfo.from_dir(default_model_dir())
    base = output_codec(Settings(), info, Prompt()).fingerprint
    assert PATTERN.match(base)
    assert output_codec(Settings(), info, Prompt()).fingerprint == base
    assert output_codec(Settings(prompt="query: "), info, Prompt("query: ")).fingerprint != base
    assert output_codec(Settings(truncate_dim=128), info, Prompt()).fingerprint != base
    assert output_codec(Settings(output_encoding="int8"), info, Prompt()).fingerprint != \
        output_codec(Settings(output_encoding="int8", int8_range=0.5), info, Prompt()).fingerprint
    # What `keyword-embedder models` prints for the folder is what a default worker writes.
    from worker.commands.models import fingerprint

    assert fingerprint(info) == base


def test_the_codec_writes_it_as_a_constant(monkeypatch: pytest.MonkeyPatch) -> None:
    info = ModelInfo.from_dir(default_model_dir())
    codec = output_codec(Settings(), info, Prompt())
    dropped = output_codec(Settings(output_fields=("-fingerprint",)), info, Prompt())
    # After start nothing is hashed again: a record costs no fingerprint work.
    monkeypatch.setattr(fp, "model_fingerprint", lambda *a, **k: pytest.fail("hashed per record"))
    monkeypatch.setattr(fp, "_file_sha256", lambda *a, **k: pytest.fail("hashed per record"))
    row = np.full(384, 1 / np.sqrt(384), np.float32)
    obj = orjson.loads(codec.value("q", row, 3, False))
    assert obj["fingerprint"] == codec.fingerprint
    assert dict(codec.headers)[H_FINGERPRINT] == codec.fingerprint.encode()
    assert codec.record("q", row, 3, False)["fingerprint"] == codec.fingerprint  # the registry formats' record
    # output_fields can drop or rename it like any field.
    assert "fingerprint" not in orjson.loads(dropped.value("q", row, 3, False))


def test_metrics_state_it_with_the_precision_beside_it() -> None:
    from worker.operations.metrics import Metrics

    metrics = Metrics()
    metrics.set_model_info("v1-0123456789abcdef", "all-MiniLM-L6-v2", precision="bf16", encoding="float-list",
                           dim="384")
    line = next(x for x in metrics.render().decode().splitlines() if x.startswith("kwe_model_info{"))
    assert line.endswith(" 1.0") and 'fingerprint="v1-0123456789abcdef"' in line and 'precision="bf16"' in line


def test_the_offline_embedder_states_the_fingerprint_a_worker_with_its_settings_writes() -> None:
    from worker.embedder import Embedder

    info = ModelInfo.from_dir(default_model_dir())
    with Embedder(backend="onnxruntime", cache_bytes=0) as plain:
        assert plain.fingerprint() == output_codec(Settings(), info, Prompt()).fingerprint
        assert plain.fingerprint("int8") == output_codec(Settings(output_encoding="int8"), info, Prompt()).fingerprint
    with Embedder(backend="onnxruntime", cache_bytes=0, truncate_dim=128, prompt="query: ") as short:
        assert short.fingerprint() == output_codec(Settings(truncate_dim=128, prompt="query: "), info,
                                                   Prompt("query: ")).fingerprint
