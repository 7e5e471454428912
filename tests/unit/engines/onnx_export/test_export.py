"""The torch-free exporter: graph contract, other BERT shapes against a numpy BERT, torch absent, cache."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from safetensors.numpy import save_file

from engines.onnx_export import export as ex
from engines.onnx_export.graph import ExportError
from tests.conftest import ROOT



# ---------------------------------------------------------------- a tiny random BERT folder

TINY = {"hidden_size": 48, "num_attention_heads": 3, "num_hidden_layers": 2, "intermediate_size": 80,
        "vocab_size": 60, "max_position_embeddings": 40, "type_vocab_size": 2, "layer_norm_eps": 1e-12,
        "hidden_act": "gelu", "model_type": "bert", "position_embedding_type": "absolute"}


def tiny_weights(seed: int, cfg: dict = TINY, prefix: str = "") -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    h, i = cfg["hidden_size"], cfg["intermediate_size"]

    def r(*shape: int, scale: float = 0.2) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    w = {"embeddings.word_embeddings.weight": r(cfg["vocab_size"], h, scale=1.0),
         "embeddings.position_embeddings.weight": r(cfg["max_position_embeddings"], h, scale=1.0),
         "embeddings.token_type_embeddings.weight": r(cfg["type_vocab_size"], h, scale=1.0),
         "embeddings.LayerNorm.weight": 1 + r(h), "embeddings.LayerNorm.bias": r(h)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"encoder.layer.{n}"
        for name in ("query", "key", "value"):
            w[f"{p}.attention.self.{name}.weight"], w[f"{p}.attention.self.{name}.bias"] = r(h, h), r(h)
        w[f"{p}.attention.output.dense.weight"], w[f"{p}.attention.output.dense.bias"] = r(h, h), r(h)
        w[f"{p}.attention.output.LayerNorm.weight"], w[f"{p}.attention.output.LayerNorm.bias"] = 1 + r(h), r(h)
        w[f"{p}.intermediate.dense.weight"], w[f"{p}.intermediate.dense.bias"] = r(i, h), r(i)
        w[f"{p}.output.dense.weight"], w[f"{p}.output.dense.bias"] = r(h, i), r(h)
        w[f"{p}.output.LayerNorm.weight"], w[f"{p}.output.LayerNorm.bias"] = 1 + r(h), r(h)
    return {prefix + k: v for k, v in w.items()}


def make_tiny_bert(folder: Path, *, seed: int = 0, pooling: str = "mean", prefix: str = "") -> Path:
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordPiece

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(TINY))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 32}))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": TINY["hidden_size"],
        "pooling_mode_mean_tokens": pooling == "mean", "pooling_mode_cls_token": pooling == "cls"}))
    save_file(tiny_weights(seed, prefix=prefix), str(folder / "model.safetensors"))
    vocab = {t: n for n, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]"] + list("abcdefghijklmnopqrstuvwxyz"))}
    tok = Tokenizer(WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok.decoder = decoders.WordPiece()
    tok.save(str(folder / "tokenizer.json"))
    return folder


# ---------------------------------------------------------------- numpy reference BERT


def _ln(x: np.ndarray, g: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * g + b


_erf = np.vectorize(math.erf)


def reference_bert(w: dict[str, np.ndarray], cfg: dict, ids: np.ndarray, mask: np.ndarray, pooling: str) -> np.ndarray:
    """HF BertModel forward + sentence-transformers pooling + Normalize, in float64 numpy."""
    w = {k: v.astype(np.float64) for k, v in w.items()}
    b, s = ids.shape
    h, heads, eps = cfg["hidden_size"], cfg["num_attention_heads"], cfg["layer_norm_eps"]
    hs = h // heads
    x = (w["embeddings.word_embeddings.weight"][ids] + w["embeddings.position_embeddings.weight"][:s][None]
         + w["embeddings.token_type_embeddings.weight"][0])
    x = _ln(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], eps)
    bias = (1.0 - mask[:, None, None, :]) * -10000.0
    for n in range(cfg["num_hidden_layers"]):
        p = f"encoder.layer.{n}"

        def lin(t: np.ndarray, name: str) -> np.ndarray:
            return t @ w[f"{name}.weight"].T + w[f"{name}.bias"]

        def split(t: np.ndarray) -> np.ndarray:
            return t.reshape(b, s, heads, hs).transpose(0, 2, 1, 3)

        q, k, v = (split(lin(x, f"{p}.attention.self.{m}")) for m in ("query", "key", "value"))
        scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(hs) + bias
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        ctx = (probs @ v).transpose(0, 2, 1, 3).reshape(b, s, h)
        x = _ln(lin(ctx, f"{p}.attention.output.dense") + x,
                w[f"{p}.attention.output.LayerNorm.weight"], w[f"{p}.attention.output.LayerNorm.bias"], eps)
        inter = lin(x, f"{p}.intermediate.dense")
        inter = inter * 0.5 * (1.0 + _erf(inter / math.sqrt(2.0)))
        x = _ln(lin(inter, f"{p}.output.dense") + x,
                w[f"{p}.output.LayerNorm.weight"], w[f"{p}.output.LayerNorm.bias"], eps)
    if pooling == "mean":
        m = mask[:, :, None].astype(np.float64)
        pooled = (x * m).sum(1) / np.maximum(m.sum(1), 1e-9)
    else:
        pooled = x[:, 0]
    return pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)


def _padded_batch(lengths: list[int], vocab: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = np.zeros((len(lengths), max(lengths)), dtype=np.int64)
    mask = np.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, :n] = rng.integers(1, vocab, n)
        mask[row, :n] = 1
    return ids, mask


def _run(path: Path, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(["sentence_embedding"], {"input_ids": ids, "attention_mask": mask})[0]


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize(("pooling", "optimize", "prefix"), [
    ("mean", False, ""), ("mean", True, ""), ("cls", False, "bert."), ("cls", True, "")])
def test_other_bert_shape_matches_numpy_reference(tmp_path: Path, pooling: str, optimize: bool, prefix: str) -> None:
    folder = make_tiny_bert(tmp_path / "tiny", pooling=pooling, prefix=prefix)
    path = ex.export_onnx(folder, tmp_path / "tiny.onnx", optimize=optimize)
    ids, mask = _padded_batch([1, 5, 17, 32], TINY["vocab_size"])
    ours = _run(path, ids, mask)
    ref = reference_bert(tiny_weights(0), TINY, ids, mask, pooling)
    assert ours.shape == (4, TINY["hidden_size"]) and ours.dtype == np.float32
    assert np.abs(ours - ref).max() < 1e-5
    ops = {n.op_type for n in onnx.load(str(path)).graph.node}
    if optimize:
        assert {"Attention", "SkipLayerNormalization", "BiasGelu"} <= ops
    else:
        assert "Attention" not in ops


def test_graph_contract_and_metadata(tmp_path: Path) -> None:
    folder = make_tiny_bert(tmp_path / "tiny")
    path = ex.export_onnx(folder, tmp_path / "out" / "tiny.onnx", optimize=False)
    model = onnx.load(str(path))
    onnx.checker.check_model(model)
    inputs = {i.name: i.type.tensor_type for i in model.graph.input}
    assert sorted(inputs) == ["attention_mask", "input_ids"]
    for t in inputs.values():
        assert t.elem_type == onnx.TensorProto.INT64
        assert [d.dim_param for d in t.shape.dim] == ["batch", "seq"]  # both dynamic
    (out,) = model.graph.output
    assert out.name == "sentence_embedding" and out.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert [d.dim_param or d.dim_value for d in out.type.tensor_type.shape.dim] == ["batch", 48]
    # The plain graph must stay standard ONNX (TensorRT parses this file).
    assert {op.domain for op in model.opset_import} == {""}
    assert all(n.domain == "" for n in model.graph.node)
    meta = {p.key: p.value for p in model.metadata_props}
    assert meta["dim"] == "48" and meta["max_seq_length"] == "32" and meta["optimized"] == "false"
    assert meta["exporter_version"] == ex.EXPORTER_VERSION and len(meta["weights_sha256"]) == 64
    assert not list(path.parent.glob("*.tmp"))


def test_fused_default_model_has_every_fusion(tmp_path: Path) -> None:
    path = ex.export_onnx(None, tmp_path / "fused.onnx", optimize=True)
    ops: dict[str, int] = {}
    for n in onnx.load(str(path), load_external_data=False).graph.node:
        ops[n.op_type] = ops.get(n.op_type, 0) + 1
    assert ops["Attention"] == 6 and ops["SkipLayerNormalization"] == 12 and ops["BiasGelu"] == 6
    assert ops["EmbedLayerNormalization"] == 1
    assert "Softmax" not in ops and "Erf" not in ops


def test_missing_or_misshapen_tensor_is_an_export_error(tmp_path: Path) -> None:
    folder = make_tiny_bert(tmp_path / "tiny")
    w = tiny_weights(0)
    del w["encoder.layer.1.output.dense.bias"]
    save_file(w, str(folder / "model.safetensors"))
    with pytest.raises(ExportError, match=r"model.safetensors: missing tensor 'encoder.layer.1.output.dense.bias'"):
        ex.export_onnx(folder, tmp_path / "x.onnx", optimize=False)
    w = tiny_weights(0)
    w["encoder.layer.0.intermediate.dense.weight"] = np.zeros((10, 48), np.float32)
    save_file(w, str(folder / "model.safetensors"))
    with pytest.raises(ExportError, match=r"has shape \(10, 48\), config.json implies \(80, 48\)"):
        ex.export_onnx(folder, tmp_path / "x.onnx", optimize=False)
    assert not (tmp_path / "x.onnx").exists()


# A meta-path finder that makes any torch / transformers import fail and records the attempt.
_BLOCK_TORCH = textwrap.dedent("""
    import importlib.abc, sys
    attempts = []
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torch", "transformers", "sentence_transformers"):
                attempts.append(name)
                raise ImportError(f"blocked import of {name}")
            return None
    sys.meta_path.insert(0, Block())
