"""Scheduled messages in the database: written scheduled in the caller's transaction, invisible to
the claim until due, made pending under a new id when due (taking their place in their key's
order then), cancelled while they wait, never both cancelled and sent."""

from __future__ import annotations

import datetime as dt
import threading
import time

import pytest
from django.db import connection, transaction
from django.utils import timezone

from reliable_messaging import cancel_scheduled, publish
from reliable_messaging.choices import OutboxStatus
from reliable_messaging.core.envelope import EXPIRES_AT_HEADER
from reliable_messaging.models import OutboxMessage
from reliable_messaging.publishing import scheduled
from reliable_messaging.publishing.claims import claimable
from reliable_messaging.storage.partitions import OUTBOX_SCHEDULED, OUTBOX_TABLE
from tests.markers import ON_POSTGRESQL, postgresql_only

pytestmark = pytest.mark.django_db(transaction=True)


def row(message_id: str) -> OutboxMessage:
    return OutboxMessage.objects.get(message_id=message_id)


def claimable_ids() -> list[str]:
    return list(claimable("default").values_list("message_id", flat=True))


def make_due(message_id: str) -> None:
    """Move a scheduled row's due time into the past (as time passing would)."""
    OutboxMessage.objects.filter(message_id=message_id).update(
        next_attempt_at=timezone.now() - dt.timedelta(seconds=1)
    )


def test_a_scheduled_message_waits_outside_the_claim_until_due() -> None:
    at = timezone.now() + dt.timedelta(hours=1)
    message_id = publish("orders.remind", {"order": 1}, deliver_at=at)
    waiting = row(message_id)
    assert waiting.status == OutboxStatus.SCHEDULED
    assert waiting.deliver_at == at
    assert waiting.next_attempt_at == at
    assert claimable_ids() == []
    assert scheduled.promote_due("default") == 0
    assert 3590 < (scheduled.next_due_in("default") or 0) <= 3600
    if ON_POSTGRESQL:
        with connection.cursor() as cursor:
            cursor.execute(
                f"SELECT tableoid::regclass::text FROM {OUTBOX_TABLE} WHERE message_id = %s",
                [message_id],
            )
            assert cursor.fetchone()[0] == OUTBOX_SCHEDULED


def test_a_delay_is_counted_on_the_database_clock() -> None:
    message_id = publish("orders.remind", {}, delay=dt.timedelta(minutes=30))
    waiting = row(message_id)
    assert waiting.deliver_at is not None
    assert waiting.deliver_at - waiting.created_at == dt.timedelta(minutes=30)


def test_when_due_it_is_made_pending_under_a_new_id_after_the_keys_earlier_messages() -> None:
    early = publish("cart.changed", {"n": 1}, ordering_key="cart-7", delay=3600)
    plain = publish("cart.changed", {"n": 2}, ordering_key="cart-7")
    assert claimable_ids() == [plain]  # the scheduled message holds nothing back
    old_pk = row(early).pk
    make_due(early)
    assert scheduled.next_due_in("default") == 0
    assert scheduled.promote_due("default") == 1
    promoted = row(early)
    assert promoted.status == OutboxStatus.PENDING
    assert promoted.pk > row(plain).pk > old_pk
    assert promoted.deliver_at is not None  # kept: the relay stamps the message with it
    # In its key, behind the message published before it fell due.
    values = dict(claimable("default").values_list("message_id", "behind"))
    assert values[plain] is None
    assert values[early] == row(plain).pk
    assert scheduled.next_due_in("default") is None


def test_due_rows_are_promoted_in_due_order_a_chunk_at_a_time() -> None:
    """Also where the planner's statistics say the scheduled rows' partition is empty
    (autovacuum analyzed it so), which made it rescan the chosen rows for every row of a nested
    loop. Only that partition: the sent rows' day partitions keep their statistics, which
    retention counts by."""
    if ON_POSTGRESQL:
        with connection.cursor() as cursor:
            cursor.execute(f"ANALYZE {OUTBOX_SCHEDULED}")
    base = timezone.now() - dt.timedelta(minutes=10)
    ids = [
        publish("r", {"i": i}, deliver_at=base + dt.timedelta(seconds=offset))
        for i, offset in enumerate([5, 1, 3, 2, 4])
    ]
    assert scheduled.promote_due("default", limit=2) == 2
    assert scheduled.promote_due("default", limit=10) == 3
    order = list(OutboxMessage.objects.order_by("pk").values_list("message_id", flat=True))
    assert order == [ids[1], ids[3], ids[2], ids[4], ids[0]]


