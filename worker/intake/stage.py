"""Intake: consumed records become in-flight records and bucketer submissions.

Runs on the poll thread only. Each record is tracked by its partition's offsets first (so
nothing can be committed past it), then validated: a rejected record goes to the dead-letter
topic with its reason, a good one is tokenized and submitted. No record leaves intake without
one of the two, and a tokenizer failure on one text dead-letters that text alone. With the
embedding cache on, a repeated keyword (same token IDs) is answered from it at once and goes
straight to the output stage.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import orjson
import structlog
from confluent_kafka import Message

from worker.ledger.inflight import InFlight, InFlightTable
from worker.embedding_cache import EmbeddingCache
from worker.embedding_cache import key as cache_key
from worker.formats.headers import InputHeaders, read_headers
from worker.formats.codec_choice import Decode
from worker.formats.messages import Rejection, decode_input, plain_keyword
from worker.ledger.offsets import OffsetTracker, OffsetWentBack, PartitionOffsets, Refetched, Watermarks
from worker.operations.metrics import Metrics
from worker.settings.schema import Settings

log = structlog.get_logger(__name__)

# A poll's tokenized records, at once (the bucketer's submit_many): their seqs and token IDs.
Submit = Callable[[Sequence[int], Sequence[np.ndarray]], None]
# Records answered from the embedding cache: their seqs and rows, handed to the output stage.
Answer = Callable[[list[int], Any], None]  # seqs and their rows: np.ndarray, or SparseRows
# A rejected record handed to the dead letters (the output's DeadLetters.send): its seq, the record,
# its headers and why. Called once per bad record only; a good record never pays for it.
Reject = Callable[[int, Message, InputHeaders, Rejection], object]


class Intake:
    def __init__(self, settings: Settings, tokenizer: Any, tracker: OffsetTracker, inflight: InFlightTable,
                 submit: Submit, reject: Reject, metrics: Metrics, *,
                 cache: EmbeddingCache[int] | None = None, answer: Answer | None = None,
                 decode: Decode | None = None, watermarks: Watermarks | None = None) -> None:
        self._settings = settings
        # The partition's log start and end from the consumer, read when its offsets go back.
        self._watermarks = watermarks
        self._decode = decode  # None: json or raw, decoded here
        self._tokenizer = tokenizer
        self._tracker = tracker
        self._inflight = inflight
        self._submit = submit
        self._dead_letter = reject
        self._metrics = metrics
        self._cache = cache
        self._answer = answer
        self._next_seq = 0  # the next record's in-flight number
        self.consumed = 0

    def handle(self, msgs: Sequence[Message]) -> None:
        """Records just returned by a poll (consume), handled as one batch: one tokenizer call, one
        in-flight insert, one bucketer submit (a poll of a backlog holds hundreds)."""
        s = self._settings
        polled = time.monotonic()
        now_s = time.time()
        fmt, max_bytes, decode, watermarks = s.input_format, s.max_message_bytes, self._decode, self._watermarks
        # A JSON record that is a plain {"id", "text"} (nearly every one) is read here inline;
        # anything else takes decode_input (or the registry's decoder), which gives the reason.
        loads = orjson.loads if decode is None and fmt == "json" else None
        # Each partition's offset state, looked up once per poll (None: no longer ours).
        parts: dict[tuple[str, int], PartitionOffsets | None] = {}
        seqs: list[int] = []
        qids: list[str] = []
        texts: list[str] = []
        recs: list[InFlight] = []
        timestamps: list[int] = []
        first = seq = self._next_seq
        # A poll's records of a partition come in runs of rising offsets: the first of a run is
        # tracked alone (track() checks it against the partition's state), the ones after it are
        # gathered and tracked together (track_run) once the run ends: at another partition, an
        # offset not above the last, another leader epoch, or the end of the poll.
        run: list[int] = []
        run_part: PartitionOffsets | None = None
        run_epoch: int | None = None
        run_next = 0
        try:
            for msg in msgs:
                tp = (msg.topic(), msg.partition())
                part = parts[tp] if tp in parts else parts.setdefault(tp, self._tracker.get(*tp))
                if part is None:
                    continue  # delivered for a partition no longer ours (revoked between fetch and here)
                offset = msg.offset()
                epoch = msg.leader_epoch()
                if part is run_part and offset >= run_next and epoch == run_epoch:
                    run.append(offset)
                    run_next = offset + 1
                else:
                    if run:
                        run_part.track_run(run, run_epoch)  # type: ignore[union-attr]
                        run = []
                    run_part = None
                    try:
                        part.track(offset, epoch, watermarks)
                    except (Refetched, OffsetWentBack) as exc:
                        part = self._track_again(part, offset, epoch, exc)
                        if part is None:
                            continue
                        parts[tp] = part  # the partition started over (OffsetWentBack): the rest go to its new state
                    run_part, run_epoch, run_next = part, epoch, offset + 1
                key, value = msg.key(), msg.value()
                headers = read_headers(msg)  # never msg.headers(): a header name need not be UTF-8
                size = headers.size
                nbytes = (len(key) if key is not None else 0) + (len(value) if value is not None else 0) + size
                ts_type, ts = msg.timestamp()
                rec = InFlight(part, offset, "", 0, False, ts if ts_type else None, nbytes, msg, headers)
                if ts_type and ts > 0:
                    timestamps.append(ts)
                plain = None
                if loads is not None and value is not None and nbytes <= max_bytes:
                    try:
                        plain = plain_keyword(loads(value))
                    except orjson.JSONDecodeError:
                        pass  # decode_input says which reason
                if plain is None:
                    decoded = (decode_input(key, value, fmt=fmt, max_bytes=max_bytes, headers_bytes=size)  # type: ignore[arg-type]
                               if decode is None else decode(msg.topic(), key, value, headers.headers, size))
                    if isinstance(decoded, Rejection):
                        if run:
                            # Its dead letter may be acknowledged (its offset done) before this poll
                            # ends: the offset must be tracked before it is written.
                            run_part.track_run(run, run_epoch)  # type: ignore[union-attr]
                            run = []
                        self._reject(seq, rec, decoded)
                        seq += 1
                        continue
                    plain = decoded.id, decoded.text
                seqs.append(seq)
                qids.append(plain[0])
                texts.append(plain[1])
                recs.append(rec)
                seq += 1
        finally:
            if run:  # tracked as each record was read, as before: a decoder that raised leaves the same state
                run_part.track_run(run, run_epoch)  # type: ignore[union-attr]
            self._next_seq = seq  # numbers given to records stay given, even when a decoder raised
        consumed = seq - first
        self.consumed += consumed
        self._metrics.count_consumed(consumed)
        if timestamps:
            self._metrics.observe_hop_since("input_to_poll", timestamps, now_s)
        if seqs:
            self._embed(seqs, qids, texts, recs, polled)

    def _track_again(self, part: PartitionOffsets, offset: int, epoch: int,
                     exc: Refetched | OffsetWentBack) -> PartitionOffsets | None:
        """After `part.track` refused a record: None to skip it, or the partition state that now
        tracks it."""
        if isinstance(exc, Refetched):
            # Already in flight or done here, or committed before this owner began: writing it
            # again would duplicate it, even for a read_committed reader.
            if exc.first:
                log.warning("partition fetched again by the client (an offset reset to the log start, or "
                            "a re-fetch); the records already processed are skipped", error=str(exc))
            return None
        # The lower offsets are new records (a recreated topic, a log truncated and rewritten).
        # The partition starts over from here; nothing is skipped.
        log.warning("partition offsets went back: the input log was reset (topic recreated or "
                    "truncated); the records from here on are processed as new", error=str(exc))
        part = self._tracker.restart(part.topic, part.partition)
        part.track(offset, epoch)
        return part

    def _reject(self, seq: int, rec: InFlight, rejection: Rejection) -> None:
        self._inflight.add(seq, rec)
        assert rec.msg is not None
        self._dead_letter(seq, rec.msg, rec.headers, rejection)

    def _embed(self, good_seqs: list[int], qids: list[str], texts: list[str], good_recs: list[InFlight],
               polled: float) -> None:
        try:
            encoded: list[Any] = self._tokenizer.encode(texts)
        except Exception:  # noqa: BLE001 - one bad text must not cost the batch: find it alone
            encoded = []
            for text in texts:
                try:
                    encoded.append(self._tokenizer.encode([text])[0])
                except Exception as exc:  # noqa: BLE001
                    encoded.append(exc)
        special = self._tokenizer.special_tokens
        cache = self._cache
        seqs: list[int] = []
        recs: list[InFlight] = []
        submit_seqs: list[int] = []
        submit_ids: list[np.ndarray] = []
        hits: list[tuple[int, Any]] = []
        for seq, qid, rec, enc in zip(good_seqs, qids, good_recs, encoded):
            if isinstance(enc, Exception):
                self._reject(seq, rec, Rejection("tokenize_error", f"the tokenizer failed on this text: {enc!r}"))
                continue
            if enc.length <= special:
                # Visible to is_blank but nothing to the model (e.g. only combining marks).
                self._reject(seq, rec, Rejection("empty_text", "'text' has no tokens once normalised"))
                continue
            rec.qid, rec.tokens, rec.truncated = qid, enc.length, enc.truncated
            seqs.append(seq)
            recs.append(rec)
            if cache is not None:
                rec.cache_key = cache_key(enc.ids)
                row = cache.get(rec.cache_key)
                if row is not None:
                    # A repeat: answered now, skipping the bucketer and the model; its offset is
                    # still finished only when the output is acknowledged, like any other.
                    hits.append((seq, row))
                    continue
            submit_seqs.append(seq)
            submit_ids.append(enc.ids)
        # In the table before the bucketer or the output stage can finish any of them.
        self._inflight.add_many(seqs, recs)
        if submit_seqs:
            self._submit(submit_seqs, submit_ids)
            self._metrics.observe_hop_repeated("poll_to_submit", time.monotonic() - polled, len(submit_seqs))
        if hits and cache is not None and self._answer is not None:
            # [n, dim] float32, or a sparse model's SparseRows
            self._answer([seq for seq, _ in hits], cache.stack([row for _, row in hits]))
