"""Keeping secrets out of what the worker prints: logs, the `settings` output, error messages.

Two nets, because neither alone catches everything:
- by name: a librdkafka/Java client key or a setting that holds a secret (`sasl.password`,
  `ssl.key.pem`, `sasl.jaas.config`, `sasl_password`, ...) has its value replaced, wherever it
  shows up as `key=value`, `key: value`, a JSON member or a mapping key;
- by value: the secret values actually configured (passwords read from files included) are
  replaced wherever they appear verbatim, whatever surrounds them.
Pure functions and one small processor class; nothing here keeps process-wide state.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, MutableMapping
from typing import Any

MASK = "***"
# Shorter values are not searched for by value: masking every "ab" in every log line would
# destroy the logs and protect nothing (a 3-character password is not a secret anyway).
MIN_SECRET_LEN = 4

# Exact names (librdkafka and Java clients) whose value is secret but whose name says nothing.
_SECRET_NAMES = frozenset({
    "ssl.key.pem", "ssl_key", "ssl.keystore.location.password", "sasl.oauthbearer.config",
    "sasl.jaas.config", "ssl.engine.callback.data", "basic.auth.user.info",
})
# Any name containing one of these words is secret: sasl.password, ssl.key.password,
# ssl.keystore.password, ssl.truststore.password, sasl.oauthbearer.client.secret,
# sasl.oauthbearer.assertion.private.key.passphrase, sasl_password (the setting), ...
_SECRET_WORDS = ("password", "passwd", "secret", "passphrase", "private.key", "private_key", "credential")
# Settings that only name a file holding a secret: the path itself is not secret.
_PATH_SUFFIXES = ("_file", ".location")


def is_secret_key(key: str) -> bool:
    k = key.strip().lower()
    if k in _SECRET_NAMES:
        return True
    if k.endswith(_PATH_SUFFIXES):
        return False
    return any(word in k for word in _SECRET_WORDS)


# key=value / key: value / "key": "value" where the key looks like a config key. The value runs to
# the end of the token: whitespace, a comma, a quote, a closing bracket, or a semicolon.
_PAIR = re.compile(
    r"""(?P<key>["']?[A-Za-z][A-Za-z0-9_.\-]*["']?)(?P<sep>\s*[=:]\s*)(?P<quote>["']?)(?P<value>[^\s,"'\])};]*)""")
# JAAS inline passwords: password="..." inside sasl.jaas.config strings.
_JAAS = re.compile(r"""(?P<key>password\s*=\s*)(?P<quote>["'])(?P<value>.*?)(?P=quote)""", re.IGNORECASE)


def redact_text(text: str, secrets: Iterable[str] = ()) -> str:
    """`text` with every secret value masked: known values verbatim, and values of secret keys."""
    for value in sorted({s for s in secrets if s and len(s) >= MIN_SECRET_LEN}, key=len, reverse=True):
        text = text.replace(value, MASK)
    text = _JAAS.sub(lambda m: f"{m['key']}{m['quote']}{MASK}{m['quote']}", text)

    def pair(m: re.Match[str]) -> str:
        if not m["value"] or m["value"] == MASK or not is_secret_key(m["key"].strip("\"'")):
            return m[0]
        return f"{m['key']}{m['sep']}{m['quote']}{MASK}"

    return _PAIR.sub(pair, text)


def redact_value(value: Any, secrets: Iterable[str] = ()) -> Any:
    """Strings, mappings and sequences with secrets masked (mapping values by key name too)."""
    if isinstance(value, str):
        return redact_text(value, secrets)
    if isinstance(value, Mapping):
        return {k: (MASK if isinstance(k, str) and is_secret_key(k) and v not in (None, "")
                    else redact_value(v, secrets)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact_value(v, secrets) for v in value)
    return value


def redact_pairs(pairs: Mapping[str, str]) -> dict[str, str]:
    """A librdkafka config with the values of secret keys masked (for display)."""
    return {k: (MASK if is_secret_key(k) and v else v) for k, v in pairs.items()}


class RedactSecrets:
    """structlog processor: masks secrets in every key and value of an event dict.

    Runs on structlog events and on stdlib records (librdkafka's own log lines) alike.
    """

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        self._secrets = tuple(sorted({s for s in secrets if s and len(s) >= MIN_SECRET_LEN}, key=len, reverse=True))

    def __call__(self, _logger: Any, _name: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        for key, value in list(event_dict.items()):
            if is_secret_key(key) and value not in (None, ""):
                event_dict[key] = MASK
            elif isinstance(value, (str, Mapping, list, tuple)):
                event_dict[key] = redact_value(value, self._secrets)
            elif isinstance(value, BaseException):
                # Rendered later by str(); mask its text now.
                event_dict[key] = redact_text(repr(value), self._secrets)
        return event_dict
