"""What the database does to a delivery is never charged to its handler (issue 33).

:func:`process_batch` driven directly against the test database: a read-only database (what a
failover shows first) holds the batch, and a serialization failure runs the delivery again in
a new transaction, bounded, before it is charged. The same with real processes, a failover and
real deadlocks: ``tests/e2e/test_database_failover.py``.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from typing import cast

import pytest
from django.db import connection
from django.utils import timezone

from reliable_messaging.conf import messaging_settings
from reliable_messaging.consuming.board import DeliveryWork, WorkBoard
from reliable_messaging.consuming.crash_guard import CrashGuard
from reliable_messaging.consuming.processing import DeliveryProcessor, process_batch
from reliable_messaging.consuming.workers import WorkerPool
from reliable_messaging.core.database_errors import CONFLICT_RETRIES
from reliable_messaging.core.envelope import REPLAY_HEADER
from reliable_messaging.core.outcomes import Acknowledge, ScheduleRetry
from reliable_messaging.exceptions import DatabaseUnavailable
from reliable_messaging.models import DeadLetter, ProcessedMessage
from reliable_messaging.storage import inbox as inbox_claim
from reliable_messaging.storage import partitions
from tests.integration.consuming.test_batching import effects_of, job
from tests.markers import postgresql_only
from tests.testapp import consumers
from tests.testapp.models import Effect

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _fresh_conflict_counts() -> Iterator[None]:
    consumers.CONFLICT_RUNS.clear()
    yield
    consumers.CONFLICT_RUNS.clear()


@pytest.fixture
def read_only_session() -> Iterator[None]:
    """This session's transactions are read-only from now on, as after a failover."""
    with connection.cursor() as cursor:
        cursor.execute("SET SESSION default_transaction_read_only = on")
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute("RESET default_transaction_read_only")


def runs(message_id: str) -> int:
    return consumers.CONFLICT_RUNS.get(("alpha", message_id), 0)


@pytest.mark.parametrize("size", [1, 3])
def test_a_read_only_database_holds_the_batch_and_charges_nothing(
    read_only_session: None, size: int
) -> None:
    """The inbox claim meets SQLSTATE 25006 (an InternalError, not an OperationalError): the
    database's doing, so nothing is decided, whether alone or in a batch."""
    jobs = [job(f"ro-{size}-{n}") for n in range(size)]
    with pytest.raises(DatabaseUnavailable):
        process_batch(jobs)
    with connection.cursor() as cursor:
        cursor.execute("RESET default_transaction_read_only")
    assert not DeadLetter.objects.exists()
    assert process_batch(jobs) == [Acknowledge("processed")] * size


def test_a_serialization_failure_runs_again_in_place_uncharged() -> None:
    [outcome] = process_batch([job("conflict-twice", {"conflict": {"alpha": 2}})])
    assert outcome == Acknowledge("processed")
    assert runs("conflict-twice") == 3
    assert list(Effect.objects.filter(consumer="alpha").values_list("attempt", flat=True)) == [1]


def test_a_conflict_in_a_batch_runs_the_batch_again_and_each_takes_effect_once() -> None:
    jobs = [job("calm-1"), job("conflict-once", {"conflict": {"alpha": 1}}), job("calm-2")]
    assert process_batch(jobs) == [Acknowledge("processed")] * 3
    assert effects_of("calm-1") == effects_of("conflict-once") == effects_of("calm-2") == 1
    assert runs("conflict-once") == 2


def test_a_delivery_that_always_conflicts_is_charged_after_the_bound() -> None:
    """Not retried in place forever: past CONFLICT_RETRIES runs again it is the handler's
    failure (a retry through the outbox, attempt 2), and the rest of its batch commits."""
    [outcome] = process_batch([job("always", {"conflict": {"alpha": -1}})])
    assert isinstance(outcome, ScheduleRetry) and outcome.next_attempt == 2
    assert "serialize" in outcome.error
    assert runs("always") == CONFLICT_RETRIES + 1
    assert effects_of("always") == 0
    assert not ProcessedMessage.objects.exists()


@pytest.fixture
def deferred_table() -> Iterator[None]:
    """``rm_test_deferred``: a unique key checked at commit (``break_at_commit`` breaks it)."""
    with connection.cursor() as cursor:
        cursor.execute("CREATE TABLE rm_test_deferred (k int UNIQUE DEFERRABLE INITIALLY DEFERRED)")
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute("DROP TABLE rm_test_deferred")


