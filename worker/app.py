"""Assembly, the one place: from one Settings object to a ready-to-run Pipeline.

`build_pipeline` loads what the settings name (model, tokenizer, backend, profile, formats);
`wire_pipeline` builds the stages around them and hands them to the Pipeline, which only runs them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog
from confluent_kafka import Consumer, Producer

from worker.backend_choice.costs import cost_model
from worker.backends.base import CPU_BACKENDS, Backend
from worker.backends.isolating import IsolatingBackend
from worker.batching.cost_model import CostModel
from worker.core.errors import BackendError
from worker.core.interpreter_hold import HoldPlan, plan_hold
from worker.core.os_threads import allowed_cpus, signal_stack_kept
from worker.core.model import Prompt
from worker.core.sparse import sparsify
from worker.ledger.acks import Acknowledger
from worker.ledger.guarantees import build_delivery
from worker.ledger.inflight import InFlightTable
from worker.embedding_cache import EmbeddingCache
from worker.formats.codec_choice import Decode, output_codec, registry_formats
from worker.formats.messages import ValueEncoder
from worker.formats.propagation import Propagation
from worker.intake.flow import FlowControl
from worker.intake.stage import Intake
from worker.intake.tokenize import KeywordTokenizer
from worker.ledger.committer import Committer
from worker.kafka.client_config import worker_configs
from worker.kafka.clients import WorkerClients
from worker.ledger.offsets import OffsetTracker
from worker.kafka.reports import REPORTS_COMPILED
from worker.latch import guarded
from worker.operations.health import Liveness
from worker.operations.metrics import Metrics
from worker.output.dead_letters import DeadLetters
from worker.output.stage import OutputStage
from worker.output.tracing import BatchSpans
from worker.pipeline import Pipeline, PollGate, Shutdown, Stages
from worker.settings.schema import Settings

log = structlog.get_logger(__name__)

# A bounded run's poll gate, made from the group member's consumer and the offset tracker.
GateFactory = Callable[[Any, OffsetTracker], PollGate]

# A known-good input for telling a poison keyword from a broken backend (see IsolatingBackend).
CANARY_TEXT = "keyword embedder canary"


@dataclass
class Assembled:
    """A pipeline and the backend it runs on; the caller closes the backend after the pipeline ran."""

    pipeline: Pipeline
    backend: Backend

    def close(self) -> None:
        """Frees the backend (a TensorRT engine, its device memory, the CUDA context it retained).

        Called once the pipeline's run returned, so its dispatchers have closed their contexts.
        A backend that cannot close (a context left open by a dispatcher that never finished)
        is logged, not raised: the process is exiting and the driver frees what is left.
        """
        try:
            self.backend.close()
        except BackendError as exc:
            log.warning("backend not closed cleanly", backend=self.backend.name, error=str(exc))


def build_pipeline(settings: Settings, *, metrics: Metrics | None = None, gate: GateFactory | None = None,
                   on_overrun: Callable[[int], None] | None = None, supervised: bool = False) -> Assembled:
    """Loads the model's tokenizer and the backend the settings ask for, and wires the pipeline.

    The model folder is read once, and the pipeline gets the settings with every "auto"
    resolved (backend, profile, pad_to). `gate` makes a bounded run's poll gate (a backfill's) from
    the group member's consumer and the offset tracker; None for `run`. `supervised`: this process is
    one of a supervisor's (its interpreter_cpu is the supervisor's pick). Raises ModelError /
    BackendError / ProfileError with messages that name the file or setting.
    """
    from worker.backend_choice.select import load_backend, model_info, precision_label
    from worker.batching.calibration import cpu_model

    info = model_info(settings)
    prompt = Prompt.resolve(info, prompt=settings.prompt, prompt_name=settings.prompt_name)
    tokenizer = KeywordTokenizer.from_model(info, prompt=prompt)
    codec = output_codec(settings, info, prompt, tokenizer)  # before the backend: a bad setting fails fast
    # Before the backend too: a registry that is down, or an output schema that is not
    # registered, stops the worker in seconds (SchemaRegistryFailure).
    encoder, decode = registry_formats(settings, codec)
    # A pooling with include_prompt false leaves the prompt's tokens out: the graph is built for them.
    info = info.with_prompt(tokenizer.prompt_tokens)
    # OpenVINO leaves an alternate signal stack on the thread that compiled a model, and auto frees
    # the candidates it refuses: without this, a SIGTERM could land on freed memory (exit 139).
    with signal_stack_kept():
        loaded = load_backend(settings, model=info)
    backend, profile = loaded.backend, loaded.profile
    log.info("backend loaded", backend=backend.name, model=info.name, dim=backend.dim, profile=profile.name,
             pipeline=info.pipeline.describe(),
             buckets=list(profile.bounds), max_len=tokenizer.max_len, pad_to=loaded.settings.pad_to,
             prompt_name=prompt.name, prompt=prompt.text or None, output_dim=codec.dim,
             output_encoding=codec.encoding, fingerprint=codec.fingerprint,
             precision=precision_label(loaded.settings), tokenizer_fast_path=tokenizer.fast_path,
             delivery_reports="compiled" if REPORTS_COMPILED else "python")
    metrics = metrics if metrics is not None else Metrics()
    # Set once the choice is made: the metrics server (and /readyz) only starts after this returns.
    # `reason`: why this backend (auto: what was passed over and measured); `device`: the GPU, where one runs.
    metrics.set_backend_info(backend.name, info.name, profile.name, precision=precision_label(loaded.settings),
                             cpu=cpu_model(), device=str(getattr(backend, "device_name", "") or "cpu"),
                             reason=loaded.reason)
    # Which vectors this worker writes: the fingerprint, with the precision stated beside it.
    metrics.set_model_info(codec.fingerprint, info.name, precision=precision_label(loaded.settings),
                           encoding=codec.encoding, dim=str(codec.dim))
    costs = cost_model(loaded.settings, info, backend)
    if costs is not None:
        metrics.watch_costs(costs)
    # Where the interpreter's threads are held, decided once for the process: `supervised`, it is one
    # of a supervisor's, whose CPU number is where the hold starts (worker/core/interpreter_hold.py).
    hold = plan_hold(loaded.settings.interpreter_cpu, cpu_backend=backend.name in CPU_BACKENDS,
                     supervised=supervised, cpus=allowed_cpus())
    pipeline = wire_pipeline(loaded.settings, tokenizer=tokenizer, backend=backend, profile=profile,
                             model_name=info.name, metrics=metrics, costs=costs, codec=encoder, decode=decode,
                             gate=gate, sparse=info.sparse, on_overrun=on_overrun, hold=hold,
                             identity={"model": info.name, "fingerprint": codec.fingerprint,
                                       "precision": precision_label(loaded.settings)})
    return Assembled(pipeline, backend)


def wire_pipeline(settings: Settings, *, tokenizer: Any, backend: Any, profile: Any, model_name: str,
                  metrics: Metrics | None = None, bucketer_factory: Any = None, costs: CostModel | None = None,
                  consumer_factory: Callable[[dict[str, Any]], Any] = Consumer,
                  producer_factory: Callable[[dict[str, Any]], Any] = Producer,
                  codec: ValueEncoder, decode: Decode | None = None,
                  spans: BatchSpans | None = None, gate: GateFactory | None = None,
                  sparse: bool = False, on_overrun: Callable[[int], None] | None = None,
                  hold: HoldPlan | None = None, identity: dict[str, str] | None = None) -> Pipeline:
    """The stages around a loaded tokenizer and backend, wired into a Pipeline.

    The factories are the tests' seams (fake clients, a fake bucketer). `codec` is the output
    encoder (worker/formats/codec_choice.py: `output_codec`, wrapped by `registry_formats` for the
    registry formats); `decode` a registry format's decoder.
    `sparse`: the backend gives a sparse model's [B, vocabulary] weights, which the output stage
    cuts to their non-zero entries (sparse_top_k, sparse_min_weight) and the cache keeps so.
    """
    from worker.batching.bucketer import Bucketer

    # Built from the highest floor down where one part does not need another: the pipeline's stop
    # state, the spans, the Kafka clients (the settings read once for both) and the ledger that
    # commits through them, then the stages that write through the delivery, down to the bucketer.
    # The Pipeline takes no settings: each stage holds what it was built with.
    metrics = metrics if metrics is not None else Metrics()
    shutdown = Shutdown(settings)
    latch = shutdown.latch
    # What is in flight must drain within a third of the shutdown deadline (see FlowControl).
    flow = FlowControl(settings.max_in_flight, settings.max_in_flight_bytes,
                       drain_target_s=max(1.0, settings.shutdown_timeout_s / 3))
    # One span per batch when an OTLP endpoint is set (the otel extra, imported only then).
    if spans is None and settings.otel_exporter_otlp_endpoint:
        from worker.output.tracing import batch_spans

        spans = batch_spans(settings.otel_exporter_otlp_endpoint, model=model_name)

    inflight = InFlightTable()
    acks = Acknowledger(inflight, metrics)
    committer = Committer(None, interval_s=settings.commit_interval_ms / 1000.0)
    clients = WorkerClients.open(worker_configs(settings), committer, latch, metrics, group=settings.group_id,
                                 topic=settings.input_topic, revoke_wait_s=shutdown.revoke_wait_s,
                                 producer_factory=producer_factory, consumer_factory=consumer_factory)
    producer, member = clients.producer, clients.member
    producer.after_poll(acks.flush)
    delivery = build_delivery(settings, committer, producer, member.client, latch, inflight, metrics,
                              shutdown.commit_by)

    propagation = Propagation.of(settings.pass_headers, settings.trace_context)
    # Repeated keywords are answered from here without the model (0 bytes: off).
    cache = (EmbeddingCache(settings.cache_bytes, backend.dim, observer=metrics, sparse=sparse)
             if settings.cache_bytes else None)
    # Records are written through the delivery's writer (exactly-once wraps the producer).
    dead_letters = DeadLetters(settings.dead_letter_topic, settings.dead_letter_max_bytes, delivery.writer, acks)
    output = OutputStage(settings.output_topic, codec, delivery.writer, inflight, acks, dead_letters, metrics, latch,
                         cache=cache, propagation=propagation, spans=spans, around_batch=delivery.around_batch,
                         sparsify=functools.partial(sparsify, top_k=settings.sparse_top_k,
                                                    min_weight=settings.sparse_min_weight) if sparse else None)
    canary = tokenizer.encode([CANARY_TEXT])[0].ids
    bucketer = (bucketer_factory or Bucketer)(
        profile, IsolatingBackend(backend, canary), output.on_batch, on_error=output.on_batch_error,
        max_queue_delay_ms=settings.max_queue_delay_ms, dispatchers=settings.dispatchers,
        pad_to=settings.pad_to, costs=costs, guard=lambda name, body: guarded(latch, name, body))
    intake = Intake(settings, tokenizer, committer.tracker, inflight, bucketer.submit_many, dead_letters.send, metrics,
                    cache=cache, answer=output.on_cached, decode=decode, watermarks=member.watermarks)
    liveness = Liveness(latch, lambda: [output.thread, producer.thread, *bucketer.threads],
                        committer.stalled_for, settings.stall_timeout_s)
    stages = Stages(inflight=inflight, flow=flow, producer=producer, acks=acks, committer=committer, member=member,
                    delivery=delivery, output=output, bucketer=bucketer, intake=intake, liveness=liveness,
                    spans=spans, gate=gate(member.client, committer.tracker) if gate is not None else None)
    return Pipeline(shutdown, stages, metrics, on_overrun=on_overrun, hold=hold, identity=identity)
