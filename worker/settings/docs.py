"""docs/settings.md: the settings reference, rendered from `Settings` and the librdkafka rules.

`keyword-embedder settings --markdown` prints it; tests/unit/worker/settings/test_settings.py fails when the file and
the code disagree.
"""

from __future__ import annotations

from worker.settings.kafka_overrides import KAFKA_VALUE_RULES, RESERVED_KAFKA_KEYS
from worker.settings.loader import env_name, flag_name
from worker.settings.schema import Settings, setting_choices, setting_fields


def _cell(text: str) -> str:
    # A '|' inside a cell would end it and shift every later column of the row.
    return text.replace("|", "\\|")


REFERENCE_HEADER = (
    "# Settings reference\n\n"
    "<!-- Generated file: do not edit. Regenerate with\n"
    "     keyword-embedder settings --markdown > docs/settings.md\n"
    "     (tests/unit/worker/settings/test_settings.py fails when this file and worker/settings/schema.py disagree). -->\n\n"
    "Every setting has a default, a command-line flag, a `KWE_*` environment variable and a key in "
    "the TOML config file (`--config FILE` or `KWE_CONFIG`). Precedence, lowest to highest: "
    "default < config file < environment < flag. An invalid value stops the worker at start with "
    "a message naming the setting.\n\n"
)


def reference_markdown() -> str:
    """The whole of docs/settings.md: header, table, and the refused librdkafka overrides."""
    return REFERENCE_HEADER + reference_table() + "\n" + refused_kafka_table()


def refused_kafka_table() -> str:
    """The librdkafka keys and values kafka_config refuses, and why."""
    lines = [
        "## librdkafka settings that `kafka_config` refuses\n",
        "Every other librdkafka setting passes through to the consumer and the producer (security.protocol, "
        "sasl.\\*, ssl.\\*, linger.ms, compression.type, fetch.\\*, client.rack, ...), over the worker's own "
        "choices where it makes one: its consumer takes a 16 KiB slice of each partition per fetch "
        "(max.partition.fetch.bytes, so that partitions drain alike after a backlog), gathers records for up to "
        "10 ms (fetch.min.bytes, fetch.wait.max.ms; `fetch.min.bytes=1` answers each fetch as soon as one record is "
        "there) and fetches a partition whose prefetch queue was full again after 10 ms, not 1 s "
        "(fetch.queue.backoff.ms: large records fill it with a few); its producer lingers 5 ms "
        "(linger.ms).\n",
        "| key | allowed | why |",
        "|---|---|---|",
    ]
    for key, reason in RESERVED_KAFKA_KEYS.items():
        lines.append(f"| `{key}` | never | {_cell(reason)} |")
    for key, rule in KAFKA_VALUE_RULES.items():
        lines.append(f"| `{key}` | {_cell(rule.allowed)} | {_cell(rule.why)} |")
    return "\n".join(lines) + "\n"


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
        if isinstance(default, bool):
            desc += f" On with `{flag_name(f.name)}`, off with `--no-{flag_name(f.name)[2:]}`."
        choices = [c for c in setting_choices(f) if c != ""]
        if choices:
            desc += " One of: " + ", ".join(f"`{c}`" for c in choices) + "."
        if f.metadata.get("minimum") is not None or f.metadata.get("maximum") is not None:
            low, high = f.metadata.get("minimum"), f.metadata.get("maximum")
            desc += (f" Range: {low} to {high}." if low is not None and high is not None
                     else f" Minimum: {low}." if low is not None else f" Maximum: {high}.")
        lines.append(f"| `{f.name}` | `{flag_name(f.name)}` | `{env_name(f.name)}` | {shown} | {_cell(desc)} |")
    return "\n".join(lines) + "\n"
