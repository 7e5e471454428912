"""The one place where the client settings become librdkafka configuration.

Every Kafka client of every command (the worker's consumer and producer, the admin client, the
`produce`, `consume` and `demo` commands) gets its security and pass-through keys from
`client_config(settings)`:

    kafka_config_file (properties)  <  kafka_config items (--kafka-config)  +  typed settings

The raw layers (file, then --kafka-config items) override each other key by key, as flags
override files. A typed setting (security_protocol, sasl_mechanism, sasl_username,
sasl_password / sasl_password_file, ssl_ca_location) that names a key the raw layers also set to
a different value is an error, not a silent winner. Keys the worker owns (bootstrap.servers,
group.id, the offset-commit keys) are refused in the file as on the command line.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from worker.operations.redact import is_secret_key
from worker.settings.kafka_overrides import RESERVED_KAFKA_KEYS
from worker.settings.loader import add_setting_flags, env_name
from worker.settings.schema import CLIENT_SETTINGS, Settings, SettingsError, kafka_pairs

# Typed setting -> librdkafka key.
TYPED_KEYS: dict[str, str] = {
    "security_protocol": "security.protocol",
    "sasl_mechanism": "sasl.mechanism",
    "sasl_username": "sasl.username",
    "sasl_password": "sasl.password",
    "ssl_ca_location": "ssl.ca.location",
}
# librdkafka spells some keys two ways; conflicts are checked on one spelling.
_ALIASES = {"sasl.mechanisms": "sasl.mechanism"}


def read_properties(path: str | Path) -> dict[str, str]:
    """A librdkafka properties file: `key=value` lines, blank lines and `#`/`!` comments skipped."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SettingsError(f"setting 'kafka_config_file': cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise SettingsError(f"setting 'kafka_config_file': {path} is not UTF-8 text") from None
    items: list[str] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not stripped or stripped.startswith(("#", "!")):
            continue
        items.append(stripped)
        # The line number, not the line: a malformed line may still hold a secret.
        kafka_pairs([stripped], source=f"{path}:{lineno}:")
    return kafka_pairs(items)


def _read_secret_file(name: str, path: str) -> str:
    try:
        value = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise SettingsError(f"setting {name!r}: cannot read {path}: {exc.strerror}") from None
    # A Kubernetes secret or `echo pw > file` ends with a newline that is not part of the password.
    value = value.rstrip("\r\n")
    if not value:
        raise SettingsError(f"setting {name!r}: {path} is empty")
    return value


def raw_config(settings: Settings) -> dict[str, str]:
    """The file's keys overridden by the --kafka-config items (the pass-through layers)."""
    raw: dict[str, str] = {}
    if settings.kafka_config_file:
        from_file = read_properties(settings.kafka_config_file)
        for key in from_file:
            if key in RESERVED_KAFKA_KEYS:
                raise SettingsError(f"setting 'kafka_config_file': {settings.kafka_config_file} sets {key!r}, "
                                    f"which cannot be overridden ({RESERVED_KAFKA_KEYS[key]})")
        raw.update(from_file)
    raw.update(settings.librdkafka_overrides())
    return raw


def typed_config(settings: Settings) -> dict[str, str]:
    """The typed settings that are set, as librdkafka keys (the password file read)."""
    typed = {key: getattr(settings, name) for name, key in TYPED_KEYS.items() if getattr(settings, name)}
    if settings.sasl_password_file:
        typed["sasl.password"] = _read_secret_file("sasl_password_file", settings.sasl_password_file)
    return typed


def client_config(settings: Settings) -> dict[str, str]:
    """Security and pass-through librdkafka keys for any client built from these settings."""
    raw = raw_config(settings)
    typed = typed_config(settings)
    normalised = {_ALIASES.get(k, k): (k, v) for k, v in raw.items()}
    for key, value in typed.items():
        if key in normalised and normalised[key][1] != value:
            name = ("sasl_password_file" if key == "sasl.password" and settings.sasl_password_file
                    else next(n for n, k in TYPED_KEYS.items() if k == key))
            raise SettingsError(f"setting {name!r} and kafka_config/kafka_config_file both set {normalised[key][0]!r} "
                                "to different values: keep one")
    merged = {k: v for k, v in raw.items() if _ALIASES.get(k, k) not in typed}
    merged.update(typed)
    return merged


def secret_values(settings: Settings) -> list[str]:
    """The secret values these settings configure (for the log redactor); [] if they cannot be read."""
    try:
        config = client_config(settings)
    except SettingsError:
        return [settings.sasl_password] if settings.sasl_password else []
    return [v for k, v in config.items() if is_secret_key(k) and v]


def admin_config(settings: Settings) -> dict[str, Any]:
    """An AdminClient for the worker's own cluster: the same address and security as its clients."""
    return {"bootstrap.servers": settings.bootstrap_servers, "client.id": f"keyword-embedder-{settings.group_id}",
            # librdkafka's own log lines go through the stdlib logger into the structured log stream.
            "logger": logging.getLogger("librdkafka"), **client_config(settings)}


# ------------------------------------------------------------------ commands other than `run`


def add_client_flags(parser: argparse.ArgumentParser) -> None:
    """The client settings' flags (and --config) for commands that are not the worker."""
    add_setting_flags(parser, only=CLIENT_SETTINGS)


def client_env(settings: Settings) -> dict[str, str]:
    """The client settings that are set, as KWE_* variables for a child `keyword-embedder run`.

    The environment, not argv: a password on a command line is visible to every user of the host.
    """
    env: dict[str, str] = {}
    for name in CLIENT_SETTINGS:
        value = getattr(settings, name)
        if value:
            env[env_name(name)] = ",".join(value) if isinstance(value, tuple) else str(value)
    return env

