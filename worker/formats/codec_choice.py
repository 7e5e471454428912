"""Which codec writes the output records, and which serdes wrap it: chosen once per start from the
settings and the model's description.

`output_codec` is the one builder of the output codec (the dense `OutputCodec` or a sparse model's
`SparseOutputCodec`), with the fingerprint of everything that shapes a vector; `registry_formats`
wraps it in the Schema Registry's serdes where a format asks for them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import structlog

from worker.core.errors import extra_missing
from worker.core.fingerprint import VectorSettings, model_fingerprint
from worker.core.model import ModelError, ModelInfo, Prompt
from worker.core.vectors import check_truncate_dim, default_int8_range
from worker.formats.messages import Headers, Keyword, OutputCodec, Rejection, ValueEncoder
from worker.formats.sparse_codec import ENCODING as SPARSE_ENCODING
from worker.formats.sparse_codec import SparseOutputCodec
from worker.names import REGISTRY_FORMATS
from worker.settings.output_fields import parse_output_fields
from worker.settings.schema import Settings, SettingsError

log = structlog.get_logger(__name__)

Codec = OutputCodec | SparseOutputCodec
# A registry format's decoder (worker/formats/schema_registry.py's RegistryInput), which intake
# calls: (topic, key, value, headers, headers' bytes) -> the keyword or why not. It raises a
# WorkerError when the registry, not the record, fails: that stops the worker without committing it.
Decode = Callable[[str, bytes | None, bytes | None, Headers, int], Keyword | Rejection]


class Vocabulary(Protocol):
    """What a sparse codec's `terms` name the indices with (the intake's tokenizer has it)."""

    def vocabulary(self, size: int) -> tuple[str, ...]:
        ...


def output_codec(settings: Settings, info: ModelInfo, prompt: Prompt, tokenizer: Vocabulary | None = None) -> Codec:
    """The output records' codec: width (truncate_dim), encoding with its int8 range, the prompt, and
    the model fingerprint of all of them (worker/core/fingerprint.py); for a sparse model, its
    record of non-zero weights (with `terms`, read from `tokenizer`, else from the model's
    tokenizer.json)."""
    check_sparse_settings(settings, info)
    if info.sparse:
        vocabulary = None
        if settings.sparse_terms:
            vocabulary = (tokenizer.vocabulary(info.vocab_size) if tokenizer is not None
                          else _vocabulary(info))
        # top-k and the minimum weight change what is written: they are part of the fingerprint.
        fingerprint = model_fingerprint(info, VectorSettings(prompt=prompt.text, encoding=SPARSE_ENCODING,
                                                             sparse_top_k=settings.sparse_top_k,
                                                             sparse_min_weight=settings.sparse_min_weight))
        return SparseOutputCodec(model=info.name, dim=info.dim, prompt_name=prompt.name, prompt=prompt.text,
                                 fields=parse_output_fields(settings.output_fields), vocabulary=vocabulary,
                                 fingerprint=fingerprint.value)
    try:
        check_truncate_dim(settings.truncate_dim, info.dim, source="setting 'truncate_dim'")
    except ValueError as exc:
        raise ModelError(f"{exc} ({info.model_dir})") from None
    dim = settings.truncate_dim or info.dim
    int8_range = None
    if settings.output_encoding == "int8":
        if not settings.int8_range and not info.normalized:
            raise SettingsError(f"output_encoding=int8: {info.name} gives vectors that are not normalised (its "
                                f"pipeline has no Normalize module), so the default int8_range, 6/sqrt(dim) for "
                                f"unit vectors, does not fit them; set int8_range to the range of its components")
        r = settings.int8_range or default_int8_range(dim)
        int8_range = (-r, r)
    # Once per start: the codec writes it on every record as a constant.
    fingerprint = model_fingerprint(info, VectorSettings(prompt=prompt.text, truncate_dim=settings.truncate_dim,
                                                         encoding=settings.output_encoding, int8_range=int8_range))
    return OutputCodec(model=info.name, dim=dim, encoding=settings.output_encoding,  # type: ignore[arg-type]
                       truncate_dim=settings.truncate_dim, prompt_name=prompt.name, prompt=prompt.text,
                       int8_range=int8_range, fields=parse_output_fields(settings.output_fields),
                       normalized=info.normalized, fingerprint=fingerprint.value)


def _vocabulary(info: ModelInfo) -> tuple[str, ...]:
    """The token of each id below the model's vocabulary size, from its tokenizer.json (as the
    intake's tokenizer gives it: "" for an id with none)."""
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(str(info.tokenizer_path))
    except Exception as exc:  # tokenizers raises a bare Exception on a malformed file
        raise ModelError(f"{info.tokenizer_path}: cannot load tokenizer ({exc})") from None
    return tuple(tokenizer.id_to_token(i) or "" for i in range(info.vocab_size))


def check_sparse_settings(settings: Settings, info: ModelInfo) -> None:
    """The settings that apply to one kind of model only, refused for the other (SettingsError,
    naming the setting): a worker serves one model, dense or sparse."""
    if info.sparse:
        dense_only = [f"{name}={getattr(settings, name)}" for name, default in
                      (("output_encoding", "float-list"), ("truncate_dim", 0), ("int8_range", 0.0))
                      if getattr(settings, name) != default]
        if dense_only:
            raise SettingsError(f"{', '.join(dense_only)}: {info.name} is a sparse (SPLADE) model, whose records "
                                f"are its non-zero weights ({{\"indices\", \"values\"}}); these settings shape a "
                                f"dense vector (sparse_top_k and sparse_min_weight make a sparse one smaller)")
        return
    sparse_only = [f"{name}={getattr(settings, name)}" for name, default in
                   (("sparse_top_k", 0), ("sparse_min_weight", 0.0), ("sparse_terms", False))
                   if getattr(settings, name) != default]
    if sparse_only:
        raise SettingsError(f"{', '.join(sparse_only)}: these settings are for sparse (SPLADE) models; {info.name} is "
                            f"dense ({info.pipeline.describe()})")


def registry_formats(settings: Settings, codec: Codec) -> tuple[ValueEncoder, Decode | None]:
    """The output encoder and input decoder the formats ask for: the JSON codec and the built-in
    decoder, or confluent-kafka's registry serdes (imported only then: the registry extra)."""
    if settings.output_format not in REGISTRY_FORMATS and settings.input_format not in REGISTRY_FORMATS:
        return codec, None
    try:
        from worker.formats.schema_registry import RegistryInput, RegistryOutput, check_reachable, registry_client
    except ImportError as exc:
        wanted = [f"{name}={getattr(settings, name)}" for name in ("input_format", "output_format")
                  if getattr(settings, name) in REGISTRY_FORMATS]
        raise SettingsError(extra_missing("registry", " and ".join(wanted), exc.name or str(exc))) from None

    client = registry_client(settings)
    encoder: ValueEncoder = codec
    decode: Decode | None = None
    if settings.input_format in REGISTRY_FORMATS:
        check_reachable(settings, client)
        decode = RegistryInput(settings, client)
    if settings.output_format in REGISTRY_FORMATS:
        output = RegistryOutput(settings, codec, client)
        output.check(codec.dim)
        encoder = output
    log.info("schema registry", url=settings.schema_registry_url, input_format=settings.input_format,
             output_format=settings.output_format, subject_strategy=settings.schema_subject_strategy,
             auto_register=settings.schema_auto_register)
    return encoder, decode
