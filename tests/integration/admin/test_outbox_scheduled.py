"""Scheduled messages in the outbox admin: listed with their due time, found by message_id, and
cancelled by an action that says what it left alone; with 20,000 of them, no page reads them
all."""

from __future__ import annotations

import datetime as dt
import json

from django.db import connection
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from reliable_messaging import publish
from reliable_messaging.choices import OutboxStatus, TaskRunStatus
from reliable_messaging.models import OutboxMessage, TaskRun
from reliable_messaging.publishing import scheduled
from tests.markers import postgresql_only

from .conftest import messages_of
from .test_admin_pages_bounded import OUTBOX, fetched

CHANGELIST = "admin:reliable_messaging_outboxmessage_changelist"


def test_the_list_shows_due_times_and_the_next_one(admin: Client, db: None) -> None:
    soon = timezone.now() + dt.timedelta(minutes=30)
    reminder = publish("order.remind", {"order": 1}, deliver_at=soon)
    publish("order.placed", {"order": 1})
    response = admin.get(reverse(CHANGELIST), {"status__exact": "scheduled"})
    assert response.status_code == 200
    assert [row.message_id for row in response.context["cl"].result_list] == [reminder]
    assert response.context["cl"].result_list[0].deliver_at == soon
    assert any("Next scheduled message is due at" in text for text in messages_of(response))
    assert "Due at" in response.content.decode()


def retry_copy(message_id: str, order: int) -> None:
    """A consumer's retry of a failed delivery, due in a minute."""
    OutboxMessage.objects.schedule_copy(
        message_id=message_id,
        queue="billing",
        body=json.dumps({"order": order}).encode(),
        properties=b"",
        delay=60,
        idempotency_key=f"rm-retry:{message_id}",
    )


def test_a_consumers_retry_is_shown_as_one_and_not_as_the_next_scheduled_message(
    admin: Client, db: None
) -> None:
    """A consumer's retry waits as a scheduled row like a message publish() scheduled: the
    list says which is which, and names the next due row for what it is."""
    reminder = publish("order.remind", {"order": 8}, delay=3600)
    retry_copy("failed-twice", 9)
    url = reverse(CHANGELIST)
    response = admin.get(url, {"status__exact": "scheduled"})
    assert any(
        text.startswith("Next scheduled row is a consumer's retry or deferral, due at ")
        for text in messages_of(response)
    ), messages_of(response)
    shown = {
        row.message_id: response.context["cl"].model_admin.status_shown(row)
        for row in response.context["cl"].result_list
    }
    assert shown == {
        reminder: "scheduled",
        "failed-twice": "scheduled: a consumer's retry or deferral",
    }
    assert "a consumer&#x27;s retry or deferral" in response.content.decode()
    OutboxMessage.objects.filter(message_id="failed-twice").delete()
    response = admin.get(url)
    assert any(
        text.startswith("Next scheduled message is due at ") for text in messages_of(response)
    )


def test_the_cancel_action_cancels_waiting_rows_and_leaves_the_others(
    admin: Client, db: None
) -> None:
    waiting = publish("order.remind", {"order": 2}, delay=3600)
    due = publish("order.remind", {"order": 3}, delay=60)
    OutboxMessage.objects.filter(message_id=due).update(
        next_attempt_at=timezone.now() - dt.timedelta(seconds=1)
    )
    scheduled.promote_due("default")  # the relay made it pending meanwhile
    at_once = publish("order.placed", {"order": 4})
    pks = list(
        OutboxMessage.objects.filter(message_id__in=[waiting, due, at_once]).values_list(
            "pk", flat=True
        )
    )
    response = admin.post(
        reverse(CHANGELIST),
        {"action": "cancel_scheduled", "_selected_action": [str(pk) for pk in pks]},
        follow=True,
    )
    shown = messages_of(response)
    assert "1 scheduled message cancelled." in shown
    assert any(text.startswith("2 selected rows were not waiting") for text in shown)
    assert not OutboxMessage.objects.filter(message_id=waiting).exists()
    assert OutboxMessage.objects.get(message_id=due).status == OutboxStatus.PENDING
    assert OutboxMessage.objects.get(message_id=at_once).status == OutboxStatus.PENDING


def test_the_cancel_action_cancels_the_selected_row_only_when_two_share_a_message_id(
    admin: Client, db: None
) -> None:
    shared = publish("order.remind", {"order": 5}, delay=3600)
    publish("order.remind", {"order": 5, "again": True}, delay=7200, message_id=shared)
    first, second = OutboxMessage.objects.filter(message_id=shared).order_by("pk")
    response = admin.post(
        reverse(CHANGELIST),
        {"action": "cancel_scheduled", "_selected_action": [str(first.pk)]},
        follow=True,
    )
    assert "1 scheduled message cancelled." in messages_of(response)
    assert list(OutboxMessage.objects.filter(message_id=shared).values_list("pk", "status")) == [
        (second.pk, OutboxStatus.SCHEDULED)
    ]


