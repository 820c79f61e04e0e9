"""A retry waits in the outbox, as a scheduled row (``docs/design.md#where-a-retry-waits``):
against the real broker and database.

A foreign producer's message comes back on its retry as it came (its body's bytes, its
properties, its typed headers); a database that cannot take the copy's row holds the delivery
with the broker, no attempt charged; a deployment of ``consume`` alone retries (the relay it
runs beside its handlers sends the copy).
"""

from __future__ import annotations

import datetime as dt
import decimal
import json
import time
from typing import Any

import pytest
from django.db import connection

from reliable_messaging.choices import OutboxStatus
from reliable_messaging.core.envelope import (
    ATTEMPT_HEADER,
    FIRST_FAILED_AT_HEADER,
    LAST_ERROR_HEADER,
    ORIGINAL_EXCHANGE_HEADER,
    ORIGINAL_ROUTING_KEY_HEADER,
    OUTBOX_ID_HEADER,
)
from reliable_messaging.core.outcomes import Acknowledge, ScheduleRetry
from reliable_messaging.models import DeadLetter, OutboxMessage
from reliable_messaging.storage.partitions import OUTBOX_SCHEDULED
from tests import support
from tests.integration.consuming.test_consumer_service import (  # noqa: F401 - fixtures
    Recorder,
    effects,
    exchange_of,
    make_spec,
    rec,
)
from tests.support import Publisher, wait_until
from tests.testapp.models import Effect

pytestmark = pytest.mark.django_db(transaction=True)

# What a retry adds to a message's headers (and the relay, the copy's row id).
RETRY_HEADERS = {
    OUTBOX_ID_HEADER,
    ATTEMPT_HEADER,
    FIRST_FAILED_AT_HEADER,
    LAST_ERROR_HEADER,
    ORIGINAL_EXCHANGE_HEADER,
    ORIGINAL_ROUTING_KEY_HEADER,
}

# JSON whose bytes any decoding and encoding again would change: spacing, escapes, key order,
# number forms, a trailing newline.
ODD_JSON = b'{ "fail" :{"alpha":1},\n  "z": "\\u00e9t\\u00e9", "a": 1.10, "n": 1E2 }\n'


def publish_with_kombu(exchange: str, routing_key: str, body: bytes, **properties: Any) -> None:
    """As a Celery or kombu service publishes: py-amqp writes the frames."""
    from kombu import Connection

    with Connection(support.broker_url(), transport_options={"confirm_publish": True}) as conn:
        conn.Producer().publish(
            body, exchange=exchange, routing_key=routing_key, declare=[], retry=False, **properties
        )


