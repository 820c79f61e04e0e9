"""Declared payloads at both ends, against the real PostgreSQL and RabbitMQ: an invalid
``publish()`` never commits a row; a consumed message that does not match its consumer's type is
a dead letter ``invalid_payload`` before the handler runs, no attempt spent, its raw body kept
byte for byte and its errors (paths, no values) in the dead letter and the admin; after the type
is relaxed the dead letter replays as usual, and edit-and-replay's preview shows the errors."""

from __future__ import annotations

import decimal
import json
import time
from collections.abc import Iterator
from typing import Any

import pydantic
import pytest
from django.contrib.auth.models import User
from django.db import transaction
from django.test import Client
from django.urls import reverse

from reliable_messaging import publish
from reliable_messaging.choices import (
    DeadLetterReason,
    DeadLetterStatus,
    OutboxStatus,
    ReplayOutcome,
)
from reliable_messaging.consuming.processing import DeliveryProcessor, process_batch
from reliable_messaging.consuming.stage import Job
from reliable_messaging.contracts import PayloadInvalid, published_registry, publishes
from reliable_messaging.core.envelope import PUBLISHED_AT_HEADER, Delivery, encode_payload
from reliable_messaging.core.outcomes import Acknowledge
from reliable_messaging.core.registry import ConsumerSpec, registry
from reliable_messaging.dead_letters.replay import replay
from reliable_messaging.models import DeadLetter, OutboxMessage, ProcessedMessage, Replay
from reliable_messaging.testing import deliver
from tests.e2e.test_replay_routing import relay_once
from tests.integration.consuming.test_consumer_service import exchange_of
from tests.integration.contracts.support import Handled, recording_spec
from tests.support import Publisher, broker_connection, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]

SECRET = "4111-1111-1111-1111"


class Line(pydantic.BaseModel):
    sku: str
    quantity: int = 1


class OrderPlaced(pydantic.BaseModel):
    order_id: int
    amount: decimal.Decimal
    lines: list[Line] = []


class OrderPlacedRelaxed(pydantic.BaseModel):
    """The fix: an order id may be a reference text too."""

    order_id: int | str
    amount: decimal.Decimal
    lines: list[Line] = []


@pytest.fixture
def declared() -> Iterator[None]:
    with published_registry.isolated():
        publishes("order.placed", OrderPlaced)
        yield


# --------------------------------------------------------------------------- producer side


def test_an_invalid_publish_raises_with_the_paths_and_never_commits_a_row(
    declared: None,
) -> None:
    before = OutboxMessage.objects.count()
    with pytest.raises(PayloadInvalid) as caught, transaction.atomic():
        publish("order.placed", {"order_id": 1, "amount": "2.00"})  # valid, same transaction
        publish("order.placed", {"order_id": SECRET, "lines": [{"quantity": 2}]})
    assert caught.value.errors == [
        {
            "path": "order_id",
            "message": "Input should be a valid integer, unable to parse string as an integer",
        },
        {"path": "amount", "message": "Field required"},
        {"path": "lines[0].sku", "message": "Field required"},
    ]
    assert SECRET not in str(caught.value)
    assert OutboxMessage.objects.count() == before  # the caller's transaction rolled back
    # Caught inside the transaction, the invalid one wrote nothing; the valid one commits.
    with transaction.atomic():
        publish("order.placed", {"order_id": 2, "amount": "3"}, message_id="valid-2")
        with pytest.raises(PayloadInvalid):
            publish("order.placed", {"order_id": "x"}, message_id="invalid-3")
    assert list(OutboxMessage.objects.values_list("message_id", flat=True)) == ["valid-2"]


def test_a_valid_publish_writes_the_declared_types_json_form(declared: None) -> None:
    with transaction.atomic():
        publish("order.placed", {"order_id": 5, "amount": 9.5, "extra": "dropped"}, message_id="a")
        publish(
            "order.placed",
            OrderPlaced(order_id=6, amount=decimal.Decimal("1.10"), lines=[Line(sku="s")]),
            message_id="b",
        )
        publish("order.other", {"anything": SECRET}, message_id="c")  # no type declared
    bodies = {
        row.message_id: json.loads(row.body)
        for row in OutboxMessage.objects.filter(status=OutboxStatus.PENDING)
    }
    assert bodies == {
        "a": {"order_id": 5, "amount": "9.5", "lines": []},
        "b": {"order_id": 6, "amount": "1.10", "lines": [{"sku": "s", "quantity": 1}]},
        "c": {"anything": SECRET},
    }


# --------------------------------------------------------------------------- consumer side


