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

from worker.cli import bool_words
from worker.kafka.client_config import consumer_config, producer_config
from worker.settings.docs import reference_markdown, reference_table
from worker.settings.kafka_overrides import KAFKA_VALUE_RULES, MIN_MESSAGE_TIMEOUT_MS, RESERVED_KAFKA_KEYS
from worker.settings.loader import add_setting_flags, env_name, flag_name, load_settings
from worker.settings.schema import Settings, SettingsError, setting_choices, setting_fields
from tests.conftest import ROOT

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
    return parser.parse_args(bool_words(parser, argv))


# ------------------------------------------------------------------ boolean flags


@pytest.mark.parametrize(("argv", "expected"), [
    ([], True),  # unset: the default shows through
    (["--merge-buckets"], True),
    (["--no-merge-buckets"], False),
    (["--merge-buckets", "false"], False),
    (["--merge-buckets", "true"], True),
    (["--merge-buckets=false"], False),
    (["--merge-buckets=TRUE"], True),
    (["--merge-buckets", "0"], False),
    (["--merge-buckets", "no"], False),
])
def test_boolean_settings_take_the_argparse_spelling_and_the_worded_one(argv: list[str], expected: bool) -> None:
    assert load_settings(_parse(argv), env={}).merge_buckets is expected


def test_a_boolean_flag_overrides_the_environment_both_ways() -> None:
    assert load_settings(_parse(["--no-trace-context"]), env={"KWE_TRACE_CONTEXT": "true"}).trace_context is False
    assert load_settings(_parse(["--schema-auto-register"]),
                         env={"KWE_SCHEMA_AUTO_REGISTER": "false"}).schema_auto_register is True


def test_a_boolean_flag_never_swallows_the_next_argument() -> None:
    parser = argparse.ArgumentParser()
    add_setting_flags(parser, only=("merge_buckets",))
    parser.add_argument("file")
    args = parser.parse_args(bool_words(parser, ["--merge-buckets", "queries.tsv"]))
    assert (args.merge_buckets, args.file) == (True, "queries.tsv")