def test_a_foreign_producers_body_properties_and_typed_headers_come_back_as_they_went(
    ns: str,
    service: Any,
    make_spec: Any,  # noqa: F811
    rec: Recorder,  # noqa: F811
) -> None:
    alpha = make_spec("alpha")
    service([alpha], on_outcome=rec)
    headers = {
        "sent-at": dt.datetime(2026, 5, 4, 3, 2, 1),
        "blob": b"\x00\xff\xfe raw",
        "amount": decimal.Decimal("12.34"),
        "nested": {"count": 3, "flag": True, "list": [1, "two"]},
    }
    publish_with_kombu(
        exchange_of(ns),
        "order.placed",
        ODD_JSON,
        message_id="foreign-1",
        headers=headers,
        content_type="application/vnd.shop.order+json",
        content_encoding="binary",
        correlation_id="corr-7",
        reply_to="answers",
        type="order.placed.v2",
        app_id="legacy-shop",
        priority=3,
        timestamp=1_700_000_000,
        delivery_mode=2,
    )
    first, second = rec.wait_count(alpha.name, 2)
    assert isinstance(first.outcome, ScheduleRetry)
    assert second.outcome == Acknowledge("processed")
    assert effects("alpha") == [("foreign-1", 2)]

    # The copy's body is the original's bytes, not JSON made again.
    assert first.delivery.body == second.delivery.body == ODD_JSON
    # Its headers are the original's, each of its type, with our retry headers added.
    came_back = {k: v for k, v in second.delivery.headers.items() if k not in RETRY_HEADERS}
    assert came_back == dict(first.delivery.headers)
    assert came_back["sent-at"] == dt.datetime(2026, 5, 4, 3, 2, 1, tzinfo=dt.UTC)
    assert type(came_back["blob"]) is bytes and came_back["blob"] == b"\x00\xff\xfe raw"
    assert came_back["amount"] == decimal.Decimal("12.34")
    assert second.delivery.headers[ATTEMPT_HEADER] == 2
    # And its properties are the original's.
    fields = (
        "content_type",
        "content_encoding",
        "correlation_id",
        "reply_to",
        "type",
        "app_id",
        "priority",
        "timestamp",
        "message_id",
        "delivery_mode",
    )
    original, copy = first.delivery.properties, second.delivery.properties
    assert {f: getattr(copy, f) for f in fields} == {f: getattr(original, f) for f in fields}
    # It came to alpha's queue alone, by the default exchange, from one outbox row.
    assert (second.delivery.exchange, second.delivery.routing_key) == ("", alpha.queue)
    (row,) = OutboxMessage.objects.filter(message_id="foreign-1")
    assert (row.status, bytes(row.raw_body)) == (OutboxStatus.SENT, ODD_JSON)


def test_a_database_that_refuses_the_copy_charges_no_attempt_and_loses_nothing(
    ns: str,
    service: Any,
    make_spec: Any,  # noqa: F811
    rec: Recorder,  # noqa: F811
    publisher: Publisher,
) -> None:
    """The copy's row cannot be written (the outbox's scheduled rows refuse inserts as a
    read-only database does, SQLSTATE 25006): the failed attempt is not decided, the delivery
    stays with the broker and runs again; once the database takes rows, the copy is written and
    attempt 2 succeeds, with nothing charged for the outage."""
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE FUNCTION rm_test_refuse_rows() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            "RAISE EXCEPTION 'cannot execute INSERT in a read-only transaction' "
            "USING ERRCODE = '25006'; END $$"
        )
        cursor.execute(
            f'CREATE TRIGGER rm_test_refuse BEFORE INSERT ON "{OUTBOX_SCHEDULED}" '
            "FOR EACH ROW EXECUTE FUNCTION rm_test_refuse_rows()"
        )
    try:
        alpha = make_spec("alpha")
        service([alpha], on_outcome=rec)
        publisher.publish(
            exchange_of(ns), "order.placed", {"fail": {"alpha": 1}}, message_id="outage-1"
        )

        def tries() -> list[int]:
            with rec.lock:
                return [m.attempt for label, m in rec.messages if label == "alpha"]

        wait_until(lambda: len(tries()) >= 3, timeout=30, message="attempt 1 run again")
        assert set(tries()) == {1}  # never charged: attempt 1 each time
        assert rec.results(alpha.name) == []  # nothing decided, nothing acked
        assert not OutboxMessage.objects.exists()
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f'DROP TRIGGER IF EXISTS rm_test_refuse ON "{OUTBOX_SCHEDULED}"')
            cursor.execute("DROP FUNCTION IF EXISTS rm_test_refuse_rows()")
    wait_until(
        lambda: rec.results(alpha.name)[-1:] == ["processed"],
        timeout=30,
        message="processed once the database takes the copy",
    )
    assert rec.results(alpha.name) == ["retry", "processed"]
    assert effects("alpha") == [("outage-1", 2)]
    assert OutboxMessage.objects.filter(message_id="outage-1").count() == 1
    assert not DeadLetter.objects.exists()


