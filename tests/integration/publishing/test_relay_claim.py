"""The relay's claim at scale: it reads only due rows, parks the rows behind an unsent earlier
row of their key (and releases them in order), leases what it takes in a transaction that
commits at once, and keeps per-key order with several batches in flight."""

from __future__ import annotations

import datetime as dt
import json
import re
import threading
from typing import Any

import psycopg
import pytest
from django.db import connection, connections, transaction
from django.db.models.functions import Now
from django.utils import timezone

from reliable_messaging import publish
from reliable_messaging.choices import OutboxStatus
from reliable_messaging.conf import messaging_settings
from reliable_messaging.models import OutboxMessage
from reliable_messaging.publishing import claims, listener
from reliable_messaging.publishing.claims import OutboxClaims, claimable, release_parked
from reliable_messaging.publishing.relay import LEASE_MARGIN, build_relay
from reliable_messaging.publishing.sent import Batch, record_outcome
from reliable_messaging.publishing.wake_after_commit import sender
from reliable_messaging.storage.partitions import OUTBOX_UNSENT
from tests.markers import postgresql_only

from .conftest import OutboxEnv

pytestmark = pytest.mark.django_db(transaction=True)


def db_now() -> dt.datetime:
    with connection.cursor() as cursor:
        cursor.execute("SELECT CURRENT_TIMESTAMP")
        (now,) = cursor.fetchone()
    return now  # type: ignore[no-any-return]


def bulk_rows(count: int, **fields: Any) -> None:
    now = timezone.now()
    OutboxMessage.objects.bulk_create(
        OutboxMessage(
            message_id=f"bulk-{fields.get('ordering_key')}-{i}-{now.timestamp()}",
            exchange="",
            routing_key="nowhere",
            body="{}",
            **fields,
        )
        for i in range(count)
    )


def rows_read(plan: Any) -> int:
    """Rows the scans of a JSON EXPLAIN ANALYZE plan returned, over all loops (the outbox is
    the only table in the claim)."""
    total = 0
    if "Scan" in plan.get("Node Type", ""):
        total += int(plan.get("Actual Rows", 0)) * int(plan.get("Actual Loops", 1))
        total += int(plan.get("Rows Removed by Filter", 0)) * int(plan.get("Actual Loops", 1))
    for child in plan.get("Plans", []):
        total += rows_read(child)
    return total


@postgresql_only
def test_the_claim_reads_the_due_rows_not_those_it_cannot_take(ob: OutboxEnv) -> None:
    """The bench's worst states in small: many rows not due, many parked behind a failed row;
    the claim's cost must not grow with them (it once walked every one of them)."""
    later = timezone.now() + dt.timedelta(hours=1)
    bulk_rows(3000, next_attempt_at=later, attempts=1)  # backing off
    OutboxMessage.objects.create(
        message_id="head", routing_key="x", body="{}", ordering_key="K", status="failed"
    )
    bulk_rows(3000, ordering_key="K", next_attempt_at=None)  # parked behind the failed head
    bulk_rows(4)
    for key in ("k1", "k2", "k3"):  # keyed rows at the head of their key
        bulk_rows(1, ordering_key=key)
    due = 7
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE reliable_messaging_outboxmessage")
    query = claimable("default").select_for_update(skip_locked=True)[:500]
    with transaction.atomic():
        sql, params = query.query.sql_with_params()
        with connection.cursor() as cursor:
            cursor.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}", params)
            (plan,) = cursor.fetchone()
        # The due index, or on PostgreSQL's partitioned outbox its partitions' copies.
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT relid::regclass::text FROM pg_partition_tree('rm_outbox_due_idx')"
            )
            due_indexes = {row[0] for row in cursor.fetchall()} | {"rm_outbox_due_idx"}
    plan = plan if isinstance(plan, list) else json.loads(plan)
    text = json.dumps(plan)
    assert due_indexes & set(re.findall(r'"Index Name": "([^"]+)"', text)), text
    read = rows_read(plan[0]["Plan"])
    assert read <= due + 10, f"the claim read {read} rows to find {due}: {text[:2000]}"


