"""Settings from their sources: flags, `KWE_*` environment variables and the TOML config file.

Every field of `Settings` (worker/settings/schema.py) has a command-line flag (`--input-topic`), a
`KWE_*` environment variable (`KWE_INPUT_TOPIC`) and a key in the TOML config file
(`input_topic = "..."`). Precedence, lowest to highest: default < config file < environment <
flag. Each raw value is read as its field's type here, naming the source when it cannot be;
`Settings` itself checks the values.
"""

from __future__ import annotations

import argparse
import math
import os
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from worker.settings.schema import Settings, SettingsError, setting_fields, setting_type

ENV_PREFIX = "KWE_"


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
    kind = setting_type(f)
    try:
        if kind is tuple:
            if isinstance(raw, str):
                if name != "kafka_config":  # a list of names: header names, output fields
                    return tuple(part.strip() for part in raw.split(",") if part.strip())
                return split_kafka_config(raw)
            if isinstance(raw, (list, tuple)) and all(isinstance(x, str) for x in raw):
                if name != "kafka_config":  # `--pass-headers a,b --pass-headers c`
                    return tuple(part.strip() for x in raw for part in x.split(",") if part.strip())
                return tuple(raw)
            if isinstance(raw, dict) and name == "kafka_config":
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


def add_setting_flags(parser: argparse.ArgumentParser, only: Sequence[str] | None = None) -> None:
    """One flag per setting (or per setting named in `only`); unset flags stay None so lower layers show through."""
    parser.add_argument("--config", metavar="FILE", help="TOML config file; keys are the setting names.")
    for f in setting_fields():
        if only is not None and f.name not in only:
            continue
        kind = setting_type(f)
        help_text = f"{f.metadata['help']} [env {env_name(f.name)}]"
        if kind is tuple:
            parser.add_argument(flag_name(f.name), dest=f.name, action="append",
                                metavar="KEY=VALUE" if f.name == "kafka_config" else "NAME",
                                default=None, help=help_text)
        elif kind is bool:
            # --x / --no-x, as argparse users expect; `--x true` and `--x=false` still work
            # (worker.cli.bool_words rewrites them before parsing).
            parser.add_argument(flag_name(f.name), *FLAG_ALIASES.get(f.name, ()), dest=f.name,
                                action=argparse.BooleanOptionalAction, default=None, help=help_text)
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
