"""``publish()`` inside a consumer's handler: the outbox row commits or rolls back together with
the handler's effects and its inbox row."""

from __future__ import annotations

import threading
from collections import Counter

import pytest
from django.db import connections

from reliable_messaging import Message, PermanentError, publish
from reliable_messaging.choices import OutboxStatus
from reliable_messaging.consuming.service import ConsumerService
from reliable_messaging.core.outcomes import Acknowledge, ScheduleRetry
from reliable_messaging.core.registry import ConsumerSpec
from reliable_messaging.models import DeadLetter, OutboxMessage, ProcessedMessage
from reliable_messaging.testing import deliver
from tests.support import wait_until
from tests.testapp.models import Effect

from .conftest import OutboxEnv

pytestmark = pytest.mark.django_db(transaction=True)


def handler(message: Message) -> None:
    """Charges (an Effect), announces it (publish), then behaves as the payload asks."""
    payload = message.payload
    Effect.objects.create(
        consumer="charger", message_id=message.message_id, attempt=message.attempt, payload=payload
    )
    publish(
        "payment.captured",
        {"for": message.message_id, "order": payload["order"]},
        ordering_key=str(payload["order"]),
    )
    if message.attempt <= payload.get("fail_attempts", 0):
        raise RuntimeError(f"transient failure after publish on attempt {message.attempt}")
    if payload.get("permanent"):
        raise PermanentError("refused after publish")


def spec_for(ob: OutboxEnv) -> ConsumerSpec:
    return ConsumerSpec(
        name=f"tests.outbox.charger.{ob.ns}",
        queue=f"rmtest.{ob.ns}.orders",
        handler=handler,
        bindings=("order.#",),
    )


def test_publish_in_handler_commits_with_the_effects(ob: OutboxEnv) -> None:
    spec = spec_for(ob)
    outcome = deliver(spec, {"order": 1}, message_id="order-1")
    assert outcome == Acknowledge("processed")
    row = OutboxMessage.objects.get()
    assert (row.routing_key, row.ordering_key, row.status) == ("payment.captured", "1", "pending")
    assert Effect.objects.filter(message_id="order-1").count() == 1
    assert ProcessedMessage.objects.filter(consumer=spec.name, message_id="order-1").exists()

    # A duplicate delivery does not run the handler, so it publishes nothing more.
    assert deliver(spec, {"order": 1}, message_id="order-1") == Acknowledge("duplicate")
    assert OutboxMessage.objects.count() == 1


def test_handler_raising_after_publish_rolls_the_outbox_row_back(ob: OutboxEnv) -> None:
    spec = spec_for(ob)
    outcome = deliver(spec, {"order": 2, "fail_attempts": 1}, message_id="order-2")
    assert isinstance(outcome, ScheduleRetry)
    # What the handler published rolled back; only the retry copy waits in the outbox.
    announcements = OutboxMessage.objects.filter(raw_properties__isnull=True)
    assert not announcements.exists()
    assert OutboxMessage.objects.get().routing_key == spec.queue
    assert not Effect.objects.exists()
    assert not ProcessedMessage.objects.exists()

    # The retry succeeds: now exactly one announcement exists.
    again = deliver(spec, {"order": 2, "fail_attempts": 1}, message_id="order-2", attempt=2)
    assert again == Acknowledge("processed")
    assert announcements.count() == 1


def test_permanent_error_after_publish_leaves_no_outbox_row(ob: OutboxEnv) -> None:
    spec = spec_for(ob)
    outcome = deliver(spec, {"order": 3, "permanent": True}, message_id="order-3")
    assert outcome == Acknowledge("dead_lettered", "permanent")
    assert not OutboxMessage.objects.exists()
    assert not Effect.objects.exists()
    assert DeadLetter.objects.filter(message_id="order-3", consumer=spec.name).exists()


def test_end_to_end_publish_relay_consume_publish_relay(ob: OutboxEnv) -> None:
    """An order event goes out through the outbox, a ConsumerService handles it (failing the
    first attempt of some after publishing), and each announcement reaches its queue once."""
    out_queue = ob.queue("captured", bindings=["payment.#"])
    spec = spec_for(ob)
    orders = 12
    service = ConsumerService([spec], concurrency=2)
    thread = threading.Thread(target=service.run, daemon=True)
    thread.start()
    relay = None
    try:
        assert service.connected.wait(30), "the consumer service did not connect"
        ids = {
            publish("order.placed", {"order": n, "fail_attempts": 1 if n % 3 == 0 else 0})
            for n in range(orders)
        }
        relay = ob.relay_thread()
        wait_until(
            lambda: ProcessedMessage.objects.filter(consumer=spec.name).count() == orders,
            timeout=60,
            interval=0.1,
            message="every order processed",
        )
        wait_until(
            lambda: (
                OutboxMessage.objects.filter(
                    routing_key="payment.captured", status=OutboxStatus.SENT
                ).count()
                == orders
            ),
            timeout=60,
            interval=0.1,
            message="every announcement sent",
        )
    finally:
        service.request_stop()
        thread.join(60)
        if relay is not None:
            ob.stop_relay(relay)
        connections.close_all()
    assert not thread.is_alive()
    # Every row went out on the first try (the consumer's queue existed before the relay ran).
    assert not OutboxMessage.objects.filter(attempts__gt=0).exists()

    assert OutboxMessage.objects.filter(routing_key="payment.captured").count() == orders
    assert Effect.objects.count() == orders  # the failed first attempts left no effect
    delivered = ob.broker.drain(out_queue, expected=orders)
    assert Counter(m.payload["for"] for m in delivered) == dict.fromkeys(ids, 1)
