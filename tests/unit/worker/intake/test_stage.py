"""The host path a poll at a time (worker/intake/stage.py): a poll with a bad record, a text the
tokenizer fails on and a cached keyword keeps every offset's fate; and the whole worker pipeline
runs broker-free on the benchmark's doubles (benchmarks/host/)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import numpy as np
import orjson
import pytest
from tokenizers import Tokenizer

from benchmarks.host.doubles import MemoryMessage
from worker.core.model import default_model_dir
from worker.ledger.acks import Acknowledger
from worker.ledger.inflight import InFlightTable
from worker.embedding_cache import EmbeddingCache
from worker.embedding_cache import key as cache_key
from worker.errors import WorkerError
from worker.formats.messages import Keyword, Rejection, decode_input
from worker.intake.stage import Intake
from worker.intake.tokenize import KeywordTokenizer
from worker.ledger.offsets import OffsetTracker, OffsetWentBack, Refetched
from worker.operations.metrics import Metrics
from worker.output.dead_letters import DeadLetters
from worker.settings.schema import Settings
from tests.conftest import ROOT

POISON = "tokenizer poison"


class _Tokenizer(KeywordTokenizer):
    """The real tokenizer, failing on one text (a batch holding it fails; alone it fails again)."""

    def encode(self, texts: Any) -> Any:
        if POISON in texts:
            raise RuntimeError("tokenizer bug")
        return super().encode(texts)


class _Writer:
    def __init__(self) -> None:
        self.records: list[tuple[int, str, str, Any]] = []  # (seq, topic, dead-letter reason, ack)

    def write(self, seq: int, topic: str, key: bytes | None, value: bytes, headers: Any, on_delivered: Any) -> bool:
        reason = dict(headers or []).get("kwe-dlq-reason", b"").decode()
        self.records.append((seq, topic, reason, on_delivered))
        return True


def test_a_poll_with_a_bad_record_a_tokenizer_failure_and_a_cache_hit_keeps_every_offsets_fate() -> None:
    tok = _Tokenizer(Tokenizer.from_file(str(default_model_dir() / "tokenizer.json")), 256)
    tracker = OffsetTracker()
    part = tracker.assign("in", 0)
    inflight, metrics = InFlightTable(), Metrics()
    acks = Acknowledger(inflight, metrics)
    writer = _Writer()
    cache: EmbeddingCache[int] = EmbeddingCache(1 << 20, 4)
    cached_row = np.array([1, 0, 0, 0], dtype=np.float32)
    cache.put(cache_key(tok.encode(["used cars"])[0].ids), cached_row)
    submitted: list[tuple[list[int], list[np.ndarray]]] = []
    answered: list[tuple[list[int], np.ndarray]] = []
    intake = Intake(Settings(), tok, tracker, inflight, lambda seqs, ids: submitted.append((list(seqs), list(ids))),
                    DeadLetters("dlq", 1 << 20, writer, acks).send, metrics, cache=cache,  # type: ignore[arg-type]
                    answer=lambda seqs, rows: answered.append((list(seqs), rows)))
    values = [orjson.dumps({"id": "a", "text": "cheap flights"}), b"{not json", orjson.dumps({"id": "b", "text": POISON}),
              orjson.dumps({"id": "c", "text": "used cars"}), orjson.dumps({"id": "d", "text": "running shoes"})]
    intake.handle([MemoryMessage("in", 0, 100 + i, None, v, 0) for i, v in enumerate(values)])

    # Offsets 100..104 are all tracked; none can be committed before its fate is acknowledged.
    assert part.unfinished() == 5 and part.committable() == 100
    assert [(seq, topic, reason) for seq, topic, reason, _ in writer.records] == [
        (1, "dlq", "malformed_json"), (2, "dlq", "tokenize_error")]
    assert [seqs for seqs, _ in submitted] == [[0, 4]], "the two good texts, in one submit"
    assert [len(ids) for ids in submitted[0][1]] == [4, 4]
    (hit_seqs, hit_rows), = answered
    assert hit_seqs == [3] and np.array_equal(hit_rows[0], cached_row)
    assert len(inflight) == 5
    for seq, _, _, ack in writer.records:
        ack()  # the dead letters are acknowledged
    for seq in (0, 3, 4):
        acks.embedded(seq)()
    assert len(inflight) == 3, "an embedding's acknowledgement is finished by the flush after the poll"
    acks.flush()
    assert len(inflight) == 0 and part.unfinished() == 0 and part.committable() == 105
    assert intake.consumed == 5


def test_the_dead_letters_say_why() -> None:
    tok = _Tokenizer(Tokenizer.from_file(str(default_model_dir() / "tokenizer.json")), 256)
    tracker = OffsetTracker()
    tracker.assign("in", 0)
    inflight = InFlightTable()
    writer = _Writer()
    intake = Intake(Settings(), tok, tracker, inflight, lambda seqs, ids: None,
                    DeadLetters("dlq", 1 << 20, writer, Acknowledger(inflight, Metrics())).send, Metrics())  # type: ignore[arg-type]
    intake.handle([MemoryMessage("in", 0, 0, None, b"[1]", 0),
                   MemoryMessage("in", 0, 1, None, orjson.dumps({"id": "x", "text": POISON}), 0)])
    assert [reason for _, _, reason, _ in writer.records] == ["not_an_object", "tokenize_error"]


def test_the_whole_worker_pipeline_runs_broker_free_on_the_benchmark_doubles() -> None:
    out = subprocess.run([sys.executable, "-m", "benchmarks.host.one_run", "--data",
                          str(ROOT / "tests" / "data" / "queries" / "terabyte05-20k.tsv"), "--n", "600",
                          "--warmup", "200", "--warmup-s", "0"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["exit"] == 0 and result["keywords_per_s"] > 0 and 0 < result["n"] <= 600
    # Every keyword's output was produced: float-list JSON of 384 numbers each.
    assert result["produced_value_bytes"] > 800 * 384 * 2
    assert {"poll", "kwe-output", "kwe-delivery", "kwe-bucket-former"} <= set(result["threads_us_per_keyword"])


def _intake_parts() -> tuple[KeywordTokenizer, OffsetTracker, InFlightTable, Metrics, _Writer]:
    """The real tokenizer, partition in[0] assigned, an empty in-flight table and a recording writer."""
    tracker = OffsetTracker()
    tracker.assign("in", 0)
    return (KeywordTokenizer(Tokenizer.from_file(str(default_model_dir() / "tokenizer.json")), 256), tracker,
            InFlightTable(), Metrics(), _Writer())


# Records for the inline JSON read against decode_input: the plain ones it takes itself, and every
# other shape, which must reach decode_input and get the same keyword or the same reason.
INTAKE_VALUES: list[tuple[bytes | None, bytes | None]] = [
    (b"k", orjson.dumps({"id": "a", "text": "cheap flights"})),
    (b"k", orjson.dumps({"id": "b", "text": "café au lait", "extra": [1, 2]})),
    (None, orjson.dumps({"id": "c", "text": "éclair recipe"})),  # first character not ASCII: the full check
    (b"k", orjson.dumps({"id": "d", "text": "  leading spaces"})),
    (b"k", orjson.dumps({"id": "e", "text": "\u200b\u200b"})),  # invisible only: empty_text
    (b"k", orjson.dumps({"id": "f", "text": " \t "})),
    (b"k", orjson.dumps({"id": "", "text": "shoes"})),
    (b"k", orjson.dumps({"id": 7, "text": "shoes"})),
    (b"k", orjson.dumps({"id": "g"})),
    (b"k", orjson.dumps({"text": "shoes"})),
    (b"k", orjson.dumps({"id": "h", "text": ["shoes"]})),
    (b"k", orjson.dumps([{"id": "i", "text": "shoes"}])),
    (b"k", b"{not json"),
    (b"k", b"\xff\xfe{}"),
    (b"k", None),
    (b"k" * 60, orjson.dumps({"id": "j", "text": "x" * 30})),  # oversized by its key (limit 100 below)
    (b"k", orjson.dumps({"id": "l", "text": "x" * 80})),  # 95 bytes with its key: within the limit
    (b"k", orjson.dumps({"id": "m", "text": "9 to 5"})),
]


def test_the_inline_json_read_keeps_what_decode_input_would_say_of_every_record() -> None:
    tok, tracker, inflight, metrics, writer = _intake_parts()
    submitted: list[tuple[list[int], list[np.ndarray]]] = []
    settings = Settings(max_message_bytes=100)
    intake = Intake(settings, tok, tracker, inflight, lambda seqs, ids: submitted.append((list(seqs), list(ids))),
                    DeadLetters("dlq", 1 << 20, writer, Acknowledger(inflight, metrics)).send, metrics)  # type: ignore[arg-type]
    intake.handle([MemoryMessage("in", 0, i, k, v, 0) for i, (k, v) in enumerate(INTAKE_VALUES)])

    dead = {seq: reason for seq, _, reason, _ in writer.records}
    texts: dict[int, list[int]] = {}
    expected_dead: dict[int, str] = {}
    for seq, (key, value) in enumerate(INTAKE_VALUES):
        got = decode_input(key, value, fmt="json", max_bytes=100)
        if isinstance(got, Rejection):
            expected_dead[seq] = got.reason
        else:
            texts[seq] = tok.encode([got.text])[0].ids.tolist()
            assert inflight.get(seq) is not None and inflight.get(seq).qid == got.id  # type: ignore[union-attr]
    assert dead == expected_dead
    assert {"not_utf8", "malformed_json", "oversized", "empty_text", "empty_id", "null_value"} <= set(dead.values())
    [(seqs, ids)] = submitted
    assert {seq: row.tolist() for seq, row in zip(seqs, ids)} == texts
    # Every record has its number once, in consumption order, and stays tracked until its fate.
    assert sorted(seqs + list(dead)) == list(range(len(INTAKE_VALUES)))
    assert tracker.get("in", 0).unfinished() == len(INTAKE_VALUES)  # type: ignore[union-attr]


class _EpochMessage(MemoryMessage):
    __slots__ = ("_epoch",)

    def __init__(self, partition: int, offset: int, epoch: int | None) -> None:
        super().__init__("in", partition, offset, b"k", orjson.dumps({"id": f"{partition}-{offset}", "text": "shoes"}), 0)
        self._epoch = epoch

    def leader_epoch(self) -> int | None:  # type: ignore[override]
        return self._epoch


def _offset_state(tracker: OffsetTracker, partition: int) -> tuple[Any, ...]:
    part = tracker.get("in", partition)
    assert part is not None
    return (list(map(list, part._order)), sorted(part._cells), part.epoch_runs(), part._next, part._first,
            part._refetch_at, part.unfinished())


def _pairs(poll: list[_EpochMessage]) -> list[tuple[int, int]]:
    return [(m.partition(), m.offset()) for m in poll]


@pytest.mark.parametrize("seed", range(12))
def test_tracking_a_polls_runs_together_leaves_each_partition_as_tracking_each_record_would(seed: int) -> None:
    # Polls of three partitions, interleaved, with gaps (compaction, transaction markers), leader
    # epochs that change (and a partition without one), re-fetched records and offsets that go back
    # (partition 2's log ends below what was read on odd seeds: a reset, not a re-fetch).
    rng = np.random.default_rng(seed)
    tok, tracker, inflight, metrics, writer = _intake_parts()
    reference = OffsetTracker()
    for p in (1, 2):
        tracker.assign("in", p)
    for p in (0, 1, 2):
        reference.assign("in", p)
    log_end = {0: 10_000, 1: 10_000, 2: 10_000 if seed % 2 else 0}

    def watermarks(topic: str, partition: int) -> tuple[int, int]:
        return 0, log_end[partition]

    intake = Intake(Settings(), tok, tracker, inflight, lambda seqs, ids: None,
                    DeadLetters("dlq", 1 << 20, writer, Acknowledger(inflight, metrics)).send, metrics,  # type: ignore[arg-type]
                    watermarks=watermarks)
    position = {0: 0, 1: 100, 2: 5}
    epoch: dict[int, int | None] = {0: 3, 1: None, 2: 1}
    runs = went_back = 0
    for _ in range(25):
        poll = []
        for _ in range(int(rng.integers(1, 40))):
            p = int(rng.integers(0, 3))
            roll = rng.random()
            if roll < 0.08:
                position[p] = max(0, position[p] - int(rng.integers(1, 6)))  # a re-fetch, or the log went back
            elif roll < 0.16:
                position[p] += int(rng.integers(1, 4))  # a gap
            elif roll < 0.2 and epoch[p] is not None:
                epoch[p] += 1  # type: ignore[operator]  # a new leader
            poll.append(_EpochMessage(p, position[p], epoch[p]))
            position[p] += 1
        first = intake._next_seq
        intake.handle(poll)
        got = [(rec.part.partition, rec.offset) for seq in range(first, intake._next_seq)
               if (rec := inflight.get(seq)) is not None]
        expected: list[tuple[int, int]] = []
        for msg in poll:  # what the loop did before runs: track() each record, and its fallbacks
            part = reference.get("in", msg.partition())
            assert part is not None
            try:
                part.track(msg.offset(), msg.leader_epoch(), watermarks)
            except Refetched:
                continue
            except OffsetWentBack:
                part = reference.restart("in", msg.partition())
                part.track(msg.offset(), msg.leader_epoch())
            expected.append((msg.partition(), msg.offset()))
        assert got == expected
        for p in (0, 1, 2):
            assert _offset_state(tracker, p) == _offset_state(reference, p)
        pairs = _pairs(poll)
        runs += sum(a[0] == b[0] and b[1] == a[1] + 1 for a, b in zip(got, got[1:]))
        went_back += sum(a[0] == b[0] and b[1] <= a[1] for a, b in zip(pairs, pairs[1:]))
    assert runs > 50 and went_back > 3  # runs, and offsets that go back, were there to track


class _AckingWriter(_Writer):
    """Acknowledges each dead letter as it is written, as a fast broker can before the poll ends."""

    def write(self, seq: int, topic: str, key: bytes | None, value: bytes, headers: Any, on_delivered: Any) -> bool:
        super().write(seq, topic, key, value, headers, on_delivered)
        on_delivered()
        return True


def test_a_dead_letter_acknowledged_before_its_poll_ends_has_its_offset_done() -> None:
    # Bad records in the middle of a run of one partition's offsets: each dead letter is acknowledged
    # at once (its offset done); the offset was tracked before, so the commit point passes it.
    tok, tracker, inflight, metrics, _ = _intake_parts()
    writer = _AckingWriter()
    intake = Intake(Settings(), tok, tracker, inflight, lambda seqs, ids: None,
                    DeadLetters("dlq", 1 << 20, writer, Acknowledger(inflight, metrics)).send, metrics)  # type: ignore[arg-type]
    values = [b"{not json" if i % 4 == 2 else orjson.dumps({"id": f"q{i}", "text": "shoes"}) for i in range(20)]
    intake.handle([MemoryMessage("in", 0, i, b"k", v, 0) for i, v in enumerate(values)])
    part = tracker.get("in", 0)
    assert part is not None and len(writer.records) == 5
    assert part.unfinished() == 15  # the five dead letters are done; the fifteen embeddings in flight
    for seq in range(20):
        rec = inflight.get(seq)
        if rec is not None:
            part.done(rec.offset)
    assert part.unfinished() == 0 and part.committable() == 20


def test_a_decoder_that_raises_mid_poll_leaves_no_number_given_twice() -> None:
    tok, tracker, inflight, metrics, writer = _intake_parts()

    def decode(topic: str, key: bytes | None, value: bytes | None, headers: Any, size: int) -> Any:
        if value == b"registry down":
            raise WorkerError("the registry is unreachable")
        if value == b"bad":
            return Rejection("malformed_json", "not a record")
        return Keyword("q", value.decode())  # type: ignore[union-attr]

    intake = Intake(Settings(), tok, tracker, inflight, lambda seqs, ids: None,
                    DeadLetters("dlq", 1 << 20, writer, Acknowledger(inflight, metrics)).send, metrics,  # type: ignore[arg-type]
                    decode=decode)
    with pytest.raises(WorkerError, match="registry"):  # the registry's failure stops the worker, as before
        intake.handle([MemoryMessage("in", 0, 0, None, b"bad", 0), MemoryMessage("in", 0, 1, None, b"registry down", 0)])
    intake.handle([MemoryMessage("in", 0, 2, None, b"bad", 0), MemoryMessage("in", 0, 3, None, b"shoes", 0)])
    # The first poll's dead letter keeps number 0 (the record the decoder failed on got none); the
    # second poll's records are numbered after it, so no two in-flight records share a number.
    assert [seq for seq, _, _, _ in writer.records] == [0, 1]
    assert {seq: inflight.get(seq).offset for seq in range(3)} == {0: 0, 1: 2, 2: 3}  # type: ignore[union-attr]
    assert inflight.get(3) is None
    # Every record read stays tracked, the one the decoder failed on too (its offset is never done,
    # so nothing past it is committed), as when each record was tracked before it was decoded.
    assert tracker.get("in", 0).unfinished() == 4  # type: ignore[union-attr]


def test_paired_ratios_take_the_order_of_a_round_out_once_both_orders_ran() -> None:
    from benchmarks.host.pipeline_bench import paired_ratios

    # The second run of a round reads 10% faster whichever side it is: a/b is 1.1 with b first
    # and 1/1.1 with a first, and the sides are equal.
    rounds = [{"order": ["a", "b"] if r % 2 == 0 else ["b", "a"],
               "sides": {"a": {"kw": 100.0 if r % 2 == 0 else 110.0}, "b": {"kw": 110.0 if r % 2 == 0 else 100.0}}}
              for r in range(6)]
    got = paired_ratios(rounds, "a", "b", "kw")
    assert got["balanced"] == pytest.approx(1.0)
    assert got["a first"] == pytest.approx(100 / 110) and got["b first"] == pytest.approx(1.1)
    one_order = paired_ratios(rounds[::2], "a", "b", "kw")
    assert "balanced" not in one_order and one_order["median"] == pytest.approx(100 / 110)
