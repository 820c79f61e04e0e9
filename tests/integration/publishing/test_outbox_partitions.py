"""The outbox partitioned on PostgreSQL: unsent rows in a partition of their own (the only one
the relay reads), sent rows by day, dropped whole once expired; an idempotency key found in
every partition; a row moved to the sent side under a concurrent claim."""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from typing import Any
from unittest import mock

import pytest
from django.db import DatabaseError, connection, transaction
from django.db.backends.utils import CursorWrapper
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from reliable_messaging import publish
from reliable_messaging.choices import OutboxStatus
from reliable_messaging.models import OutboxMessage
from reliable_messaging.publishing import claims, scheduled, sent
from reliable_messaging.publishing.claims import OutboxClaims
from reliable_messaging.publishing.relay import RelayReport, build_relay
from reliable_messaging.storage import partitions
from reliable_messaging.storage.partitions import OUTBOX, OUTBOX_TABLE, OUTBOX_UNSENT
from reliable_messaging.storage.retention import purge_messages
from tests.markers import postgresql_only

from .conftest import OutboxEnv

pytestmark = [
    pytest.mark.django_db(transaction=True),
    postgresql_only,
]

DAY = dt.timedelta(days=1)


def today() -> dt.date:
    return timezone.now().astimezone(dt.UTC).date()


def relay_once() -> RelayReport:
    return build_relay(once=True).run()


def where(message_id: str) -> str:
    """The partition holding the row."""
    with connection.cursor() as cursor:
        cursor.execute(
            f"SELECT tableoid::regclass::text FROM {OUTBOX_TABLE} WHERE message_id = %s",
            [message_id],
        )
        (found,) = cursor.fetchall()
    return str(found[0])


def sent_row(message_id: str, sent_at: dt.datetime, status: str = "sent") -> None:
    OutboxMessage.objects.create(
        message_id=message_id,
        routing_key="x",
        body="{}",
        status=status,
        sent_at=sent_at,
        next_attempt_at=None,
    )


def test_unsent_rows_stay_in_their_partition_and_sent_ones_move_to_their_day(
    ob: OutboxEnv,
) -> None:
    ob.set(OUTBOX_MAX_ATTEMPTS=1, REQUIRE_ROUTE=["command.#"])
    queue = ob.queue(bindings=["event.delivered"])
    with transaction.atomic():
        delivered = publish("event.delivered", {"n": 1})
        unrouted = publish("event.nobody", {"n": 2})
        failed = publish("command.nobody", {"n": 3})
    assert {where(m) for m in (delivered, unrouted, failed)} == {OUTBOX_UNSENT}
    relay_once()
    assert ob.broker.drain(queue, expected=1)[0].message_id == delivered
    day = partitions.day_name(today(), OUTBOX)
    assert where(delivered) == day
    assert where(unrouted) == day
    assert OutboxMessage.objects.get(message_id=failed).status == OutboxStatus.FAILED
    assert where(failed) == OUTBOX_UNSENT


def test_the_relay_reads_and_writes_the_unsent_partition_only(ob: OutboxEnv) -> None:
    """With days of sent rows beside them, the relay's statements are planned on the unsent
    partition alone: their cost does not grow with the history."""
    partitions.ensure_partitions("default", now=timezone.now() - 5 * DAY, spec=OUTBOX)
    for days_ago in range(6):
        sent_row(f"old-{days_ago}", timezone.now() - days_ago * DAY)
    ob.queue()
    with transaction.atomic():
        keyed = [publish("a.b", {"n": n}, ordering_key="K") for n in range(3)]
    seen: list[tuple[str, Any]] = []
    real = CursorWrapper._execute  # type: ignore[attr-defined]

    def record(self: CursorWrapper, sql: str, params: Any, *args: Any) -> Any:
        seen.append((sql, params))  # from every thread: the relay's workers have their own
        return real(self, sql, params, *args)

    with mock.patch.object(CursorWrapper, "_execute", record):
        relay_once()
    statements = [
        (sql, params)
        for sql, params in seen
        if "outboxmessage" in sql and sql.split()[0] in ("SELECT", "UPDATE")
    ]
    assert any(sql.startswith("UPDATE") for sql, _ in statements)
    for sql, params in statements:
        with connection.cursor() as cursor:
            cursor.execute(f"EXPLAIN {sql}", params)
            plan = "\n".join(row[0] for row in cursor.fetchall())
        assert "_p20" not in plan, (sql, plan)
    assert {where(m) for m in keyed} == {partitions.day_name(today(), OUTBOX)}


def test_an_idempotency_key_is_found_after_its_message_was_sent(ob: OutboxEnv) -> None:
    """A unique index spans one partition: without the lookup in every partition, the key of
    a message already sent (moved out of the unsent partition) would be published again."""
    queue = ob.queue()
    with transaction.atomic():
        first = publish("a.b", {"n": 1}, idempotency_key="order-7")
    relay_once()
    assert where(first) == partitions.day_name(today(), OUTBOX)
    with transaction.atomic():
        again = publish("a.b", {"n": 1}, idempotency_key="order-7")
    assert again == first
    assert OutboxMessage.objects.filter(idempotency_key="order-7").count() == 1
    assert relay_once().sent == 0
    assert [m.message_id for m in ob.broker.drain(queue, expected=1)] == [first]