@postgresql_only
@pytest.mark.parametrize("size", [1, 3])
def test_a_handler_whose_commit_is_refused_is_charged_and_the_rest_commit(
    deferred_table: None, size: int
) -> None:
    """A constraint checked at commit refuses what the handler wrote: no savepoint can help, so
    it is charged in a transaction of its own (a retry, attempt 2) and the others of its batch
    are decided one by one and commit."""
    broken = job(f"refused-{size}", {"break_at_commit": {"alpha": True}})
    jobs = [job(f"calm-{size}-{n}") for n in range(size - 1)]
    jobs.insert(len(jobs) // 2, broken)
    outcomes = process_batch(jobs)
    charged = outcomes[jobs.index(broken)]
    assert isinstance(charged, ScheduleRetry) and charged.next_attempt == 2
    assert "rm_test_deferred_k_key" in charged.error  # the unique key checked at commit
    assert [o for o in outcomes if o is not charged] == [Acknowledge("processed")] * (size - 1)
    assert effects_of(f"refused-{size}") == 0
    assert all(effects_of(f"calm-{size}-{n}") == 1 for n in range(size - 1))
    assert not ProcessedMessage.objects.filter(message_id=f"refused-{size}").exists()
    assert not DeadLetter.objects.exists()


@pytest.mark.parametrize("path", ["dead_letter_queue", "crash_guard"])
def test_our_own_bookkeeping_on_a_read_only_database_holds_the_delivery(
    read_only_session: None, path: str
) -> None:
    """The ``.dead`` queue's ingestion and the crash guard's mark write before any handler
    runs: on a read-only database they hold the delivery (the worker's DatabaseUnavailable
    path), never count as our own bug nor give the message back at once."""
    processor = cast(DeliveryProcessor, job("bookkeeping").processor)
    delivery = dataclasses.replace(job("bookkeeping").delivery, redelivered=True)
    pool = WorkerPool(
        WorkBoard(1),
        {processor.spec.name: processor},
        concurrency=1,
        settings=messaging_settings,
        crash_guard=CrashGuard(3),
        stop=threading.Event(),
        hand_back=lambda settled: None,
    )
    item = DeliveryWork(
        None,  # type: ignore[arg-type]  # neither link nor channel is used to decide
        None,  # type: ignore[arg-type]
        processor.spec,
        delivery,
        None,
        from_dead_letter_queue=path == "dead_letter_queue",
    )
    with pytest.raises(DatabaseUnavailable):
        pool._attempt([item])
    with connection.cursor() as cursor:
        cursor.execute("RESET default_transaction_read_only")
    assert not DeadLetter.objects.exists()
    assert not Effect.objects.exists()


@pytest.fixture
def no_partition_for_now(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No inbox partition holds this instant, and none can be made on the spot (the upkeep and
    its fallback failing, say for want of the CREATE privilege): today's day is detached for
    the test, then attached again."""
    monkeypatch.setattr(inbox_claim, "ensure_covered", lambda *args, **kwargs: None)
    now = timezone.now()
    [today] = [p for p in partitions.partitions("default") if p.overlaps(now, now)]
    assert today.start is not None and today.end is not None
    with connection.cursor() as cursor:
        cursor.execute(f'ALTER TABLE "{partitions.INBOX_TABLE}" DETACH PARTITION "{today.name}"')
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute(
                f'ALTER TABLE "{partitions.INBOX_TABLE}" ATTACH PARTITION "{today.name}" '
                "FOR VALUES FROM (%s) TO (%s)",
                [today.start, today.end],
            )


@postgresql_only
@pytest.mark.parametrize("path", ["batch", "one_by_one"])
def test_an_inbox_row_with_no_partition_to_go_to_holds_the_delivery(
    no_partition_for_now: None, path: str
) -> None:
    """The claim meets "no partition of relation ... found for row" (a check violation, an
    IntegrityError): the database's state, so nothing is decided; neither a failure charged to
    the handler (the batch path) nor a duplicate acked unhandled (the one-by-one path, where a
    replay goes), which would lose the message."""
    headers = {REPLAY_HEADER: 1} if path == "one_by_one" else None
    jobs = [job(f"np-{path}", headers=headers)]
    with pytest.raises(DatabaseUnavailable):
        process_batch(jobs)
    assert not DeadLetter.objects.exists()
    assert effects_of(f"np-{path}") == 0