""")


def test_export_runs_with_torch_absent(tmp_path: Path) -> None:
    folder = make_tiny_bert(tmp_path / "tiny")
    script = _BLOCK_TORCH + textwrap.dedent(f"""
        from engines.onnx_export.export import export_onnx, ensure_onnx
        export_onnx({str(folder)!r}, {str(tmp_path / 'plain.onnx')!r}, optimize=False)
        export_onnx({str(folder)!r}, {str(tmp_path / 'fused.onnx')!r}, optimize=True)
        ensure_onnx({str(folder)!r}, cache_dir={str(tmp_path / 'cache')!r})
        import worker.embedder, worker.backends.onnxruntime  # the runtime side too
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers"))
        print("TORCH_MODULES", loaded)
        print("ATTEMPTS", attempts)
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "TORCH_MODULES []" in out.stdout
    # Nothing even tried to import torch (not an optional import swallowed somewhere).
    assert "ATTEMPTS []" in out.stdout, out.stdout
    assert (tmp_path / "plain.onnx").is_file() and (tmp_path / "fused.onnx").is_file()


def test_export_with_torch_poisoned_in_sys_modules(tmp_path: Path) -> None:
    # sys.modules["torch"] = None: any `import torch` raises ImportError, as in a torch-free venv
    # where something tried anyway.
    folder = make_tiny_bert(tmp_path / "tiny")
    script = textwrap.dedent(f"""
        import sys
        sys.modules["torch"] = None
        from engines.onnx_export.export import export_onnx
        export_onnx({str(folder)!r}, {str(tmp_path / 'fused.onnx')!r}, optimize=True)
        print("OK")
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr


def test_cache_reuses_and_reexports_when_weights_change(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = make_tiny_bert(tmp_path / "tiny", seed=0)
    cache = tmp_path / "cache"
    first = ex.ensure_onnx(folder, cache_dir=cache, optimize=False)
    assert first.parent == cache and first.is_file()
    stamp = first.stat().st_mtime_ns

    def no_export(*args: object, **kwargs: object) -> Path:
        raise AssertionError("ensure_onnx re-exported a fresh cache entry")

    monkeypatch.setattr(ex, "export_onnx", no_export)
    assert ex.ensure_onnx(folder, cache_dir=cache, optimize=False) == first
    assert first.stat().st_mtime_ns == stamp
    monkeypatch.undo()

    # New weights: a new key, a new export (with the new weights in it).
    save_file(tiny_weights(seed=1), str(folder / "model.safetensors"))
    second = ex.ensure_onnx(folder, cache_dir=cache, optimize=False)
    assert second != first and second.is_file()
    ids, mask = _padded_batch([4, 9], TINY["vocab_size"])
    assert np.abs(_run(second, ids, mask) - reference_bert(tiny_weights(1), TINY, ids, mask, "mean")).max() < 1e-5
    # The optimize flag and a config change are part of the key too.
    fused = ex.ensure_onnx(folder, cache_dir=cache, optimize=True)
    assert fused not in (first, second) and "fused" in fused.name
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 16}))
    assert ex.ensure_onnx(folder, cache_dir=cache, optimize=False) != second
    assert not list(cache.glob("*.tmp"))


def test_cache_dir_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = make_tiny_bert(tmp_path / "tiny")
    monkeypatch.setenv("KWE_CACHE_DIR", str(tmp_path / "envcache"))
    path = ex.ensure_onnx(folder, optimize=False)
    assert path.parent == tmp_path / "envcache" / "onnx" and path.is_file()


def test_concurrent_ensure_onnx_processes(tmp_path: Path) -> None:
    folder = make_tiny_bert(tmp_path / "tiny")
    cache = tmp_path / "cache"
    script = (f"from engines.onnx_export.export import ensure_onnx; "
              f"print(ensure_onnx({str(folder)!r}, cache_dir={str(cache)!r}, optimize=False))")
    procs = [subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    results = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in results]
    paths = {out.strip() for out, _ in results}
    assert len(paths) == 1
    onnx.checker.check_model(onnx.load(paths.pop()))
    assert [p.name for p in cache.iterdir() if not p.name.startswith(".")] == [Path(out.strip()).name
                                                                                for out, _ in results[:1]]


def test_missing_model_folder_is_an_export_error(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match="model folder not found"):
        ex.export_onnx(tmp_path / "nope", tmp_path / "x.onnx")


def test_cli_export(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from worker.cli import main

    folder = make_tiny_bert(tmp_path / "tiny")
    assert main(["export-onnx", "--model-dir", str(folder), "--output", str(tmp_path / "o.onnx"), "--no-optimize"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "o.onnx")
    assert main(["export-onnx", "--model-dir", str(tmp_path / "nope")]) == 1
    assert "model folder not found" in capsys.readouterr().err