@pytest.mark.parametrize("relay", [True, False], ids=["consume", "consume-no-relay"])
def test_a_deployment_of_consumers_alone_retries(
    relay: bool, ns: str, consume: Any, publisher: Publisher
) -> None:
    """No relay process: the relay ``consume`` runs beside its handlers sends the copy. Without
    it (``--no-relay``) the copy waits in the outbox for a relay."""
    proc = consume("--queue", f"{ns}.alpha", *(() if relay else ("--no-relay",)))
    proc.wait_consuming()
    message_id = publisher.publish(
        exchange_of(ns), "order.placed", {"fail": {"alpha": 1}}, message_id="alone-1"
    )
    assert message_id == "alone-1"
    if relay:
        wait_until(
            lambda: Effect.objects.filter(consumer="alpha", message_id="alone-1").exists(),
            timeout=30,
            message=lambda: f"retried by consume alone\n{proc.log()[-3000:]}",
        )
        assert list(Effect.objects.values_list("message_id", "attempt")) == [("alone-1", 2)]
        assert OutboxMessage.objects.get(message_id="alone-1").status == OutboxStatus.SENT
        return
    wait_until(
        lambda: OutboxMessage.objects.filter(message_id="alone-1").exists(),
        timeout=30,
        message="the copy written",
    )
    time.sleep(2.0)  # due after 0.2 s: a relay would have sent it by now
    assert OutboxMessage.objects.get().status == OutboxStatus.SCHEDULED
    assert not Effect.objects.exists()
    assert json.loads(bytes(OutboxMessage.objects.get().raw_body or b"")) == {"fail": {"alpha": 1}}


def test_an_original_handed_back_after_its_copy_fell_due_adds_no_second_copy() -> None:
    """A lost ack (the queue's leader died, say) hands the original back after its copy was
    made pending, or sent: that copy is in another partition than the scheduled rows, so their
    unique index cannot see it. The second write finds it all the same, and the promotion of
    due rows is not stopped by a duplicate key."""
    from reliable_messaging.publishing.scheduled import promote_due

    copy: dict[str, Any] = {
        "message_id": "lost-ack-1",
        "queue": "billing",
        "body": b"{}",
        "properties": b"",
        "delay": 0.0,
        "idempotency_key": "rm-retry:lost-ack-1",
    }
    OutboxMessage.objects.schedule_copy(**copy)
    later = dt.datetime.now(dt.UTC) + dt.timedelta(minutes=1)
    assert promote_due("default", due_by=later) == 1
    OutboxMessage.objects.schedule_copy(**copy)  # the original again, attempt and key the same
    assert promote_due("default", due_by=later) == 0
    rows = OutboxMessage.objects.filter(message_id="lost-ack-1")
    assert list(rows.values_list("status", flat=True)) == [OutboxStatus.PENDING]


def test_a_second_copy_after_the_first_was_sent_is_marked_sent_too() -> None:
    """A lost ack hands the original back after its copy was sent: the second copy is written
    (a sent copy is not looked for) and, once sent, recorded as sent beside the first, whose
    key the sent side's unique index would otherwise hold against it (the batch's record
    failed, and its rows went out again and again)."""
    from reliable_messaging.publishing.scheduled import promote_due
    from reliable_messaging.publishing.sent import BatchOutcome, _write_outcome

    copy: dict[str, Any] = {
        "message_id": "lost-ack-2",
        "queue": "billing",
        "body": b"{}",
        "properties": b"",
        "delay": 0.0,
        "idempotency_key": "rm-retry:lost-ack-2",
    }
    rows = OutboxMessage.objects.filter(message_id="lost-ack-2")
    later = dt.datetime.now(dt.UTC) + dt.timedelta(minutes=1)
    for _ in range(2):
        OutboxMessage.objects.schedule_copy(**copy)
        assert promote_due("default", due_by=later) == 1
        (pending,) = rows.filter(status=OutboxStatus.PENDING).values_list("pk", flat=True)
        _write_outcome(BatchOutcome(claimed=[], sent=[pending]), False, "default", 5)
    assert list(rows.values_list("status", flat=True)) == [OutboxStatus.SENT] * 2