def test_two_publishes_of_one_key_at_once_write_one_row(ob: OutboxEnv) -> None:
    """The second waits for the first's transaction, then finds its row."""
    holding = threading.Event()
    release = threading.Event()
    results: dict[str, str] = {}

    def first() -> None:
        try:
            with transaction.atomic():
                results["first"] = publish("a.b", {"n": 1}, idempotency_key="k-race")
                holding.set()
                release.wait(10)
        finally:
            connection.close()

    thread = threading.Thread(target=first)
    thread.start()
    try:
        assert holding.wait(10)
        second: dict[str, str] = {}

        def publish_second() -> None:
            try:
                with transaction.atomic():
                    second["id"] = publish("a.b", {"n": 2}, idempotency_key="k-race")
            finally:
                connection.close()

        waiter = threading.Thread(target=publish_second)
        waiter.start()
        waiter.join(1.0)
        assert waiter.is_alive(), "the second publish did not wait for the first"
        release.set()
        waiter.join(10)
    finally:
        release.set()
        thread.join(10)
    assert second["id"] == results["first"]
    assert OutboxMessage.objects.filter(idempotency_key="k-race").count() == 1


def moved_error() -> DatabaseError:
    """PostgreSQL's own error for a row locked after a concurrent transaction moved it to
    another partition: a claim whose snapshot still sees the row pending reaches it (slowed
    here by pg_sleep) after the row was marked sent and committed. The race is tried again
    with a longer sleep if the move came too late (a loaded machine): then the claim locked
    the row first and the move waited for it."""
    for sleep in (1.0, 3.0, 6.0):
        caught = _race_a_claim_with_a_move(sleep)
        if caught is not None:
            return caught
    raise AssertionError("the race did not happen in three tries")


def _race_a_claim_with_a_move(sleep: float) -> DatabaseError | None:
    OutboxMessage.objects.create(message_id="race", routing_key="x", body="{}")
    caught: list[DatabaseError] = []
    started = threading.Event()
    claim_sql = (
        f"SELECT id FROM {OUTBOX_TABLE} WHERE status = 'pending' "
        f"AND pg_sleep({sleep}) IS NOT NULL FOR UPDATE SKIP LOCKED"
    )

    def claim() -> None:
        try:
            with transaction.atomic():
                started.set()
                with connection.cursor() as cursor:
                    cursor.execute(claim_sql)
        except DatabaseError as exc:
            caught.append(exc)
        finally:
            connection.close()

    thread = threading.Thread(target=claim)
    thread.start()
    assert started.wait(5)
    # The claim's statement must have its snapshot (be running, asleep on the row) before the
    # row is sent; on a loaded machine the thread may not even have sent it yet.
    deadline = time.monotonic() + 10
    while True:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE state = 'active' "
                "AND pid <> pg_backend_pid() AND query LIKE %s",
                [f"%pg_sleep({sleep}) IS NOT NULL FOR UPDATE%"],
            )
            if cursor.fetchone()[0]:
                break
        assert time.monotonic() < deadline, "the claim never started"
        time.sleep(0.01)
    with transaction.atomic():
        OutboxMessage.objects.filter(message_id="race", status="pending").update(
            status="sent", sent_at=timezone.now()
        )
    thread.join(sleep + 10)
    assert not thread.is_alive()
    OutboxMessage.objects.filter(message_id="race").delete()
    return caught[0] if caught else None


def test_a_claim_that_meets_a_row_moved_meanwhile_claims_again(ob: OutboxEnv) -> None:
    error = moved_error()
    assert partitions.row_moved(error)
    assert "moved to another partition" in str(error)
    queue = ob.queue()
    with transaction.atomic():
        ids = [publish("a.b", {"n": n}) for n in range(5)]
    real = OutboxClaims._select
    calls = {"n": 0}

    def select(self: OutboxClaims) -> list[tuple[Any, ...]]:
        calls["n"] += 1
        if calls["n"] == 1:
            raise error
        return real(self)

    relay = build_relay(once=True)
    with mock.patch.object(OutboxClaims, "_select", select):
        report = relay.run()
    assert report.sent == 5
    assert not [r for r in relay.health.check()[1] if "database" in r]
    assert sorted(m.message_id for m in ob.broker.drain(queue, expected=5)) == sorted(ids)


