"""Failed writes of the open transaction (worker/ledger/exactly_once/write_failures.py): the first
reason kept from any thread, taken once; the member stopped at the WRITE_FAILURES-th failed
transaction in a row; the wait before a retry doubled each time and reset by a commit."""

from __future__ import annotations

import threading

from worker.ledger.exactly_once.write_failures import WRITE_FAILURES, WRITE_RETRY_BACKOFF_S, WriteFailures


def test_the_first_reason_reported_is_kept_and_taken_once() -> None:
    failures = WriteFailures()
    assert not failures.pending() and failures.take() is None
    failures.report("delivery failed: broker down")
    failures.report("a later failure of the same transaction")
    assert failures.pending()
    assert failures.take() == "delivery failed: broker down"
    assert not failures.pending() and failures.take() is None


def test_reports_from_several_threads_leave_exactly_one_reason() -> None:
    failures = WriteFailures()
    start = threading.Barrier(8)

    def report(i: int) -> None:
        start.wait()
        failures.report(f"thread {i}")

    threads = [threading.Thread(target=report, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    reason = failures.take()
    assert reason is not None and reason.startswith("thread ")
    assert failures.take() is None


def test_the_member_stops_at_the_last_failed_transaction_in_a_row_and_a_commit_resets_the_count() -> None:
    failures = WriteFailures()
    assert [failures.count() for _ in range(WRITE_FAILURES)] == [True] * (WRITE_FAILURES - 1) + [False]
    failures.committed()
    assert failures.in_row == 0 and failures.count()


def test_the_wait_before_a_retry_doubles_with_each_failure_in_a_row() -> None:
    failures = WriteFailures()
    waits = []
    for _ in range(3):
        failures.count()
        failures.back_off(now=100.0)
        waits.append(failures.resume_at - 100.0)
    assert waits == [WRITE_RETRY_BACKOFF_S, 2 * WRITE_RETRY_BACKOFF_S, 4 * WRITE_RETRY_BACKOFF_S]
    failures.committed()
    failures.count()
    failures.back_off(now=200.0)
    assert failures.resume_at == 200.0 + WRITE_RETRY_BACKOFF_S