def test_a_mismatch_is_a_dead_letter_before_the_handler_with_no_attempt_spent(
    ns: str, rm_settings: dict[str, Any], service: Any, publisher: Publisher
) -> None:
    handled = Handled()
    billing = recording_spec(ns, "billing", handled, OrderPlaced)
    service([billing], on_outcome=handled.on_outcome)
    raw = b'{"order_id":  "' + SECRET.encode() + b'", "lines": [{"quantity": 1}]}  '
    publisher.publish(exchange_of(ns), "order.placed", body=raw, message_id="bad-1")
    publisher.publish(
        exchange_of(ns), "order.placed", {"order_id": 7, "amount": "1.5"}, message_id="good-1"
    )
    handled.wait(billing.name, 2)
    assert handled.results(billing.name) == {
        "bad-1": ["dead_lettered:invalid_payload"],
        "good-1": ["processed"],
    }
    # The handler ran once, for the valid message, and was given the declared type's object.
    assert handled.given(billing.name) == [
        OrderPlaced(order_id=7, amount=decimal.Decimal("1.5"), lines=[])
    ]
    letter = DeadLetter.objects.get(consumer=billing.name, message_id="bad-1")
    assert letter.reason == DeadLetterReason.INVALID_PAYLOAD
    assert letter.attempts == 1  # no retry spent, none scheduled
    assert bytes(letter.body) == raw  # byte for byte
    assert "order_id: Input should be a valid integer" in letter.exception_message
    assert "amount: Field required" in letter.exception_message
    assert "lines[0].sku: Field required" in letter.exception_message
    assert SECRET not in letter.exception_message + letter.traceback
    assert not ProcessedMessage.objects.filter(consumer=billing.name, message_id="bad-1").exists()


def _consumers_of(queue: str) -> int:
    connection = broker_connection()
    try:
        declared = connection.channel().queue_declare(queue, passive=True)
        return int(declared.method.consumer_count)
    finally:
        connection.close()


@pytest.fixture
def admin_client(transactional_db: None) -> Client:
    client = Client()
    client.force_login(User.objects.create_superuser("payloads", "p@example.com", None))
    return client


def _registered(spec: ConsumerSpec) -> None:
    """``spec`` in the app's registry, as ``consumers.py`` registers it (the admin reads it)."""
    registry.unregister(spec.name)
    registry.register(spec)


def test_after_the_type_is_relaxed_the_dead_letter_replays_and_the_admin_said_why(
    ns: str,
    rm_settings: dict[str, Any],
    service: Any,
    publisher: Publisher,
    admin_client: Client,
) -> None:
    handled = Handled()
    strict = recording_spec(ns, "billing", handled, OrderPlaced)
    running = service([strict], on_outcome=handled.on_outcome)
    publisher.publish(
        exchange_of(ns), "order.placed", {"order_id": "ref-77", "amount": "3"}, message_id="r-1"
    )
    handled.wait(strict.name, 1)
    letter = DeadLetter.objects.get(consumer=strict.name, message_id="r-1")
    assert letter.reason == DeadLetterReason.INVALID_PAYLOAD
    change = reverse("admin:reliable_messaging_deadletter_change", args=[letter.pk])
    edit = reverse("admin:reliable_messaging_deadletter_edit_replay", args=[letter.pk])
    try:
        _registered(strict)
        page = admin_client.get(change).content.decode()
        assert 'class="rm-payload-errors"' in page
        assert "<td>order_id</td><td>Input should be a valid integer" in page
        # The edit's preview: still not an integer, refused with the field's path.
        preview = admin_client.post(
            edit,
            {
                "payload": json.dumps({"order_id": "still-text", "amount": "3"}),
                "headers": "{}",
                "reason": "try",
                "preview": "1",
            },
        ).content.decode()
        assert "does not match the consumer&#x27;s declared type at order_id" in preview
        assert "still-text" in preview  # the operator's own edit, in its text area only
        fixed = admin_client.post(
            edit,
            {
                "payload": json.dumps({"order_id": 77, "amount": "3"}),
                "headers": "{}",
                "reason": "fix",
                "preview": "1",
            },
        ).content.decode()
        assert "declared type" not in fixed and 'id="rm-edit-ready"' in fixed

        # The fix deployed: the consumer's type accepts a reference text.
        running.request_stop()
        wait_until(lambda: _consumers_of(strict.queue) == 0, timeout=60, message="stopped")
        relaxed = recording_spec(ns, "billing", handled, OrderPlacedRelaxed)
        _registered(relaxed)
        page = admin_client.get(change).content.decode()
        assert "the payload matches the consumer&#x27;s declared type now" in page
        service([relaxed], on_outcome=handled.on_outcome)
        result = replay(DeadLetter.objects.filter(pk=letter.pk), replayed_by="operator")
        assert result.replayed == [letter.pk]
        relay_once(ns)
        handled.wait(strict.name, 2)
    finally:
        registry.unregister(strict.name)
    assert handled.given(strict.name) == [
        OrderPlacedRelaxed(order_id="ref-77", amount=decimal.Decimal(3))
    ]
    wait_until(
        lambda: DeadLetter.objects.get(pk=letter.pk).status == DeadLetterStatus.RESOLVED,
        timeout=30,
        message="the dead letter resolved by its processed replay",
    )