def test_cancel_scheduled_takes_it_back_in_the_callers_transaction() -> None:
    kept = publish("orders.cancel_if_unpaid", {"order": 9}, delay=1800)
    with transaction.atomic():
        assert cancel_scheduled(kept) is True
        transaction.set_rollback(True)
    assert row(kept).status == OutboxStatus.SCHEDULED  # the rollback undid the cancel
    assert cancel_scheduled(kept) is True
    assert not OutboxMessage.objects.filter(message_id=kept).exists()
    assert cancel_scheduled(kept) is False  # cancelled before
    assert cancel_scheduled("never-published") is False
    sent_at_once = publish("orders.cancel_if_unpaid", {"order": 10})
    assert cancel_scheduled(sent_at_once) is False  # not a scheduled message
    assert row(sent_at_once).status == OutboxStatus.PENDING


def test_cancel_scheduled_never_takes_a_consumers_retry_copy() -> None:
    """The message was sent, a consumer failed it and waits to retry it: its copy is that
    delivery's, the only one left for that consumer, not the scheduled message."""
    message_id = publish("orders.cancel_if_unpaid", {"order": 11}, delay=60)
    make_due(message_id)
    scheduled.promote_due("default")
    OutboxMessage.objects.filter(message_id=message_id).update(
        status=OutboxStatus.SENT, sent_at=timezone.now()
    )
    OutboxMessage.objects.schedule_copy(
        message_id=message_id,
        queue="billing",
        body=b'{"order": 11}',
        properties=b"",
        delay=60,
        idempotency_key=f"rm-retry:{message_id}",
    )
    assert cancel_scheduled(message_id) is False
    statuses = OutboxMessage.objects.filter(message_id=message_id).values_list("status", flat=True)
    assert sorted(statuses) == [OutboxStatus.SCHEDULED, OutboxStatus.SENT]


def test_a_message_already_due_cannot_be_cancelled() -> None:
    message_id = publish("r", {}, delay=60)
    make_due(message_id)
    scheduled.promote_due("default")
    assert cancel_scheduled(message_id) is False
    assert row(message_id).status == OutboxStatus.PENDING


def test_an_idempotency_key_holds_across_scheduled_and_immediate_messages() -> None:
    first = publish("r", {}, idempotency_key="remind-order-5", delay=600)
    assert publish("r", {}, idempotency_key="remind-order-5") == first
    assert publish("r", {}, idempotency_key="remind-order-5", delay=60) == first
    other = publish("r", {}, idempotency_key="pay-order-5")
    assert publish("r", {}, idempotency_key="pay-order-5", delay=60) == other
    assert OutboxMessage.objects.count() == 2


def test_expires_is_a_deadline_in_the_headers_counted_from_the_due_time() -> None:
    before = time.time()
    now_id = publish("r", {}, expires=dt.timedelta(minutes=5))
    deadline = row(now_id).headers[EXPIRES_AT_HEADER]
    assert int((before + 300) * 1000) <= deadline <= (time.time() + 300) * 1000
    at = timezone.now() + dt.timedelta(days=1)
    later_id = publish("r", {}, deliver_at=at, expires=60)
    assert row(later_id).headers[EXPIRES_AT_HEADER] == int((at.timestamp() + 60) * 1000)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"deliver_at": dt.datetime(2030, 1, 1)}, "timezone-aware"),
        ({"deliver_at": "2030-01-01"}, "must be a datetime"),
        ({"delay": -1}, "must not be negative"),
        ({"delay": "soon"}, "timedelta or a number"),
        ({"delay": 5, "deliver_at": timezone.now()}, "not both"),
        ({"expires": 0}, "must be positive"),
        ({"expires": dt.timedelta(seconds=-5)}, "must be positive"),
    ],
)
def test_bad_schedules_are_refused_at_publish(kwargs: dict[str, object], error: str) -> None:
    with pytest.raises((TypeError, ValueError), match=error):
        publish("r", {}, **kwargs)  # type: ignore[arg-type]
    assert not OutboxMessage.objects.exists()


