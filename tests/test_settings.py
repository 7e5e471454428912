"""Settings: the reference table and docs/settings.md against the Settings object, precedence,
validation errors that name the setting, and librdkafka passthrough."""

from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from worker.config import (
    Settings,
    SettingsError,
    add_setting_flags,
    env_name,
    flag_name,
    load_settings,
    reference_markdown,
    reference_table,
    setting_choices,
    setting_fields,
)
from worker.kafka.consumer import consumer_config
from worker.kafka.producer import producer_config

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "settings.md"
ROW = re.compile(r"^\| `(?P<name>[a-z0-9_]+)` \| `(?P<flag>[^`]+)` \| `(?P<env>[^`]+)` \| (?P<default>.*?) \| (?P<desc>.*) \|$")


def _rows(markdown: str) -> dict[str, dict[str, str]]:
    rows = {}
    for line in markdown.splitlines():
        m = ROW.match(line)
        if m:
            rows[m["name"]] = m.groupdict()
    return rows


def _shown_default(value: object) -> str:
    return "(none)" if value in ("", ()) else f"`{value}`"


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_setting_flags(parser)
    return parser.parse_args(argv)


# ------------------------------------------------------------------ the reference


@pytest.mark.parametrize("source", ["table", "doc"])
def test_every_setting_is_in_the_reference_with_its_flag_env_and_default(source: str) -> None:
    text = reference_table() if source == "table" else DOC.read_text(encoding="utf-8")
    rows = _rows(text)
    defaults = Settings()
    names = [f.name for f in setting_fields()]
    assert sorted(rows) == sorted(names), "rows and Settings fields differ"
    for name in names:
        row = rows[name]
        assert row["flag"] == flag_name(name) == "--" + name.replace("_", "-")
        assert row["env"] == env_name(name) == "KWE_" + name.upper()
        assert row["default"] == _shown_default(getattr(defaults, name)), name
        assert row["desc"].strip(), f"{name} has no description"


def test_committed_doc_is_exactly_the_generated_one() -> None:
    # The doc is generated; any drift (new field, changed help or default) fails here with
    # the command that fixes it.
    assert DOC.read_text(encoding="utf-8") == reference_markdown(), (
        "docs/settings.md is stale: run `keyword-embedder settings --markdown > docs/settings.md`")
    assert "keyword-embedder settings --markdown > docs/settings.md" in DOC.read_text(encoding="utf-8")


def test_settings_command_prints_the_doc(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "worker.cli", "settings", "--markdown"], cwd=ROOT,
                         capture_output=True, text=True, check=True)
    assert out.stdout == reference_markdown()
    target = tmp_path / "settings.md"
    subprocess.run([sys.executable, "-m", "worker.cli", "settings", "--markdown", "--write", str(target)],
                   cwd=ROOT, check=True)
    assert target.read_text(encoding="utf-8") == reference_markdown()


def test_choices_appear_in_the_reference() -> None:
    rows = _rows(reference_table())
    for f in setting_fields():
        for choice in setting_choices(f):
            assert f"`{choice}`" in rows[f.name]["desc"], (f.name, choice)


def test_choices_come_from_the_literal_types() -> None:
    from typing import get_args

    from kwe_core.profiles import PAD_POLICIES
    from worker.backends.base import BackendName
    from worker.kafka.messages import OutputEncoding
    from worker.logs import LogLevel

    fields = {f.name: f for f in setting_fields()}
    assert setting_choices(fields["pad_to"]) == ("auto", *PAD_POLICIES)
    assert setting_choices(fields["backend"]) == ("auto", *get_args(BackendName))
    assert setting_choices(fields["output_encoding"]) == get_args(OutputEncoding)
    assert setting_choices(fields["log_level"]) == get_args(LogLevel)
    assert setting_choices(fields["max_in_flight"]) == () and setting_choices(fields["profile"]) == ()
    # A Literal setting still reads as a plain string from flags, files and the environment.
    assert load_settings(env={"KWE_PAD_TO": "longest"}).pad_to == "longest"
    with pytest.raises(SettingsError, match="'pad_to': 'middle' is not one of auto, bucket, longest"):
        load_settings(env={"KWE_PAD_TO": "middle"})


# ------------------------------------------------------------------ precedence