def select_for_cancel(admin: Client, *message_ids: str) -> list[str]:
    pks = OutboxMessage.objects.filter(message_id__in=message_ids).values_list("pk", flat=True)
    response = admin.post(
        reverse(CHANGELIST),
        {"action": "cancel_scheduled", "_selected_action": [str(pk) for pk in pks]},
        follow=True,
    )
    return messages_of(response)


def test_the_cancel_action_leaves_a_consumers_retry_copy_alone_and_says_why(
    admin: Client, db: None
) -> None:
    """A retry copy is the only copy of a delivery that failed (the original was acked when
    the copy was written): cancelling it would lose the message for its consumer, with no
    dead letter."""
    reminder = publish("order.remind", {"order": 6}, delay=3600)
    retry_copy("failed-once", 7)
    shown = select_for_cancel(admin, reminder, "failed-once")
    assert "1 scheduled message cancelled." in shown
    assert any(
        text.startswith("1 selected row is a consumer's retry of a failed delivery")
        for text in shown
    ), shown
    assert not OutboxMessage.objects.filter(message_id=reminder).exists()
    copy = OutboxMessage.objects.get(message_id="failed-once")
    assert copy.status == OutboxStatus.SCHEDULED


def test_the_cancel_action_cancels_a_deferred_task_with_its_result(admin: Client, db: None) -> None:
    """A task enqueued with run_after waits as a scheduled message; cancelled, it is as if
    never enqueued: no result row READY for ever, which no worker would ever run."""
    task_id = "0193a0a0-0000-7000-8000-000000000001"
    TaskRun.objects.create(
        id=task_id,
        backend="default",
        task_path="shop.tasks.send_receipt",
        queue_name="default",
        args=[1],
        kwargs={},
        run_after=timezone.now() + dt.timedelta(hours=1),
        enqueued_at=timezone.now(),
    )
    publish(
        "tasks.default",
        {"task_id": task_id, "task": "shop.tasks.send_receipt"},
        message_id=task_id,
        delay=3600,
    )
    done = TaskRun.objects.create(
        id="0193a0a0-0000-7000-8000-000000000002",
        backend="default",
        task_path="shop.tasks.send_receipt",
        queue_name="default",
        args=[2],
        kwargs={},
        status=TaskRunStatus.SUCCESSFUL,
        enqueued_at=timezone.now(),
    )
    # A scheduled message sharing a finished task's id leaves its result alone.
    publish("order.remind", {}, message_id=done.id, delay=3600)
    shown = select_for_cancel(admin, task_id, done.id)
    assert "2 scheduled messages cancelled." in shown
    assert "1 of them was a task's (enqueued with run_after): its result is deleted " in " ".join(
        shown
    )
    assert not OutboxMessage.objects.filter(message_id__in=[task_id, done.id]).exists()
    assert list(TaskRun.objects.values_list("id", flat=True)) == [done.id]


@postgresql_only
def test_twenty_thousand_scheduled_rows_cost_the_pages_no_full_read(
    admin: Client, db: None
) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            f"""
            INSERT INTO {OUTBOX} (message_id, exchange, routing_key, body, headers, status,
                attempts, last_error, next_attempt_at, deliver_at, created_at)
            SELECT 'later-' || i, 'x', 'order.remind', '{{}}', '{{}}', 'scheduled', 0, '',
                   now() + i * interval '1 minute', now() + i * interval '1 minute', now()
            FROM generate_series(1, 20000) AS i
            """
        )
        cursor.execute(f"ANALYZE {OUTBOX}")
    url = reverse(CHANGELIST)
    fetched(admin, url, OUTBOX)
    listed = fetched(admin, url, OUTBOX, status__exact="scheduled")
    found = fetched(admin, url, OUTBOX, q="later-777")
    assert len(listed.context["cl"].result_list) > 0
    assert [row.message_id for row in found.context["cl"].result_list] == ["later-777"]


def test_a_retry_copy_shows_its_bytes_and_its_original_properties(admin: Client, db: None) -> None:
    """A retry copy keeps the original's bytes and AMQP properties, not JSON text and headers:
    its page shows those, readably, and its download is the exact bytes."""
    from pika.spec import BasicProperties

    from reliable_messaging.broker.stored_properties import retry_properties

    original = BasicProperties(message_id="copy-1", content_type="text/x-legacy", app_id="shop")
    OutboxMessage.objects.schedule_copy(
        message_id="copy-1",
        queue="billing",
        body=b"\x00legacy \xff bytes",
        properties=retry_properties(original, {"x-rm-attempt": 2, "sent": dt.datetime(2026, 1, 2)}),
        delay=60,
        idempotency_key="rm-retry:copy-1",
    )
    row = OutboxMessage.objects.get(message_id="copy-1")
    page = admin.get(reverse("admin:reliable_messaging_outboxmessage_change", args=[row.pk]))
    assert page.status_code == 200
    text = page.content.decode()
    assert "\\x00legacy \\xff bytes" in text
    assert "app_id: &#x27;shop&#x27;" in text and "text/x-legacy" in text
    assert "x-rm-attempt" in text and "datetime.datetime(2026, 1, 2" in text
    download = admin.get(reverse("admin:reliable_messaging_outboxmessage_body", args=[row.pk]))
    assert b"".join(download) == b"\x00legacy \xff bytes"
