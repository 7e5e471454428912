"""The torch backend's precision: the first candidate that passes the parity gate the CPU choice uses.

Candidates (worker/backends/torch_plan.py precision_candidates): for `torch_precision = auto`,
fp16, then bf16 where the card has compute capability 8.0 or later, then fp32; an explicit value
is the only candidate. Each is opened (weights on the GPU, every bucket's CUDA graph captured),
embeds the shipped golden texts (gate_texts.json) through its own graphs, each gate batch in the
context of the bucket covering its length, and is refused unless every row keeps cos >= 0.9999 to
the fp32 reference and its norm within 1e-4 of it (worker/backend_choice/auto.py check_gate). The
reference is the model's own ONNX export in ONNX Runtime on CPU, as for the CPU choice. A refused
candidate is logged with its numbers and closed; none passing is a BackendError that says why.

The encoder weights are read from model.safetensors once and shared by the candidates. Nothing is
cached on disk: the gate takes a few seconds of a start that captures graphs anyway.

Runs once, on the thread that starts the worker, before any context exists: the contexts it opens
are closed before it returns, so the backend it returns has every slot free for the dispatchers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import structlog

from worker.backend_choice.auto import Trial, check_gate, embed_batches, gate_batches, gate_token_ids
from worker.backends.base import Backend, InferenceContext
from worker.backends.torch_plan import TorchDtype, precision_candidates, read_weights, shape_for
from worker.core.errors import BackendError
from worker.core.model import ModelInfo
from worker.core.profiles import Profile

log = structlog.get_logger(__name__)


@dataclass
class TorchChoice:
    precision: TorchDtype
    reason: str
    trials: list[Trial]
    seconds: float
    device: str


def reference_rows(model: ModelInfo, token_ids: Sequence[Sequence[int]]) -> np.ndarray:
    """The gate texts through the model's fp32 ONNX export in ONNX Runtime (CPU): the reference."""
    from engines.onnx_export.export import ensure_onnx
    from worker.backends.onnxruntime import OnnxRuntimeBackend

    backend = OnnxRuntimeBackend(ensure_onnx(model))
    ctx = backend.create_context(0)
    try:
        return embed_batches(ctx.run, gate_batches(token_ids), len(token_ids), backend.dim)
    finally:
        ctx.close()
        backend.close()


def embed_through_buckets(backend: Backend, profile: Profile, token_ids: Sequence[Sequence[int]]) -> np.ndarray:
    """The gate texts through a bucket-bound backend: each batch in its bucket's context, cut at its max batch."""
    from worker.backends.torch_plan import graph_shapes

    # The backend's own shapes (the bound capped at the model's length); a bucket's otherwise.
    shapes = getattr(backend, "shapes", None) or graph_shapes(profile)
    contexts: dict[int, InferenceContext] = {}
    out = np.zeros((len(token_ids), backend.dim), dtype=np.float32)
    try:
        for rows, ids, mask in gate_batches(token_ids):
            shape = shape_for(shapes, profile, 1, ids.shape[1])
            if shape.bucket not in contexts:
                contexts[shape.bucket] = backend.create_context(shape.bucket)
            for start in range(0, len(rows), shape.batch):
                part = slice(start, start + shape.batch)
                out[rows[part]] = contexts[shape.bucket].run(ids[part], mask[part])
    finally:
        for ctx in contexts.values():
            ctx.close()
    return out


OpenTorch = Callable[[TorchDtype], Backend]


def choose_torch(model: ModelInfo, profile: Profile, *, requested: str = "auto", device: int = 0,
                 open_candidate: OpenTorch | None = None,
                 reference: Callable[[Sequence[Sequence[int]]], np.ndarray] | None = None) -> tuple[TorchChoice, Backend]:
    """The torch backend in the first precision that passes the gate, and why; BackendError if none does.

    `open_candidate` and `reference` are the tests' seams (the defaults open TorchCudaBackend and
    run the ONNX export in ONNX Runtime).
    """
    from worker.backends.torch_cuda import TorchCudaBackend, cuda_device
    from worker.backends.torch_plan import check_model

    t0 = time.monotonic()
    check_model(model)  # a model it cannot run: one line, before torch is imported
    gpu = cuda_device(device)  # TorchUnavailableError (one line) before anything is read
    found, notes = precision_candidates(requested, gpu.capability)
    if open_candidate is None:
        weights = read_weights(model)  # once, for every candidate

        def open_candidate(precision: TorchDtype) -> Backend:
            return TorchCudaBackend(model, profile, precision=precision, device=device, weights=weights)

    token_ids = gate_token_ids(model)
    ref = (reference or (lambda ids: reference_rows(model, ids)))(token_ids)
    trials: list[Trial] = []
    for precision in found:
        label = f"torch/{precision}"
        backend = open_candidate(precision)
        try:
            rows = embed_through_buckets(backend, profile, token_ids)
        except BaseException:
            backend.close()
            raise
        passed, why, min_cos, max_diff = check_gate(rows, ref)
        trials.append(Trial(label, passed, why, min_cos, max_diff))
        if passed:
            reason = (f"torch {precision} on {gpu.describe()}: parity gate passed against fp32 ONNX Runtime "
                      f"(min cos {min_cos:.6f} over {len(token_ids)} golden texts)")
            refused = [f"{t.label} refused ({t.reason})" for t in trials if not t.passed]
            reason = "; ".join([reason, *refused, *notes])
            seconds = time.monotonic() - t0
            log.info("torch precision chosen", precision=precision, min_cos=round(min_cos, 6), device=gpu.describe(),
                     seconds=round(seconds, 2), refused=refused or None)
            return TorchChoice(precision, reason, trials, seconds, gpu.describe()), backend
        log.warning("torch candidate refused by the parity gate", candidate=label, reason=why,
                    min_cos=round(min_cos, 6), max_norm_diff=max_diff)
        backend.close()
    tried = "; ".join(f"{t.label}: {t.reason}" for t in trials)
    raise BackendError(f"backend 'torch': no precision passes the parity gate against fp32 ONNX Runtime on "
                       f"{gpu.describe()} ({tried}); run this model on onnxruntime")