def test_precedence_default_file_env_flag(tmp_path: Path) -> None:
    cfg = tmp_path / "kwe.toml"
    cfg.write_text('input_topic = "from-file"\noutput_topic = "from-file"\ngroup_id = "from-file"\n'
                   "max_in_flight = 100\n", encoding="utf-8")
    env = {"KWE_OUTPUT_TOPIC": "from-env", "KWE_GROUP_ID": "from-env", "KWE_MAX_IN_FLIGHT": "200"}
    args = _parse(["--config", str(cfg), "--group-id", "from-flag"])
    s = load_settings(args, env=env)
    assert s.dead_letter_topic == Settings().dead_letter_topic == "keywords-dlq"  # default
    assert s.input_topic == "from-file"  # file over default
    assert s.output_topic == "from-env"  # env over file
    assert s.max_in_flight == 200  # env over file, coerced to int
    assert s.group_id == "from-flag"  # flag over env


def test_config_file_from_env_and_typed_values(tmp_path: Path) -> None:
    cfg = tmp_path / "kwe.toml"
    cfg.write_text('max_queue_delay_ms = 5\nshutdown_timeout_s = 12.5\nlog_level = "debug"\n', encoding="utf-8")
    s = load_settings(None, env={"KWE_CONFIG": str(cfg)})
    assert s.max_queue_delay_ms == 5.0 and isinstance(s.max_queue_delay_ms, float)
    assert s.shutdown_timeout_s == 12.5
    assert s.log_level == "debug"


def test_unset_flags_let_lower_layers_show_through() -> None:
    s = load_settings(_parse([]), env={"KWE_INPUT_TOPIC": "env-topic"})
    assert s.input_topic == "env-topic"
    assert s.output_topic == "embeddings"


# ------------------------------------------------------------------ validation


def _error(**kwargs: object) -> str:
    with pytest.raises(SettingsError) as info:
        load_settings(**kwargs)  # type: ignore[arg-type]
    return str(info.value)


def test_bad_enum_names_the_setting_and_choices() -> None:
    msg = _error(args=_parse(["--backend", "cuda"]), env={})
    assert "'backend'" in msg and "cuda" in msg and "onnxruntime" in msg


def test_bad_enum_from_env_names_the_setting() -> None:
    msg = _error(args=None, env={"KWE_OUTPUT_ENCODING": "base64-f64"})
    assert "'output_encoding'" in msg


def test_negative_int_names_the_setting() -> None:
    msg = _error(args=_parse(["--max-in-flight", "-1"]), env={})
    assert "'max_in_flight'" in msg and "minimum" in msg


def test_non_integer_names_the_setting_and_source() -> None:
    msg = _error(args=None, env={"KWE_DISPATCHERS": "two"})
    assert "'dispatchers'" in msg and "KWE_DISPATCHERS" in msg


def test_port_above_range_fails() -> None:
    assert "'metrics_port'" in _error(args=_parse(["--metrics-port", "70000"]), env={})


def test_non_finite_float_fails() -> None:
    assert "'shutdown_timeout_s'" in _error(args=None, env={"KWE_SHUTDOWN_TIMEOUT_S": "nan"})


def test_unknown_config_file_key_is_named(tmp_path: Path) -> None:
    cfg = tmp_path / "kwe.toml"
    cfg.write_text('input_topc = "typo"\n', encoding="utf-8")
    msg = _error(args=None, env={}, config_file=cfg)
    assert "unknown setting" in msg and "input_topc" in msg and str(cfg) in msg


def test_config_file_wrong_types_are_named(tmp_path: Path) -> None:
    cfg = tmp_path / "kwe.toml"
    cfg.write_text("max_in_flight = true\n", encoding="utf-8")
    assert "'max_in_flight'" in _error(args=None, env={}, config_file=cfg)
    cfg.write_text("max_in_flight = 1.5\n", encoding="utf-8")
    assert "'max_in_flight'" in _error(args=None, env={}, config_file=cfg)
    cfg.write_text("input_topic = 3\n", encoding="utf-8")
    assert "'input_topic'" in _error(args=None, env={}, config_file=cfg)


def test_invalid_toml_and_missing_file_fail_with_the_path(tmp_path: Path) -> None:
    cfg = tmp_path / "kwe.toml"
    cfg.write_text("input_topic = \n", encoding="utf-8")
    assert "not valid TOML" in _error(args=None, env={}, config_file=cfg)
    assert "missing.toml" in _error(args=None, env={}, config_file=tmp_path / "missing.toml")


def test_bad_kafka_config_syntax_fails() -> None:
    msg = _error(args=_parse(["--kafka-config", "security.protocol"]), env={})
    assert "'kafka_config'" in msg and "key=value" in msg
    assert "'kafka_config'" in _error(args=_parse(["--kafka-config", "=SSL"]), env={})


