"""Client security without a broker: the properties file, the typed settings and their merge,
secret redaction (settings output, logs, errors), and which Kafka errors stop the worker."""

from __future__ import annotations

import argparse
import io
import logging
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
import structlog
from confluent_kafka import KafkaError

from worker.kafka.client_config import client_config, client_env, read_properties, secret_values
from worker.kafka.client_config import consumer_config, producer_config
from worker.kafka.errors import FailurePolicy, fatal_reason
from worker.operations.logs import configure_logging
from worker.operations.redact import MASK, is_secret_key, redact_text
from worker.settings.loader import add_setting_flags, load_settings
from worker.settings.schema import Settings, SettingsError
from tests.conftest import ROOT

PW = "s3cret-Passw0rd-xyz"


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_setting_flags(parser)
    return parser.parse_args(argv)


def _props(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "client.properties"
    path.write_text(text, encoding="utf-8")
    return path


# ------------------------------------------------------------------ properties file and merge


def test_properties_file_comments_blanks_and_spaces(tmp_path: Path) -> None:
    path = _props(tmp_path, "# Confluent-style client file\n\nsecurity.protocol = SASL_SSL\n! also a comment\n"
                            f"sasl.mechanisms=PLAIN\nsasl.password={PW}\nsasl.password={PW}2\n")
    assert read_properties(path) == {"security.protocol": "SASL_SSL", "sasl.mechanisms": "PLAIN",
                                     "sasl.password": PW + "2"}


def test_properties_file_errors_name_the_line_not_its_content(tmp_path: Path) -> None:
    path = _props(tmp_path, f"security.protocol=SSL\nsasl.password {PW}\n")
    with pytest.raises(SettingsError) as err:
        read_properties(path)
    assert f"{path}:2:" in str(err.value) and PW not in str(err.value)
    with pytest.raises(SettingsError, match="cannot read"):
        read_properties(tmp_path / "missing.properties")


def test_file_then_flags_then_typed_settings_reach_every_client(tmp_path: Path) -> None:
    path = _props(tmp_path, "security.protocol=SASL_SSL\nsasl.mechanism=SCRAM-SHA-512\nlinger.ms=7\n")
    pw = tmp_path / "pw"
    pw.write_text(PW + "\n", encoding="utf-8")
    settings = load_settings(_parse(["--kafka-config-file", str(path), "--kafka-config", "linger.ms=9",
                                     "--sasl-username", "worker", "--sasl-password-file", str(pw)]),
                             env={"KWE_SSL_CA_LOCATION": "/etc/kafka/ca.pem"})
    expected = {"security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512", "linger.ms": "9",
                "sasl.username": "worker", "sasl.password": PW, "ssl.ca.location": "/etc/kafka/ca.pem"}
    assert client_config(settings) == expected
    for config in (consumer_config(settings), producer_config(settings)):
        assert {k: config[k] for k in expected} == expected
    # The children of `demo` get them through the environment, never argv.
    assert client_env(settings)["KWE_SASL_PASSWORD_FILE"] == str(pw)
    assert secret_values(settings) == [PW]


def test_a_typed_setting_that_contradicts_the_file_is_an_error(tmp_path: Path) -> None:
    path = _props(tmp_path, "sasl.mechanisms=PLAIN\n")
    same = Settings(kafka_config_file=str(path), sasl_mechanism="PLAIN")
    assert client_config(same) == {"sasl.mechanism": "PLAIN"}
    with pytest.raises(SettingsError, match="'sasl_mechanism'.*'sasl.mechanisms'.*keep one"):
        client_config(Settings(kafka_config_file=str(path), sasl_mechanism="SCRAM-SHA-512"))
    with pytest.raises(SettingsError) as err:
        client_config(Settings(kafka_config=("sasl.password=a-long-one",), sasl_password=PW))
    assert PW not in str(err.value) and "a-long-one" not in str(err.value)


def test_reserved_keys_refused_in_the_file_and_bad_enums_named(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="bootstrap.servers"):
        client_config(Settings(kafka_config_file=str(_props(tmp_path, "bootstrap.servers=x:9092\n"))))
    with pytest.raises(SettingsError, match="'security_protocol'.*SASL_SSL"):
        load_settings(None, env={"KWE_SECURITY_PROTOCOL": "SASL_SSSL"})
    with pytest.raises(SettingsError, match="both set"):
        Settings(sasl_password=PW, sasl_password_file="/x")
    with pytest.raises(SettingsError, match="is empty"):
        empty = tmp_path / "empty"
        empty.write_text("\n", encoding="utf-8")
        client_config(Settings(sasl_password_file=str(empty)))


# ------------------------------------------------------------------ redaction


@pytest.mark.parametrize("key", ["sasl.password", "ssl.key.password", "ssl.keystore.password", "ssl.key.pem",
                                 "sasl.oauthbearer.client.secret", "sasl.jaas.config", "sasl_password",
                                 "ssl.truststore.password", "sasl.oauthbearer.assertion.private.key.passphrase"])
def test_secret_keys(key: str) -> None:
    assert is_secret_key(key)


@pytest.mark.parametrize("key", ["sasl.username", "ssl.ca.location", "sasl_password_file", "ssl.keystore.location",
                                 "security.protocol", "sasl.oauthbearer.token.endpoint.url"])
def test_not_secret_keys(key: str) -> None:
    assert not is_secret_key(key)


def test_redact_text_by_key_and_by_value() -> None:
    text = (f"sasl.password={PW} ssl.key.password: other1 {{\"sasl.oauthbearer.client.secret\": \"cs-123\"}} "
            f"sasl.jaas.config=org.x.ScramLoginModule required username=\"a\" password=\"{PW}\"; plain {PW}!")
    out = redact_text(text, [PW])
    assert PW not in out and "other1" not in out and "cs-123" not in out
    assert out.count(MASK) >= 4 and "username=\"a\"" in out


def test_settings_output_and_repr_hide_secrets(tmp_path: Path) -> None:
    settings = Settings(sasl_password=PW, kafka_config=(f"ssl.key.password={PW}x", "linger.ms=5"))
    assert PW not in repr(settings) and "linger.ms=5" in repr(settings)
    out = subprocess.run([sys.executable, "-m", "worker.cli", "settings", "--sasl-username", "u",
                          "--kafka-config", f"sasl.password={PW}"], cwd=ROOT, capture_output=True, text=True,
                         env={"KWE_SASL_PASSWORD": PW + "2", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert PW not in out.stdout and "sasl_username = 'u'" in out.stdout
    assert f"sasl_password = '{MASK}'" in out.stdout and f"sasl.password={MASK}" in out.stdout


def test_log_lines_are_redacted_for_structlog_stdlib_and_tracebacks() -> None:
    stream = io.StringIO()
    configure_logging("json", "debug", stream=stream, secrets=[PW])
    log = structlog.get_logger("t")
    log.info("config", sasl_password=PW, config={"sasl.password": PW, "linger.ms": 5})
    log.warning("client said", error=f"connect failed with {PW}")
    logging.getLogger("librdkafka").warning("CONF sasl.password=%s", PW)
    try:
        raise RuntimeError(f"bad password {PW}")
    except RuntimeError:
        log.exception("failed")
    text = stream.getvalue()
    assert PW not in text
    lines = [orjson.loads(line) for line in text.splitlines()]
    assert lines[0]["sasl_password"] == MASK and lines[0]["config"] == {"sasl.password": MASK, "linger.ms": 5}
    assert lines[1]["error"] == f"connect failed with {MASK}"
    assert "RuntimeError" in lines[3]["exception"]


# ------------------------------------------------------------------ which errors are fatal


@pytest.mark.parametrize(("err", "kwargs", "expected"), [
    (KafkaError(KafkaError._AUTHENTICATION, "SASL authentication error: Authentication failed"), {},
     "authentication failed"),
    (KafkaError(KafkaError.SASL_AUTHENTICATION_FAILED), {}, "authentication failed"),
    (KafkaError(KafkaError._SSL, "SSL handshake failed: error:0A000086:SSL routines::certificate verify failed"), {},
     "TLS verification failed"),
    (KafkaError(KafkaError._TRANSPORT, "error:0A000086:SSL routines::certificate verify failed"), {},
     "TLS verification failed"),
    (KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED), {"topic": "keywords", "op": "read"},
     "not authorised to read topic 'keywords'"),
    (KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED), {"topic": "embeddings", "op": "write"},
     "not authorised to write topic 'embeddings'"),
    (KafkaError(KafkaError.CLUSTER_AUTHORIZATION_FAILED, "x", fatal=True), {"topic": "keywords", "op": "write"},
     "not authorised to write topic 'keywords'"),
    (KafkaError(KafkaError.GROUP_AUTHORIZATION_FAILED), {"group": "g"}, "not authorised to use consumer group 'g'"),
    (KafkaError(KafkaError._FATAL, "producer fenced", fatal=True), {}, "fatal Kafka client error"),
])
def test_fatal_reasons(err: KafkaError, kwargs: dict[str, str], expected: str) -> None:
    reason = fatal_reason(err, **kwargs)  # type: ignore[arg-type]
    assert reason is not None and reason.startswith(expected)


@pytest.mark.parametrize("err", [
    KafkaError(KafkaError._ALL_BROKERS_DOWN, "1/1 brokers are down"),
    KafkaError(KafkaError._TRANSPORT, "Connect to ipv4#127.0.0.1:9092 failed: Connection refused"),
    KafkaError(KafkaError._SSL, "SSL transport error: Disconnected"),
    KafkaError(KafkaError._MSG_TIMED_OUT),
    KafkaError(KafkaError.NOT_COORDINATOR),
])
def test_transient_errors_are_not_fatal(err: KafkaError) -> None:
    assert fatal_reason(err, topic="t", op="write") is None


def test_policy_stops_at_once_before_connecting_and_after_a_grace_later() -> None:
    now = [0.0]
    auth = KafkaError(KafkaError._AUTHENTICATION, "SASL authentication error")
    acl = KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED)
    policy = FailurePolicy(later_grace_s=60, later_min_reports=3, clock=lambda: now[0])
    assert policy.decide(auth) is not None  # start-up: the first report
    policy.connected()
    assert policy.decide(acl, topic="t", op="read") is not None  # ACLs: always at once
    assert policy.decide(auth) is None  # running: a credential rotation gets its grace
    now[0] = 30.0
    assert policy.decide(auth) is None
    policy.connected()  # a success in between starts the count again
    now[0] = 95.0
    assert policy.decide(auth) is None and policy.decide(auth) is None
    now[0] = 154.0
    assert policy.decide(auth) is None  # three reports, but not yet 60 s
    now[0] = 155.0
    assert policy.decide(auth) is not None