@postgresql_only
def test_a_cancel_racing_the_relays_promotion_says_it_came_too_late() -> None:
    """The promotion holds the row; the cancel waits, then finds it moved to the pending rows
    (PostgreSQL's serialization failure for a row moved across partitions): False, and the
    caller's transaction stays usable."""
    message_id = publish("r", {}, delay=60)
    make_due(message_id)
    promoted = threading.Event()
    proceed = threading.Event()

    def promote() -> None:
        from django.db import connections

        try:
            with transaction.atomic():
                with connection.cursor() as cursor:
                    cursor.execute("SELECT 1")
                scheduled.promote_due("default")
                promoted.set()
                proceed.wait(10)
        finally:
            connections.close_all()

    worker = threading.Thread(target=promote)
    worker.start()
    assert promoted.wait(10)
    result: list[bool] = []

    def cancel() -> None:
        from django.db import connections

        try:
            with transaction.atomic():
                result.append(cancel_scheduled(message_id))
                OutboxMessage.objects.count()  # the transaction is still usable
        finally:
            connections.close_all()

    canceller = threading.Thread(target=cancel)
    canceller.start()
    time.sleep(0.3)
    assert not result  # waiting on the promotion's lock
    proceed.set()
    worker.join(10)
    canceller.join(10)
    assert result == [False]
    assert row(message_id).status == OutboxStatus.PENDING


def test_the_lag_counts_a_scheduled_message_from_its_due_time() -> None:
    """A reminder written a day ago and due now is not a day late; one due ten minutes ago that
    no relay made pending is ten minutes late (a relay that is down shows)."""
    from reliable_messaging.ops.collectors import outbox_lag

    message_id = publish("r", {}, delay=60)
    day_ago = timezone.now() - dt.timedelta(days=1)
    OutboxMessage.objects.filter(message_id=message_id).update(
        created_at=day_ago, next_attempt_at=timezone.now(), deliver_at=timezone.now()
    )
    assert outbox_lag("default") < 5
    scheduled.promote_due("default")
    assert row(message_id).status == OutboxStatus.PENDING
    assert outbox_lag("default") < 5
    OutboxMessage.objects.all().delete()
    overdue = publish("r", {}, delay=60)
    ten_minutes_ago = timezone.now() - dt.timedelta(minutes=10)
    OutboxMessage.objects.filter(message_id=overdue).update(
        next_attempt_at=ten_minutes_ago, deliver_at=ten_minutes_ago
    )
    assert 595 < outbox_lag("default") < 610


def test_the_testing_helpers_list_scheduled_messages_and_deliver_them_once_due() -> None:
    from reliable_messaging import Message, consumer
    from reliable_messaging.core.registry import ConsumerRegistry
    from reliable_messaging.testing import published, run_outbox
    from reliable_messaging.testing import scheduled as waiting

    handled: list[str] = []
    shop = ConsumerRegistry()

    @consumer("test.reminders", bindings=["order.remind"], name="test.reminders", registry=shop)
    def remind(message: Message) -> None:
        handled.append(message.message_id)

    due = timezone.now() + dt.timedelta(days=1)
    message_id = publish("order.remind", {"order": 7}, deliver_at=due)
    ((listed_due, message),) = waiting()
    assert (listed_due, message.message_id, message.published_at) == (due, message_id, due)
    assert published() == []  # not pending until due
    assert run_outbox(consumers=shop) == []
    assert handled == []
    outcomes = run_outbox(consumers=shop, due_by=due)
    assert [(name, mid) for name, mid, _ in outcomes] == [("test.reminders", message_id)]
    assert handled == [message_id]
    assert waiting() == []