def test_reserved_kafka_keys_are_refused() -> None:
    msg = _error(args=_parse(["--kafka-config", "enable.auto.commit=true"]), env={})
    assert "'kafka_config'" in msg and "enable.auto.commit" in msg
    assert "group_id" in _error(args=None, env={"KWE_KAFKA_CONFIG": "group.id=other"})


def test_settings_built_in_code_are_type_checked() -> None:
    with pytest.raises(SettingsError, match="'max_in_flight'"):
        Settings(max_in_flight="5")  # type: ignore[arg-type]
    with pytest.raises(SettingsError, match="'kafka_config'"):
        Settings(kafka_config=["a=b"])  # type: ignore[arg-type]


def test_settings_command_exits_2_naming_the_setting() -> None:
    out = subprocess.run([sys.executable, "-m", "worker.cli", "settings", "--log-level", "loud"], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 2
    assert "'log_level'" in out.stderr


# ------------------------------------------------------------------ librdkafka passthrough

TLS_SASL = [
    "security.protocol=SASL_SSL",
    "sasl.mechanisms=SCRAM-SHA-512",
    "sasl.username=svc-embedder",
    "sasl.password=p=ss,word",  # '=' inside a value stays in the value
    "ssl.ca.location=/etc/kafka/ca.pem",
]


def test_kafka_config_flags_reach_consumer_and_producer() -> None:
    argv = [x for item in TLS_SASL for x in ("--kafka-config", item)]
    s = load_settings(_parse(argv), env={})
    expected = {"security.protocol": "SASL_SSL", "sasl.mechanisms": "SCRAM-SHA-512",
                "sasl.username": "svc-embedder", "sasl.password": "p=ss,word",
                "ssl.ca.location": "/etc/kafka/ca.pem"}
    assert s.librdkafka_overrides() == expected
    for config in (consumer_config(s), producer_config(s)):
        for key, value in expected.items():
            assert config[key] == value
        assert config["bootstrap.servers"] == s.bootstrap_servers
    # The worker's own commit policy is not overridable.
    assert consumer_config(s)["enable.auto.commit"] is False


def test_kafka_config_from_env_is_comma_separated_with_list_values_kept() -> None:
    s = load_settings(None, env={"KWE_KAFKA_CONFIG": "security.protocol=SSL, debug=cgrp,fetch ,ssl.ca.location=/ca.pem"})
    assert s.librdkafka_overrides() == {"security.protocol": "SSL", "debug": "cgrp,fetch",
                                        "ssl.ca.location": "/ca.pem"}


def test_kafka_config_from_a_config_file_table_and_list(tmp_path: Path) -> None:
    cfg = tmp_path / "kwe.toml"
    cfg.write_text('[kafka_config]\n"security.protocol" = "SSL"\n"ssl.endpoint.identification.algorithm" = "https"\n'
                   '"socket.keepalive.enable" = true\n"fetch.min.bytes" = 1\n', encoding="utf-8")
    s = load_settings(None, env={}, config_file=cfg)
    assert s.librdkafka_overrides() == {"security.protocol": "SSL", "ssl.endpoint.identification.algorithm": "https",
                                        "socket.keepalive.enable": "true", "fetch.min.bytes": "1"}
    cfg.write_text('kafka_config = ["security.protocol=SSL", "sasl.mechanisms = PLAIN"]\n', encoding="utf-8")
    s = load_settings(None, env={}, config_file=cfg)
    assert s.librdkafka_overrides() == {"security.protocol": "SSL", "sasl.mechanisms": "PLAIN"}


def test_kafka_config_flag_replaces_lower_layers() -> None:
    s = load_settings(_parse(["--kafka-config", "security.protocol=SSL"]),
                      env={"KWE_KAFKA_CONFIG": "security.protocol=PLAINTEXT,client.rack=a"})
    assert s.kafka_config == ("security.protocol=SSL",)


def test_librdkafka_accepts_the_passthrough_keys() -> None:
    # librdkafka itself validates property names at construction: a real Producer built
    # from the merged config proves the passthrough keys are ones it knows.
    from confluent_kafka import Producer

    s = Settings(kafka_config=("client.rack=zone-a", "socket.keepalive.enable=true", "security.protocol=plaintext"))
    producer = Producer({k: v for k, v in producer_config(s).items()})
    producer.flush(0)


def test_defaults_are_valid_and_round_trip_as_dict() -> None:
    s = Settings()
    assert dataclasses.asdict(s)["kafka_config"] == ()
    assert s.librdkafka_overrides() == {}
