"""The rotary families (qwen3, gemma3_text, modernbert): their config.json read in both spellings,
what is refused by name, and the exported graph's invariances (a text's vector does not depend on
its batch; the sliding window is exact), on small random models made here. Parity against
sentence-transformers' own vectors is in tests/unit/engines/onnx_export/test_rotary_parity.py (the committed fixtures).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from safetensors.numpy import save_file

from engines.onnx_export.export import build_model, export_onnx
from engines.onnx_export.graph import INPUT_NAMES, ExportError
from worker.batching.padding import pad_batch
from worker.core.model import ModelError, ModelInfo
from worker.core.rotary_config import FULL, SLIDING
from tests.conftest import ROOT

BERT_TOKENIZER = ROOT / "tests" / "data" / "families" / "bert" / "tokenizer.json"
VOCAB, HIDDEN, INTER = 512, 32, 48


def _random(shape: tuple[int, ...], rng: np.random.Generator, scale: float = 0.1, offset: float = 0.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale + offset).astype(np.float32)


def make_model(folder: Path, family: str, **config: object) -> Path:
    """A 3-layer random model of `family` (mean pooling, Normalize) with the BERT fixture's tokenizer."""
    rng = np.random.default_rng(7)
    folder.mkdir(parents=True)
    shutil.copy(BERT_TOKENIZER, folder / "tokenizer.json")
    layers, t = 3, {}
    if family == "modernbert":
        heads, hd = 4, HIDDEN // 4
        cfg: dict[str, object] = dict(hidden_size=HIDDEN, num_hidden_layers=layers, num_attention_heads=heads,
                                      intermediate_size=INTER, vocab_size=VOCAB, max_position_embeddings=256,
                                      local_attention=8, global_attn_every_n_layers=3)
        t["embeddings.tok_embeddings.weight"] = _random((VOCAB, HIDDEN), rng, 1.0)
        t["embeddings.norm.weight"] = _random((HIDDEN,), rng, 0.1, 1.0)
        for i in range(layers):
            p = f"layers.{i}"
            if i:
                t[f"{p}.attn_norm.weight"] = _random((HIDDEN,), rng, 0.1, 1.0)
            t[f"{p}.attn.Wqkv.weight"] = _random((3 * HIDDEN, HIDDEN), rng, 0.3)
            t[f"{p}.attn.Wo.weight"] = _random((HIDDEN, HIDDEN), rng)
            t[f"{p}.mlp_norm.weight"] = _random((HIDDEN,), rng, 0.1, 1.0)
            t[f"{p}.mlp.Wi.weight"] = _random((2 * INTER, HIDDEN), rng)
            t[f"{p}.mlp.Wo.weight"] = _random((HIDDEN, INTER), rng)
        t["final_norm.weight"] = _random((HIDDEN,), rng, 0.1, 1.0)
    else:
        heads, kv, hd = 4, 2, 16
        gemma = family == "gemma3_text"
        one = 0.0 if gemma else 1.0  # Gemma's RMSNorm scales by (1 + w)
        cfg = dict(hidden_size=HIDDEN, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                   head_dim=hd, intermediate_size=INTER, vocab_size=VOCAB, max_position_embeddings=512)
        if gemma:
            cfg.update(use_bidirectional_attention=True, sliding_window=8, query_pre_attn_scalar=16,
                       layer_types=[SLIDING, FULL, SLIDING])
        t["embed_tokens.weight"] = _random((VOCAB, HIDDEN), rng, 1.0)
        norms = ["input_layernorm", "post_attention_layernorm"] + (
            ["pre_feedforward_layernorm", "post_feedforward_layernorm"] if gemma else [])
        for i in range(layers):
            p = f"layers.{i}"
            for n in norms:
                t[f"{p}.{n}.weight"] = _random((HIDDEN,), rng, 0.1, one)
            t[f"{p}.self_attn.q_proj.weight"] = _random((heads * hd, HIDDEN), rng, 0.3)
            t[f"{p}.self_attn.k_proj.weight"] = _random((kv * hd, HIDDEN), rng, 0.3)
            t[f"{p}.self_attn.v_proj.weight"] = _random((kv * hd, HIDDEN), rng)
            t[f"{p}.self_attn.o_proj.weight"] = _random((HIDDEN, heads * hd), rng)
            t[f"{p}.self_attn.q_norm.weight"] = _random((hd,), rng, 0.1, one)
            t[f"{p}.self_attn.k_norm.weight"] = _random((hd,), rng, 0.1, one)
            t[f"{p}.mlp.gate_proj.weight"] = _random((INTER, HIDDEN), rng)
            t[f"{p}.mlp.up_proj.weight"] = _random((INTER, HIDDEN), rng)
            t[f"{p}.mlp.down_proj.weight"] = _random((HIDDEN, INTER), rng)
        t["norm.weight"] = _random((HIDDEN,), rng, 0.1, one)
    cfg.update(model_type=family, **config)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(t, str(folder / "model.safetensors"))
    (folder / "1_Pooling").mkdir()
    pooling = "lasttoken" if family == "qwen3" else "mean_tokens"
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({f"pooling_mode_{pooling}": True}))
    return folder