def test_a_boolean_flag_with_a_word_that_is_no_boolean_is_refused() -> None:
    parser = argparse.ArgumentParser()
    add_setting_flags(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(bool_words(parser, ["--merge-buckets=maybe"]))


def test_every_boolean_setting_has_a_no_flag() -> None:
    parser = argparse.ArgumentParser()
    add_setting_flags(parser)
    options = {o for a in parser._actions for o in a.option_strings}
    booleans = [f.name for f in setting_fields() if isinstance(getattr(Settings(), f.name), bool)]
    assert booleans, "no boolean settings found"
    for name in booleans:
        assert {flag_name(name), "--no-" + flag_name(name)[2:]} <= options


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
            if choice != "":  # "not set here" is said in the help text, not listed as a word
                assert f"`{choice}`" in rows[f.name]["desc"], (f.name, choice)


def test_choices_come_from_the_literal_types() -> None:
    from typing import get_args

    from worker.core.profiles import PAD_POLICIES
    from worker.names import BackendName, OutputEncoding
    from worker.operations.logs import LogLevel

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


REFUSED = [
    "enable.idempotence=false", "enable.idempotence=0", "acks=1", "acks=0", "request.required.acks=1",
    "enable.auto.commit=true", "auto.commit.enable=true", "enable.auto.offset.store=true",
    "partition.assignment.strategy=range", "partition.assignment.strategy=roundrobin",
    "partition.assignment.strategy=cooperative-sticky,range", "isolation.level=read_uncommitted",
    "isolation.level=read_committed", "max.in.flight.requests.per.connection=6", "max.in.flight=1000000",
    "message.timeout.ms=5000", "delivery.timeout.ms=59999", "message.timeout.ms=soon", "transactional.id=kwe-1",
    "group.protocol=consumer", "group.remote.assignor=uniform", "retries=3", "message.send.max.retries=0",
    "queuing.strategy=lifo", "metadata.broker.list=other:9092", "offset.store.method=file", "on_commit=x",
]


@pytest.mark.parametrize("item", REFUSED)
def test_guarantee_breaking_overrides_are_refused_naming_the_key(item: str) -> None:
    key = item.split("=", 1)[0]
    for msg in (_error(args=_parse(["--kafka-config", item]), env={}),
                _error(args=None, env={"KWE_KAFKA_CONFIG": f"security.protocol=SSL,{item}"})):
        assert msg.startswith("setting 'kafka_config'"), msg
        assert repr(key) in msg or f"{key}=" in msg, msg


def test_refusal_says_what_is_allowed() -> None:
    msg = _error(args=_parse(["--kafka-config", "acks=1"]), env={})
    assert "acks='1' is refused: it must be all (or -1)" in msg
    msg = _error(args=_parse(["--kafka-config", "message.timeout.ms=1000"]), env={})
    assert f"at least {MIN_MESSAGE_TIMEOUT_MS}" in msg


def test_dead_letter_limit_must_fit_the_producer_request_limit() -> None:
    msg = _error(args=_parse(["--kafka-config", "message.max.bytes=200000"]), env={})
    assert "'dead_letter_max_bytes'" in msg and "message.max.bytes=200000" in msg and "at most 199488" in msg
    s = load_settings(_parse(["--kafka-config", "message.max.bytes=200000", "--dead-letter-max-bytes", "199488"]),
                      env={})
    assert s.dead_letter_max_bytes == 199488
    assert "'dead_letter_max_bytes'" in _error(args=_parse(["--dead-letter-max-bytes", "4095"]), env={})


ALLOWED = [
    "security.protocol=SASL_SSL", "sasl.mechanisms=SCRAM-SHA-512", "ssl.ca.location=/ca.pem", "linger.ms=50",
    "compression.type=zstd", "fetch.min.bytes=1024", "fetch.wait.max.ms=100", "client.rack=zone-a",
    "enable.idempotence=true", "enable.idempotence=True", "acks=all", "acks=-1", "request.required.acks=all",
    "partition.assignment.strategy=cooperative-sticky", "max.in.flight.requests.per.connection=5",
    "max.in.flight=1", "message.timeout.ms=3600000", "message.timeout.ms=0", "delivery.timeout.ms=60000",
    "enable.gapless.guarantee=true", "enable.gapless.guarantee=false", "group.instance.id=pod-1",
    "queuing.strategy=fifo", "session.timeout.ms=30000", "statistics.interval.ms=1000", "auto.offset.reset=latest",
]


def test_tuning_and_security_overrides_are_allowed_and_librdkafka_takes_them() -> None:
    from confluent_kafka import Consumer, Producer

    for item in ALLOWED:
        s = load_settings(_parse(["--kafka-config", item]), env={})
        assert s.kafka_config == (item,)
    # Every allowed value is one librdkafka accepts in the worker's own clients (security
    # settings aside: SASL_SSL needs credentials to construct).
    tuning = tuple(i for i in ALLOWED if not i.startswith(("security.", "sasl.", "ssl.", "group.instance.id")))
    for item in tuning:
        s = Settings(kafka_config=(item,))
        Producer(producer_config(s)).flush(0)
        Consumer(consumer_config(s)).close()


def test_every_refused_key_is_a_librdkafka_key() -> None:
    # A typo in the tables would refuse nothing: librdkafka must know each key (it raises on unknown ones).
    from confluent_kafka import Consumer, KafkaException, Producer

    samples = {"enable.auto.commit": "false", "auto.commit.enable": "false", "enable.auto.offset.store": "false",
               "isolation.level": "read_committed", "transactional.id": "t", "group.protocol": "classic",
               "group.remote.assignor": "uniform", "retries": "5", "message.send.max.retries": "5",
               "offset.store.method": "broker", "metadata.broker.list": "127.0.0.1:1", "group.id": "g",
               "bootstrap.servers": "127.0.0.1:1"}
    callbacks = {"error_cb", "stats_cb", "throttle_cb", "on_delivery", "on_commit", "logger"}
    for key in set(RESERVED_KAFKA_KEYS) - callbacks:
        cls = Producer if key in ("transactional.id", "retries", "message.send.max.retries") else Consumer
        try:
            cls({"group.id": "g", key: samples[key]})
        except KafkaException as exc:
            raise AssertionError(f"librdkafka refuses {key}: {exc}") from None
    for key in KAFKA_VALUE_RULES:
        cls = Consumer if key == "partition.assignment.strategy" else Producer
        value = {"partition.assignment.strategy": "cooperative-sticky", "queuing.strategy": "fifo",
                 "enable.idempotence": "true"}.get(key, "all" if "acks" in key else "5" if "flight" in key else "60000")
        cls({"group.id": "g", key: value})


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


def test_the_consumer_fetches_small_slices_of_every_partition_unless_kafka_config_says_otherwise() -> None:
    # Slices, so that the records a resume lets in come from every partition (a fair drain);
    # gathered per fetch, so that a steady stream is not hundreds of one-record fetches a second.
    # A user who counts milliseconds or runs one partition at GPU rates sets them back.
    from worker.kafka.client_config import FETCH_MIN_BYTES, FETCH_PARTITION_BYTES, FETCH_QUEUE_BACKOFF_MS, FETCH_WAIT_MS

    config = consumer_config(Settings())
    assert (config["max.partition.fetch.bytes"], config["fetch.min.bytes"], config["fetch.wait.max.ms"]) \
        == (FETCH_PARTITION_BYTES, FETCH_MIN_BYTES, FETCH_WAIT_MS)
    # A full prefetch queue is looked at again within milliseconds, not librdkafka's 1 s: with
    # records of 500 KB a queue holds a few, and tests/system/test_faults_kafka.py's gigabyte of them took
    # 174 s at 1 s, 19 s at 10 ms.
    assert config["fetch.queue.backoff.ms"] == FETCH_QUEUE_BACKOFF_MS <= 50
    # A fetch never waits for more than one partition's slice: a backlog is answered at once.
    assert 1 < FETCH_MIN_BYTES <= FETCH_PARTITION_BYTES <= 64 * 1024 and 0 < FETCH_WAIT_MS <= 20
    s = load_settings(_parse(["--kafka-config", "fetch.min.bytes=1", "--kafka-config", "fetch.wait.max.ms=500",
                              "--kafka-config", "max.partition.fetch.bytes=1048576"]), env={})
    config = consumer_config(s)
    assert (config["fetch.min.bytes"], config["fetch.wait.max.ms"], config["max.partition.fetch.bytes"]) \
        == ("1", "500", "1048576")


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