def test_reliable_messaging_testing_runs_the_same_stage(ns: str) -> None:
    """A handler's unit test through ``reliable_messaging.testing.deliver`` sees what consume
    does: the typed object, or the dead letter before the handler."""
    handled = Handled()
    billing = recording_spec(ns, "billing", handled, OrderPlaced, bindings=("order.placed",))
    assert deliver(billing, {"order_id": 1, "amount": "2"}) == Acknowledge("processed")
    assert handled.given(billing.name) == [OrderPlaced(order_id=1, amount=decimal.Decimal(2))]
    outcome = deliver(billing, {"order_id": 2}, message_id="no-amount")
    assert outcome == Acknowledge("dead_lettered", "invalid_payload")
    assert len(handled.given(billing.name)) == 1
    letter = DeadLetter.objects.get(consumer=billing.name, message_id="no-amount")
    assert letter.exception_message.endswith("amount: Field required")
    # An object of the type is sent in its JSON form, as publish() sends it.
    typed = OrderPlaced(order_id=3, amount=decimal.Decimal("4.50"), lines=[Line(sku="A")])
    assert deliver(billing, typed) == Acknowledge("processed")
    assert handled.given(billing.name)[-1] == typed


def test_an_expired_message_is_expired_whatever_its_payload(ns: str) -> None:
    """Declared payloads meet expiry: the expiry screen comes first, so a message past its
    consumer's max_age is expired (kept as the consumer's ``on_expiry`` says) even when its
    payload does not match; one in time that does not match is ``invalid_payload``. Neither
    runs the handler or spends an attempt."""
    handled = Handled()
    spec = recording_spec(ns, "late", handled, OrderPlaced, max_age=60.0, on_expiry="dead_letter")
    two_hours_ago = int((time.time() - 7200) * 1000)
    late = deliver(
        spec, {"order_id": 1}, message_id="late", headers={PUBLISHED_AT_HEADER: two_hours_ago}
    )
    in_time = deliver(spec, {"order_id": 2}, message_id="in-time")
    assert isinstance(late, Acknowledge), late  # acked, never retried
    assert in_time == Acknowledge("dead_lettered", "invalid_payload")
    letters = {
        letter.message_id: letter for letter in DeadLetter.objects.filter(consumer=spec.name)
    }
    assert letters["late"].reason == DeadLetterReason.EXPIRED
    assert letters["in-time"].reason == DeadLetterReason.INVALID_PAYLOAD
    assert {letter.attempts for letter in letters.values()} == {1}
    assert handled.given(spec.name) == []


def test_a_mismatch_in_a_batch_is_screened_and_the_rest_commit_together(ns: str) -> None:
    handled = Handled()
    billing = recording_spec(ns, "billing", handled, OrderPlaced, bindings=("order.placed",))
    processor = DeliveryProcessor(billing)

    def job(message_id: str, payload: Any) -> Job:
        return Job(
            processor,
            Delivery(
                body=encode_payload(payload),
                queue=billing.queue,
                exchange="rmtest",
                routing_key="order.placed",
                message_id=message_id,
                content_type="application/json",
            ),
        )

    outcomes = process_batch(
        [
            job("b-1", {"order_id": 1, "amount": "1"}),
            job("b-2", {"order_id": "two", "amount": "2"}),
            job("b-3", {"order_id": 3, "amount": "3"}),
        ]
    )
    assert outcomes == [
        Acknowledge("processed"),
        Acknowledge("dead_lettered", "invalid_payload"),
        Acknowledge("processed"),
    ]
    assert [p.order_id for p in handled.given(billing.name)] == [1, 3]
    assert set(
        ProcessedMessage.objects.filter(consumer=billing.name).values_list("message_id", flat=True)
    ) == {"b-1", "b-3"}


def test_a_replayed_copy_found_processed_by_another_copy_settles_its_replay(ns: str) -> None:
    """A replay whose copy the payload screen acks as a duplicate (a valid copy of the message
    was processed after the replay was asked for) settles as a duplicate, as it would at the
    inbox claim: left in flight, the admin would show the replay waiting for ever."""
    handled = Handled()
    billing = recording_spec(ns, "billing", handled, OrderPlaced, bindings=("order.placed",))
    bad = deliver(billing, {"order_id": "ref"}, message_id="twice")
    assert bad == Acknowledge("dead_lettered", "invalid_payload")
    letter = DeadLetter.objects.get(consumer=billing.name, message_id="twice")
    assert replay(DeadLetter.objects.filter(pk=letter.pk), replayed_by="operator").replayed
    copy = OutboxMessage.objects.get(message_id="twice")
    assert deliver(billing, {"order_id": 1, "amount": "1"}, message_id="twice") == Acknowledge(
        "processed"
    )
    outcome = deliver(
        billing,
        body=bytes(copy.raw_body) if copy.raw_body is not None else copy.body.encode(),
        message_id="twice",
        headers=copy.headers,
        exchange=copy.exchange,
        routing_key=copy.routing_key,
    )
    assert outcome == Acknowledge("duplicate")
    assert Replay.objects.get(dead_letter=letter).outcome == ReplayOutcome.DUPLICATE
    assert DeadLetter.objects.get(pk=letter.pk).status == DeadLetterStatus.RESOLVED
    assert len(handled.given(billing.name)) == 1