def _session(folder: Path):  # noqa: ANN202
    import onnxruntime as ort

    return ort.InferenceSession(build_model(folder).SerializeToString(), providers=["CPUExecutionProvider"])


def _run(sess, rows: list[np.ndarray]) -> np.ndarray:  # noqa: ANN001
    return sess.run(None, dict(zip(INPUT_NAMES, pad_batch(rows))))[0]


@pytest.mark.parametrize("family", ["qwen3", "gemma3_text", "modernbert"])
def test_a_texts_vector_does_not_depend_on_its_batch(tmp_path: Path, family: str) -> None:
    """Mixed lengths in one right-padded batch, rows 3-5x the sliding window (8): each row's vector
    is its vector alone. The causal mask, the window and last-token pooling all see the padding."""
    sess = _session(make_model(tmp_path / family, family))
    rng = np.random.default_rng(1)
    rows = [rng.integers(5, VOCAB, n).astype(np.int64) for n in (3, 40, 1, 17, 25, 9)]
    alone = np.concatenate([_run(sess, [r]) for r in rows])
    together = _run(sess, rows)
    assert np.isfinite(together).all()
    assert np.abs(alone - together).max() < 1e-5


@pytest.mark.parametrize("family", ["gemma3_text", "modernbert"])
def test_the_sliding_window_is_exact_for_texts_longer_than_it(tmp_path: Path, family: str) -> None:
    """One sliding layer (window 8: radius 4, as transformers reads EmbeddingGemma's (w // 2) + 1
    exclusive bound and ModernBERT's local_attention // 2): the first token's state sees a change
    at position 4 and none at position 5, in a text 30 tokens long."""
    types = {"layer_types": [SLIDING]}
    folder = make_model(tmp_path / family, family, num_hidden_layers=1, **types)
    _trim_layers(folder, 1)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    sess = _session(folder)
    rng = np.random.default_rng(2)
    row = rng.integers(5, VOCAB, 30).astype(np.int64)
    radius = ModelInfo.from_dir(folder).rotary.window_radius
    assert radius == 4
    inside, outside = row.copy(), row.copy()
    inside[radius] = (row[radius] + 1) % VOCAB or 5       # at |q - k| = radius: attended
    outside[radius + 1] = (row[radius + 1] + 1) % VOCAB or 5  # one past it: not attended
    base = _run(sess, [row])
    assert np.abs(_run(sess, [outside]) - base).max() == 0.0
    assert np.abs(_run(sess, [inside]) - base).max() > 1e-4


def _trim_layers(folder: Path, layers: int) -> None:
    from safetensors.numpy import load_file

    tensors = load_file(str(folder / "model.safetensors"))
    keep = {k: v for k, v in tensors.items() if not k.startswith("layers.") or int(k.split(".")[1]) < layers}
    save_file(keep, str(folder / "model.safetensors"))


def test_qwen3_is_causal_a_later_token_does_not_change_an_earlier_one(tmp_path: Path) -> None:
    folder = make_model(tmp_path / "q", "qwen3")
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    sess = _session(folder)
    row = np.arange(10, 30, dtype=np.int64)
    later = row.copy()
    later[-1] = 7
    assert np.abs(_run(sess, [row]) - _run(sess, [later])).max() == 0.0  # position 0 sees only itself