def test_a_promotion_or_release_that_meets_a_row_moved_meanwhile_runs_again(
    ob: OutboxEnv, caplog: pytest.LogCaptureFixture
) -> None:
    """Relays beside one another (``consume`` runs one, and so may ``relay``): one promotes a
    due scheduled row, or sends a released one, while another's statement still sees it where
    it was. That is a row moved, not the database gone: run again, no outage said, nothing
    left behind."""
    error = moved_error()
    queue = ob.queue()
    due = publish("a.b", {"n": "scheduled"}, deliver_at=timezone.now() - dt.timedelta(seconds=1))
    real_promote, real_release = scheduled._promote, claims._release_parked
    calls = {"promote": 0, "release": 0}

    def promote(*args: Any) -> int:
        calls["promote"] += 1
        if calls["promote"] == 1:
            raise error
        return real_promote(*args)

    def release(*args: Any) -> tuple[int, int | None]:
        calls["release"] += 1
        if calls["release"] == 1:
            raise error
        return real_release(*args)

    caplog.set_level(logging.DEBUG, logger="reliable_messaging.relay")
    relay = build_relay(once=True)
    with (
        mock.patch.object(scheduled, "_promote", promote),
        mock.patch.object(claims, "_release_parked", release),
    ):
        report = relay.run()
    said = [r.getMessage() for r in caplog.records if "database" in r.getMessage()]
    assert said == [], said
    assert (report.sent, calls["promote"] > 1, calls["release"] > 1) == (1, True, True)
    assert not [r for r in relay.health.check()[1] if "database" in r]
    assert [m.message_id for m in ob.broker.drain(queue, expected=1)] == [due]


def test_purge_drops_expired_days_of_sent_rows_whole_and_keeps_every_unsent_row(
    ob: OutboxEnv,
) -> None:
    ob.set(OUTBOX_RETENTION=DAY)
    partitions.ensure_partitions("default", now=timezone.now() - 10 * DAY, spec=OUTBOX)
    partitions.ensure_partitions("default", now=timezone.now() - 5 * DAY, spec=OUTBOX)
    for days_ago in (9, 8, 3):
        for n in range(4):
            sent_row(f"d{days_ago}-{n}", timezone.now() - days_ago * DAY)
    sent_row("unrouted-9", timezone.now() - 9 * DAY, status="unrouted")
    sent_row("recent", timezone.now())
    old_failed = OutboxMessage.objects.create(
        message_id="old-failed", routing_key="x", body="{}", status="failed"
    )
    OutboxMessage.objects.filter(pk=old_failed.pk).update(created_at=timezone.now() - 30 * DAY)
    OutboxMessage.objects.create(message_id="pending", routing_key="x", body="{}")
    old = [partitions.day_name(today() - n * DAY, OUTBOX) for n in range(11, 1, -1)]
    with CaptureQueriesContext(connection) as queries:
        result = purge_messages()
    deletes = [q["sql"] for q in queries.captured_queries if q["sql"].startswith("DELETE")]
    assert not [sql for sql in deletes if "outboxmessage" in sql], deletes
    remaining = [p.name for p in partitions.partitions("default", OUTBOX)]
    assert not set(old) & set(remaining), remaining
    assert partitions.day_name(today() - DAY, OUTBOX) in remaining
    assert set(result.outbox_partitions) == set(old)
    assert result.outbox == 13  # in the dropped days (never analyzed: counted)
    assert set(OutboxMessage.objects.values_list("message_id", flat=True)) == {
        "recent",
        "old-failed",
        "pending",
    }


def test_the_relay_makes_the_coming_days_partitions(ob: OutboxEnv) -> None:
    name = partitions.day_name(today() + partitions.AHEAD_DAYS * DAY, OUTBOX)
    with connection.cursor() as cursor:
        cursor.execute(f'DROP TABLE "{name}"')
    code, log = ob.run_relay_once()
    assert code == 0, log
    assert name in [p.name for p in partitions.partitions("default", OUTBOX)]


@pytest.fixture(autouse=True)
def coming_days_ready() -> None:
    """The partitions a new installation has (a purge run by an earlier test with a clock far
    ahead may have dropped them)."""
    partitions.ensure_partitions("default", spec=OUTBOX)


def test_an_outcome_that_meets_a_row_moved_meanwhile_is_written_again_keeping_its_rows_locked(
    ob: OutboxEnv,
) -> None:
    """The write of a batch's outcome, in the claim's transaction that holds the rows, meets a
    row another relay moved (the next row of a key, say): it runs again in a savepoint of that
    transaction. Rolling the transaction back instead let the relay's next claim take the
    batch's rows, sent and confirmed but still pending, and send them a second time."""
    error = moved_error()
    queue = ob.queue()
    with transaction.atomic():
        ids = [publish("a.b", {"n": n}) for n in range(3)]
    real = sent._write_outcome
    leased: list[bool] = []

    def write(outcome: Any, as_leased: bool, *args: Any) -> None:
        leased.append(as_leased)
        if len(leased) == 1:
            raise error
        real(outcome, as_leased, *args)

    relay = build_relay(once=True)
    with mock.patch.object(sent, "_write_outcome", write):
        report = relay.run()
    assert (report.sent, leased) == (3, [False, False])
    assert not [r for r in relay.health.check()[1] if "database" in r]
    assert set(OutboxMessage.objects.values_list("status", flat=True)) == {OutboxStatus.SENT}
    assert sorted(m.message_id for m in ob.broker.drain(queue, expected=3)) == sorted(ids)