def test_rows_behind_a_failed_row_are_parked_once_then_released_in_order(ob: OutboxEnv) -> None:
    ob.set(OUTBOX_MAX_ATTEMPTS=1, REQUIRE_ROUTE=["stuck.#"])
    queue = ob.queue(bindings=["ok.#"])
    with transaction.atomic():
        head = publish("stuck.a0", {"n": 0}, ordering_key="A")  # unroutable command: fails
        later = [publish(f"ok.a{i}", {"n": i}, ordering_key="A") for i in range(1, 6)]
        free = publish("ok.free", {"n": "free"})

    build_relay(once=True).run()
    assert OutboxMessage.objects.get(message_id=head).status == OutboxStatus.FAILED
    assert [m.message_id for m in ob.broker.drain(queue, expected=1)] == [free]
    parked = OutboxMessage.objects.filter(message_id__in=later)
    assert all(r.status == OutboxStatus.PENDING and r.attempts == 0 for r in parked)
    assert all(r.next_attempt_at is None for r in parked), "the rows behind it are not parked"
    # Parked rows are out of the claim's reach: later claims never read them again.
    assert not claimable("default").filter(message_id__in=later).exists()
    assert build_relay(once=True).run().sent == 0

    # The operator fixes the cause and retries the head (the admin's action): the head goes,
    # and each row is released by the one before it, in order.
    ob.broker.bind(queue, ob.exchange, "stuck.#")
    OutboxMessage.objects.filter(message_id=head).update(
        status=OutboxStatus.PENDING, attempts=0, next_attempt_at=Now()
    )
    report = build_relay(once=True).run()
    assert report.sent == 6
    assert [m.message_id for m in ob.broker.drain(queue, expected=6)] == [head, *later]


