"""Assembly: from one Settings object to a ready-to-run Pipeline (model, tokenizer, backend, profile)."""

from __future__ import annotations

from pathlib import Path

import structlog

from worker.config import Settings
from worker.metrics import Metrics
from kwe_core.model import ModelInfo, default_model_dir
from worker.pipeline import Pipeline
from worker.tokenize import KeywordTokenizer

log = structlog.get_logger(__name__)


def build_pipeline(settings: Settings, *, metrics: Metrics | None = None) -> Pipeline:
    """Loads the model's tokenizer and the backend the settings ask for, and wires the pipeline.

    Raises ModelError / BackendError / ProfileError with messages that name the file or setting.
    """
    from worker.backends.select import load_backend

    model_dir = Path(settings.model_dir) if settings.model_dir else default_model_dir()
    info = ModelInfo.from_dir(model_dir)
    tokenizer = KeywordTokenizer.from_model_dir(model_dir)
    backend, profile = load_backend(settings)
    log.info("backend loaded", backend=backend.name, model=info.name, dim=backend.dim, profile=profile.name,
             buckets=list(profile.bounds), max_len=tokenizer.max_len)
    if metrics is not None:
        metrics.set_backend_info(backend.name, info.name, profile.name)
    return Pipeline(settings, tokenizer=tokenizer, backend=backend, profile=profile, model_name=info.name,
                    metrics=metrics)
