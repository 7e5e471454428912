"""The ModelInfo of a static model folder (worker/core/static.py): the fields every model has, with
no encoder behind them (no layers, no positions beyond the token cut)."""

from __future__ import annotations

from pathlib import Path

from worker.core.model import ModelInfo, _model_name, _st_config
from worker.core.st_pipeline import ModulePipeline, Normalize
from worker.core.static import StaticSpec


def static_model_info(model_dir: Path, spec: StaticSpec) -> ModelInfo:
    """A static model as a ModelInfo: `hidden_size` the table's width, `vocab_size` the tokenizer's,
    `max_seq_length` the token cut; the pipeline a mean, then Normalize where the model states it."""
    prompts, default_prompt_name, similarity = _st_config(model_dir)
    pipeline = ModulePipeline(steps=(Normalize(),) if spec.normalize else (), modules_path=spec.config_path,
                              static=spec.describe(), static_files=spec.files)
    return ModelInfo(
        name=_model_name(model_dir), model_type="static", hidden_size=spec.dim, num_layers=0, num_heads=1,
        intermediate_size=0, layer_norm_eps=0.0, vocab_size=spec.vocab, max_position_embeddings=spec.max_tokens,
        max_seq_length=spec.max_tokens, model_dir=model_dir, config_path=spec.config_path,
        weights_path=spec.weights_path, tokenizer_path=spec.tokenizer_path, prompts=prompts,
        default_prompt_name=default_prompt_name, pipeline=pipeline, similarity=similarity, static=spec)