def test_a_claim_stops_at_its_byte_budget_and_the_rows_past_it_go_in_later_batches(
    ob: OutboxEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch takes rows until their bodies pass CLAIM_BYTES (its first row whatever its
    size), so that large bodies never fill the relay's memory; the rows past it are claimed by
    the next batches, every one sent, a key's in order."""
    queue = ob.queue(bindings=["big.#"])
    with transaction.atomic():
        ids = [publish("big.a", {"n": i, "pad": "x" * (300 + 50 * i)}) for i in range(8)]
    sizes = [
        len(row.body.encode())
        for row in sorted(OutboxMessage.objects.filter(message_id__in=ids), key=lambda r: r.pk)
    ]
    budget = sizes[0] + sizes[1] + sizes[2] // 2  # the third row starts under it
    monkeypatch.setattr(claims, "CLAIM_BYTES", budget)

    claim = build_relay(once=True).claims.claim()
    assert claim.transaction is not None
    assert [row.message_id for row in claim.rows] == ids[:3]
    claim.transaction.rollback()

    monkeypatch.setattr(claims, "CLAIM_BYTES", 1)  # a row larger than the budget goes alone
    claim = build_relay(once=True).claims.claim()
    assert claim.transaction is not None
    assert [row.message_id for row in claim.rows] == ids[:1]
    claim.transaction.rollback()

    report = build_relay(once=True).run()
    assert report.sent == len(ids) and report.batches == len(ids)
    # Rows without a key go in any order; a key's rows in publish order whatever the cut.
    assert sorted(m.message_id for m in ob.broker.drain(queue, expected=len(ids))) == ids
    monkeypatch.setattr(claims, "CLAIM_BYTES", budget)
    with transaction.atomic():
        keyed = [
            publish("big.k", {"n": i, "pad": "x" * (300 + 50 * i)}, ordering_key="K")
            for i in range(8)
        ]
    assert build_relay(once=True).run().sent == len(keyed)
    assert [m.message_id for m in ob.broker.drain(queue, expected=len(keyed))] == keyed


@postgresql_only
def test_once_the_budget_cut_a_claim_the_next_ones_lock_one_row_past_what_they_return(
    ob: OutboxEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A row a claim locks past CLAIM_BYTES waits until that batch ends, skipped by the other
    batches in flight: after a claim the budget cut, the lane's next claims lock one row more
    than fitted, and a claim that returns all it locked lets the next lock twice as many."""
    ob.queue(bindings=["big.#"])
    with transaction.atomic():
        ids = [publish("big.a", {"n": i, "pad": "x" * 1000}) for i in range(10)]
    size = len(OutboxMessage.objects.get(message_id=ids[0]).body.encode())
    monkeypatch.setattr(claims, "CLAIM_BYTES", 3 * size)  # three rows a batch
    table = OutboxMessage._meta.db_table

    def free_elsewhere() -> int:
        with psycopg.connect(listener.listen_conninfo("default"), autocommit=True) as other:
            found = other.execute(
                f'SELECT count(*) FROM (SELECT 1 FROM "{table}" WHERE message_id = ANY(%s) '
                "FOR UPDATE SKIP LOCKED) s",
                [ids],
            ).fetchone()
        assert found is not None
        return int(found[0])

    lane = build_relay(once=True).claims
    for locked in (10, 4, 4):  # the first claim knew no better than the batch size
        claim = lane.claim()
        assert claim.transaction is not None
        assert [row.message_id for row in claim.rows] == ids[:3]
        assert free_elsewhere() == len(ids) - locked
        claim.transaction.rollback()
    monkeypatch.setattr(claims, "CLAIM_BYTES", 100 * size)
    claim = lane.claim()
    assert claim.transaction is not None
    assert [row.message_id for row in claim.rows] == ids[:4]
    claim.transaction.rollback()
    assert lane.lock_limit == 8


def failed_head(key: str) -> None:
    """A failed row of ``key``, backing off for an hour: it holds back the rows behind it."""
    OutboxMessage.objects.create(
        message_id="head",
        routing_key="x",
        body="{}",
        ordering_key=key,
        status="failed",
        next_attempt_at=timezone.now() + dt.timedelta(hours=1),
    )


@postgresql_only
def test_a_claim_parks_at_most_park_chunk_rows_even_where_the_outbox_looks_empty(
    ob: OutboxEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Statistics that say the unsent rows' partition is empty (autovacuum analyzed it so) led
    the planner to run the choice of rows again for every row of a nested loop, parking past
    the limit. Only that partition: the sent rows' day partitions keep their statistics, which
    retention counts by."""
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {OUTBOX_UNSENT}")
    monkeypatch.setattr(claims, "PARK_CHUNK", 5)
    failed_head("A")
    bulk_rows(20, ordering_key="A", next_attempt_at=timezone.now())

    claim = OutboxClaims("default", messaging_settings, 10, dt.timedelta(seconds=60)).claim()
    if claim.transaction is not None:
        claim.transaction.rollback()

    assert claim.parked == 5
    held = OutboxMessage.objects.filter(ordering_key="A", status="pending")
    assert held.filter(next_attempt_at__isnull=True).count() == 5


@postgresql_only
def test_one_claim_parks_every_due_row_behind_a_held_key_not_only_its_batch(
    ob: OutboxEnv,
) -> None:
    """Rows held back by their key, due as publish() writes them, many times a batch: the
    first claim that meets them parks all of them in one statement (parked a batch at a time, a
    relay --once beside 200,000 of them spent most of its run parking), and claims free rows."""
    failed_head("A")
    for _ in range(3):  # interleaved with free rows, as they were published
        bulk_rows(20, ordering_key="A", next_attempt_at=timezone.now())
        bulk_rows(5, next_attempt_at=timezone.now())

    claims = OutboxClaims("default", messaging_settings, 10, dt.timedelta(seconds=60))
    claim = claims.claim()
    assert claim.transaction is not None
    claim.transaction.rollback()
    assert claim.parked == 60
    held = OutboxMessage.objects.filter(ordering_key="A", status="pending")
    assert not held.filter(next_attempt_at__isnull=False).exists(), "a held row is still due"
    assert len(claim.rows) == 10 and all(row.ordering_key is None for row in claim.rows)
    assert not OutboxMessage.objects.filter(ordering_key=None, next_attempt_at=None).exists()


def test_a_parked_row_nothing_holds_back_is_released_by_the_sweep(ob: OutboxEnv) -> None:
    """A race between two relays can park a row just as the row before it is sent: the sweep
    (at start and every 30 s) releases it."""
    queue = ob.queue()
    with transaction.atomic():
        first = publish("order.1", {"n": 1}, ordering_key="K")
        second = publish("order.2", {"n": 2}, ordering_key="K")
    assert sender.flush()  # its release after the commit, which finds the first row unsent
    OutboxMessage.objects.filter(message_id=first).update(status=OutboxStatus.SENT, sent_at=Now())
    OutboxMessage.objects.filter(message_id=second).update(next_attempt_at=None)

    assert release_parked("default") == (1, None)
    OutboxMessage.objects.filter(message_id=second).update(next_attempt_at=None)
    assert build_relay(once=True).run().sent == 1  # the relay sweeps when it starts
    assert [m.message_id for m in ob.broker.drain(queue, expected=1)] == [second]


def test_the_sweep_goes_over_many_parked_rows_a_slice_at_a_time(ob: OutboxEnv) -> None:
    """Each sweep reads a bounded slice (so 200,000 parked rows never hold a claim up for a
    second) and goes on where the last one stopped; rows still held back stay parked."""
    OutboxMessage.objects.create(
        message_id="head", routing_key="x", body="{}", ordering_key="held", status="failed"
    )
    bulk_rows(3, ordering_key="held", next_attempt_at=None)  # rightly parked
    for key in ("k1", "k2", "k3", "k4", "k5"):
        bulk_rows(1, ordering_key=key, next_attempt_at=None)  # nothing holds them back
    released, slices = 0, 0
    after: int | None = 0
    while after is not None:
        got, after = release_parked("default", after=after, limit=3)
        released += got
        slices += 1
    assert (released, slices) == (5, 3)
    assert (
        OutboxMessage.objects.filter(ordering_key="held", next_attempt_at__isnull=True).count() == 3
    )


def test_a_claim_holds_its_rows_then_trades_its_transaction_for_a_lease(ob: OutboxEnv) -> None:
    """A batch's rows stay locked by its claim's transaction while confirms come back; past
    HOLD_LIMIT (a slow broker) the rows are leased and the transaction commits, so no old
    snapshot or lock is held on the outbox (it would hold back vacuum)."""
    ob.set(RELAY_CONFIRM_TIMEOUT=10)
    with transaction.atomic():
        ids = [publish("order.placed", {"n": i}) for i in range(5)]
    relay = build_relay(once=True)
    claim = relay.claims.claim()
    assert sorted(r.message_id for r in claim.rows) == sorted(ids)
    assert connection.in_atomic_block  # the rows are locked by it
    other: list[Any] = []
    thread = threading.Thread(target=lambda: other.append(build_relay(once=True).claims.claim()))
    thread.start()
    thread.join(10)
    assert other[0].rows == [], "another relay took rows a batch in flight holds"

    relay.claims.lease(claim.rows, claim.transaction)
    assert not connection.in_atomic_block
    with connection.cursor() as cursor:
        cursor.execute("SELECT state FROM pg_stat_activity WHERE pid = pg_backend_pid()")
        assert cursor.fetchone() == ("active",)  # this very query; no transaction left open
    now = db_now()
    for row in OutboxMessage.objects.filter(message_id__in=ids):
        assert row.next_attempt_at is not None
        lease = (row.next_attempt_at - now).total_seconds()
        assert 10 < lease <= 10 + LEASE_MARGIN + 1, lease
    other_claim = build_relay(once=True).claims.claim()
    assert other_claim.rows == [] and other_claim.transaction is None, "leased rows were taken"

    # Recording the batch later marks the confirmed rows sent and makes the rest due again.
    batch = Batch(rows=dict(enumerate(claim.rows, start=1)), claimed=claim.rows)
    batch.confirmed = {claim.rows[0].pk}
    assert record_outcome(batch.outcome(), None, using="default", max_attempts=10) is None
    statuses = dict(OutboxMessage.objects.values_list("pk", "status"))
    assert statuses[claim.rows[0].pk] == OutboxStatus.SENT
    again = [row.pk for row in claim.rows[1:]]
    assert OutboxMessage.objects.filter(
        pk__in=again, status=OutboxStatus.PENDING, next_attempt_at__lte=Now()
    ).count() == len(again)


@postgresql_only
def test_a_scheduled_row_falling_due_behind_a_held_key_is_parked_then_sent_in_its_place(
    ob: OutboxEnv,
) -> None:
    """Parking meets scheduling: a key's head fails, a row behind it is parked, and a scheduled
    row of the key falls due meanwhile. It is promoted and parked behind the head like the
    others (never sent around it), goes in its place once the head is retried, and a row of
    the key still not due stays scheduled until its time, after them."""
    ob.set(OUTBOX_MAX_ATTEMPTS=1, REQUIRE_ROUTE=["stuck.#"])
    queue = ob.queue(bindings=["ok.#"])
    with transaction.atomic():
        head = publish("stuck.a0", {"n": 0}, ordering_key="A")  # unroutable command: fails
        behind = publish("ok.a1", {"n": 1}, ordering_key="A")
        soon = publish("ok.a2", {"n": 2}, ordering_key="A", delay=3600)
        later = publish("ok.a3", {"n": 3}, ordering_key="A", delay=3600)

    build_relay(once=True).run()
    assert OutboxMessage.objects.get(message_id=head).status == OutboxStatus.FAILED
    # The scheduled row falls due (its time moved, not waited for).
    OutboxMessage.objects.filter(message_id=soon).update(next_attempt_at=Now())
    assert build_relay(once=True).run().sent == 0
    row = OutboxMessage.objects.get(message_id=soon)
    assert (row.status, row.next_attempt_at) == (OutboxStatus.PENDING, None), "not parked"
    assert OutboxMessage.objects.get(message_id=later).status == OutboxStatus.SCHEDULED
    assert ob.broker.drain(queue, expected=0) == []

    ob.broker.bind(queue, ob.exchange, "stuck.#")
    OutboxMessage.objects.filter(message_id=head).update(
        status=OutboxStatus.PENDING, attempts=0, next_attempt_at=Now()
    )
    assert build_relay(once=True).run().sent == 3
    assert [m.message_id for m in ob.broker.drain(queue, expected=3)] == [head, behind, soon]
    assert OutboxMessage.objects.get(message_id=later).status == OutboxStatus.SCHEDULED

    OutboxMessage.objects.filter(message_id=later).update(next_attempt_at=Now())
    assert build_relay(once=True).run().sent == 1
    assert [m.message_id for m in ob.broker.drain(queue, expected=1)] == [later]


@postgresql_only
def test_a_row_published_behind_any_unsent_row_of_its_key_is_written_parked(
    ob: OutboxEnv,
) -> None:
    """publish() looks for an unsent row of its key: behind one that failed, backs off or is
    merely not sent yet, the new row is written parked, and no claim has to find it due and
    park it (nor later, when the key's first row fails). The keys' rows go in order once their
    first rows are sent."""
    ob.set(OUTBOX_MAX_ATTEMPTS=1, REQUIRE_ROUTE=["stuck.#"])
    queue = ob.queue(bindings=["ok.#"])
    with transaction.atomic():
        head = publish("stuck.a0", {"n": 0}, ordering_key="A")  # unroutable command: fails
    build_relay(once=True).run()
    assert OutboxMessage.objects.get(message_id=head).status == OutboxStatus.FAILED
    backing_off = OutboxMessage.objects.create(
        message_id="backing-off",
        exchange=ob.exchange,
        routing_key="ok.c0",
        body="{}",
        ordering_key="C",
        attempts=1,
        next_attempt_at=timezone.now() + dt.timedelta(hours=1),
    )
    with transaction.atomic():
        behind_failed = [publish(f"ok.a{i}", {"n": i}, ordering_key="A") for i in (1, 2)]
        behind_backoff = publish("ok.c1", {"n": 1}, ordering_key="C")
        busy = [publish(f"ok.b{i}", {"n": i}, ordering_key="B") for i in (1, 2, 3)]

    def due(message_id: str) -> bool:
        return OutboxMessage.objects.get(message_id=message_id).next_attempt_at is not None

    assert [due(m) for m in [*behind_failed, behind_backoff]] == [False, False, False]
    assert [due(m) for m in busy] == [True, False, False], "written due behind a busy key"
    claims = OutboxClaims("default", messaging_settings, 10, dt.timedelta(seconds=60))
    claim = claims.claim()
    assert claim.transaction is not None
    claim.transaction.rollback()
    assert [row.message_id for row in claim.rows] == busy[:1]
    assert claim.parked == 0, "the claim found rows to park"

    ob.broker.bind(queue, ob.exchange, "stuck.#")
    OutboxMessage.objects.filter(pk__in=[backing_off.pk]).update(next_attempt_at=Now())
    OutboxMessage.objects.filter(message_id=head).update(
        status=OutboxStatus.PENDING, attempts=0, next_attempt_at=Now()
    )
    assert build_relay(once=True).run().sent == 8
    sent = [m.message_id for m in ob.broker.drain(queue, expected=8)]
    for key in ([head, *behind_failed], ["backing-off", behind_backoff], busy):
        assert [m for m in sent if m in key] == key


@postgresql_only
def test_a_row_parked_behind_a_row_sent_before_it_committed_is_released_once_it_commits(
    ob: OutboxEnv,
) -> None:
    """publish() writes a row parked behind its key's unsent row. When the relay sends that row
    while the publishing transaction is still open, its release does not see the new row: the
    process's wake-up thread releases it once the transaction commits, not the sweep (30 s)."""
    queue = ob.queue()
    first = publish("order.1", {"n": 1}, ordering_key="K")
    sent: list[int] = []

    def relay() -> None:
        try:
            sent.append(build_relay(once=True).run().sent)
        finally:
            connections.close_all()

    with transaction.atomic():
        second = publish("order.2", {"n": 2}, ordering_key="K")
        assert OutboxMessage.objects.get(message_id=second).next_attempt_at is None
        thread = threading.Thread(target=relay)
        thread.start()
        thread.join(30)
        assert sent == [1], "the relay did not send the first row"
    assert sender.flush()
    assert OutboxMessage.objects.get(message_id=second).next_attempt_at is not None, "parked"
    assert build_relay(once=True).run().sent == 1
    assert [m.message_id for m in ob.broker.drain(queue, expected=2)] == [first, second]