def test_client_error_is_one_decision_for_every_error_callback() -> None:
    from worker.errors import WorkerError
    from worker.kafka.errors import KafkaSetupError

    policy = FailurePolicy()
    fatal = WorkerError("fatal consumer error")
    refused = policy.client_error(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED), fatal, topic="t", op="read")
    assert isinstance(refused, KafkaSetupError) and "not authorised to read topic 't'" in str(refused)
    fenced = policy.client_error(KafkaError(KafkaError._FATAL, "fenced", fatal=True), fatal)
    assert isinstance(fenced, KafkaSetupError) and str(fenced) == "fatal Kafka client error: fenced"
    assert policy.client_error(KafkaError(KafkaError._TRANSPORT, "Connection refused"), fatal) is None


# ------------------------------------------------------------------ the deploy examples


def test_kubernetes_overlay_and_compose_overlay_mount_the_password_as_a_file() -> None:
    import yaml

    overlay = ROOT / "deploy" / "k8s" / "components" / "secured"
    kustomization = yaml.safe_load((overlay / "kustomization.yaml").read_text(encoding="utf-8"))
    assert kustomization["kind"] == "Component"
    gpu = yaml.safe_load((ROOT / "deploy/k8s/overlays/gpu/kustomization.yaml").read_text(encoding="utf-8"))
    assert "../../components/secured" in (ROOT / "deploy/k8s/overlays/gpu/kustomization.yaml").read_text()
    assert gpu["kind"] == "Kustomization"
    patch = yaml.safe_load((overlay / kustomization["patches"][0]["path"]).read_text(encoding="utf-8"))
    pod = patch["spec"]["template"]["spec"]
    [container] = pod["containers"]
    env = {e["name"]: e.get("value", "from-secret") for e in container["env"]}
    settings = load_settings(None, env=env)  # the real loader: unknown or invalid values fail here
    assert settings.security_protocol == "SASL_SSL" and not settings.sasl_password
    [mount] = container["volumeMounts"]
    [volume] = pod["volumes"]
    assert mount["name"] == volume["name"] and mount["readOnly"]
    assert settings.sasl_password_file.startswith(mount["mountPath"] + "/")
    assert settings.ssl_ca_location.startswith(mount["mountPath"] + "/")
    secret = yaml.safe_load((overlay / "kafka-credentials.example.yaml").read_text(encoding="utf-8"))
    assert secret["metadata"]["name"] == volume["secret"]["secretName"]
    files = {Path(settings.sasl_password_file).name, Path(settings.ssl_ca_location).name}
    assert files <= set(secret["stringData"])

    compose = yaml.safe_load((ROOT / "deploy" / "docker-compose.secured.yml").read_text(encoding="utf-8"))
    for name in ("worker",):
        svc = compose["services"][name]
        env = {k: ("x:9093" if "${" in str(v) else str(v)) for k, v in svc["environment"].items()}
        s = load_settings(None, env=env)
        assert s.sasl_password_file == f"/run/secrets/{svc['secrets'][0]}"
        assert set(svc["secrets"]) <= set(compose["secrets"])