@pytest.mark.parametrize(("family", "config", "match"), [
    ("gemma3_text", {"use_bidirectional_attention": False},
     "gemma3_text without use_bidirectional_attention .* is not supported"),
    ("gemma3_text", {"attn_logit_softcapping": 50.0}, "gemma3_text with attn_logit_softcapping is not supported"),
    ("gemma3_text", {"hidden_activation": "gelu"}, "hidden_activation 'gelu' is not supported for gemma3_text"),
    ("qwen3", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn' is not supported"),
    ("qwen3", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e6}}, "rope type 'dynamic' is not supported"),
    ("qwen3", {"use_sliding_window": True}, "qwen3 with sliding-window layers .* is not supported"),
    ("qwen3", {"num_key_value_heads": 3}, "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    ("modernbert", {"layer_types": ["full_attention"]}, "layer_types must list 3 entries"),
    ("modernbert", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "modernbert with rope_scaling .* is not"),
    ("modernbert", {"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                           "rope_theta": 1e4}}},
     "full_attention rope type 'linear' is not supported"),
])
def test_what_is_not_built_is_refused_by_name(tmp_path: Path, family: str, config: dict, match: str) -> None:
    with pytest.raises(ModelError, match=match):
        ModelInfo.from_dir(make_model(tmp_path / "m", family, **config))


def test_both_config_spellings_read_the_same(tmp_path: Path) -> None:
    """transformers 5 writes rope_parameters (per layer type for gemma3 and modernbert); older
    versions rope_theta, rope_local_base_freq, global_rope_theta / local_rope_theta."""
    old = ModelInfo.from_dir(make_model(tmp_path / "old", "gemma3_text", rope_theta=1e6, rope_local_base_freq=1e4))
    new = ModelInfo.from_dir(make_model(tmp_path / "new", "gemma3_text", rope_parameters={
        FULL: {"rope_type": "default", "rope_theta": 1e6}, SLIDING: {"rope_type": "default", "rope_theta": 1e4}}))
    assert old.rotary == new.rotary and old.rotary.rope_for(SLIDING).theta == 1e4
    old = ModelInfo.from_dir(make_model(tmp_path / "mold", "modernbert", global_rope_theta=8e4, local_rope_theta=2e4))
    new = ModelInfo.from_dir(make_model(tmp_path / "mnew", "modernbert", rope_parameters={
        FULL: {"rope_type": "default", "rope_theta": 8e4}, SLIDING: {"rope_type": "default", "rope_theta": 2e4}}))
    assert old.rotary == new.rotary and old.rotary.rope_for(FULL).theta == 8e4
    old = ModelInfo.from_dir(make_model(tmp_path / "qold", "qwen3", rope_theta=1e6))
    new = ModelInfo.from_dir(make_model(tmp_path / "qnew", "qwen3",
                                        rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    assert old.rotary == new.rotary and old.rotary.rope_for(FULL).theta == 1e6
    # EmbeddingGemma's window: transformers attends |q - k| < (w // 2) + 1.
    assert old.rotary.window_radius == 0 and ModelInfo.from_dir(tmp_path / "new").rotary.window_radius == 4


def test_gemma3_is_never_fp16_and_qwen3s_fp16_graph_keeps_its_norms_fp32(tmp_path: Path) -> None:
    from engines.fp16_onnx import Fp16Error, to_fp16

    gemma = build_model(make_model(tmp_path / "g", "gemma3_text"))
    with pytest.raises(Fp16Error, match="gemma3_text .* is not run in fp16: its activations overflow float16"):
        to_fp16(gemma)
    qwen = to_fp16(build_model(make_model(tmp_path / "q", "qwen3")))
    kept = [n for n in qwen.graph.node if ".keep32_" in n.name and n.op_type in ("Pow", "Cos")]
    assert kept and all(n.name for n in kept)
    types = {vi.name: vi.type.tensor_type.elem_type
             for vi in onnx.shape_inference.infer_shapes(qwen).graph.value_info}
    assert all(types.get(n.output[0]) == onnx.TensorProto.FLOAT for n in kept)


def test_the_torch_backend_and_int8_and_the_fused_export_refuse_them_by_name(tmp_path: Path) -> None:
    from engines.quantize_int8 import QuantizeError, ensure_int8_onnx
    from worker.backends.torch_plan import refusal

    info = ModelInfo.from_dir(make_model(tmp_path / "q", "qwen3"))
    reason = refusal(info)
    assert reason is not None and "model_type 'qwen3'" in reason and "onnxruntime, openvino or tensorrt" in reason
    with pytest.raises(QuantizeError, match="not model_type 'qwen3'; use precision fp32"):
        ensure_int8_onnx(info, cache_dir=tmp_path / "cache")
    with pytest.raises(ExportError, match="no offline-fused graph for model_type 'qwen3'"):
        export_onnx(info, tmp_path / "m.onnx", optimize=True)


def test_the_bert_families_graphs_carry_no_model_type_metadata_so_their_files_are_unchanged(tmp_path: Path) -> None:
    bert = build_model(ROOT / "tests" / "data" / "families" / "bert")
    assert "model_type" not in {p.key for p in bert.metadata_props}
    qwen = build_model(make_model(tmp_path / "q", "qwen3"))
    assert {p.key: p.value for p in qwen.metadata_props}["model_type"] == "qwen3"


@pytest.mark.parametrize("family", ["qwen3", "modernbert"])
def test_the_fp16_graph_for_tensorrt_keeps_parity_with_the_fp32_one(tmp_path: Path, family: str) -> None:
    """What a TensorRT fp16 build parses, run in ONNX Runtime on CPU: rows past the window, and a
    position past 2048 (where fp16 positions would no longer be integers; the rotary tables stay FP32)."""
    from engines.fp16_onnx import PARITY_MIN_COS, parity, to_fp16

    fp32 = build_model(make_model(tmp_path / family, family, max_position_embeddings=4096))
    rng = np.random.default_rng(3)
    rows = [rng.integers(5, VOCAB, n).astype(np.int64) for n in (3, 40, 17, 2100)]
    cos = parity(fp32, to_fp16(fp32), [pad_batch(rows[:3]), pad_batch(rows[3:])])
    assert cos.min() >= PARITY_MIN_COS, cos


def test_build_engine_refuses_an_fp16_plan_of_embeddinggemma_by_name(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from worker.cli import main

    folder = make_model(tmp_path / "g", "gemma3_text")
    assert main(["build-engine", "--model-dir", str(folder), "--fp16", "--output", str(tmp_path / "p.plan")]) == 2
    assert "is a gemma3_text model, whose activations overflow float16" in capsys.readouterr().err


def test_a_graph_over_the_protobuf_limit_keeps_its_weights_beside_it(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen3-Embedding-0.6B in float32 is 2.4 GB, over the 2 GiB one protobuf holds: its export
    keeps the weights in `<file>.data`, which ONNX Runtime and OpenVINO read from the path. Shown
    here with the limit lowered to the small model's size."""
    import onnxruntime as ort

    import engines.onnx_export.export as export

    folder = make_model(tmp_path / "q", "qwen3")
    rows = [np.arange(5, 25, dtype=np.int64), np.arange(7, 10, dtype=np.int64)]
    expected = _run(_session(folder), rows)
    monkeypatch.setattr(export, "EXTERNAL_DATA_BYTES", 100_000)
    with pytest.raises(ExportError, match="over the 2 GiB one protobuf holds; export it to a file"):
        build_model(folder)
    path = export.export_onnx(folder, tmp_path / "out" / "m.onnx", optimize=False)
    assert sorted(p.name for p in path.parent.iterdir()) == ["m.onnx", "m.onnx.data"]
    assert path.stat().st_size < 100_000 < (path.parent / "m.onnx.data").stat().st_size
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert np.abs(sess.run(None, dict(zip(INPUT_NAMES, pad_batch(rows))))[0] - expected).max() < 1e-6
    from worker.backends.openvino import OpenVinoBackend

    ov = OpenVinoBackend(path, precision="f32", cache_dir=tmp_path / "ov")
    assert np.abs(ov.create_context(0).run(*pad_batch(rows)) - expected).max() < 1e-5
