"""The worked example of docs/testing-handlers.md, run as the guide shows it.

Each block between ``# --8<-- [start:NAME]`` and ``# --8<-- [end:NAME]`` is a code block of the
guide, character for character: tests/packaging/test_docs.py fails when the two differ, or when
the guide shows Python that is not one of these blocks.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

# --8<-- [start:imports]
from decimal import Decimal

import pytest

from reliable_messaging import Message, PermanentError, consumer, publish
from reliable_messaging.models import DeadLetter
from reliable_messaging.testing import (
    Acknowledge,
    ScheduleRetry,
    deliver,
    find_consumer,
    published,
    run_outbox,
)
from tests.testapp.models import Effect

# --8<-- [end:imports]


# --8<-- [start:consumers]
class CardDeclined(Exception):
    pass


class PaymentGateway:
    """The payment provider's client (tests replace ``charge`` to make it fail)."""

    def charge(self, card: str, amount: Decimal) -> str:
        if card == "0000":
            raise CardDeclined(f"card {card} declined")
        return f"ch_{card}_{amount}"


gateway = PaymentGateway()


@consumer(
    "billing.charge-order",
    bindings=["order.placed"],
    name="billing.charge_order",
    max_attempts=3,
    retry_delays=[10, 60],
)
def charge_order(message: Message) -> None:
    order = message.payload
    try:
        charge_id = gateway.charge(order["card"], Decimal(order["amount"]))
    except CardDeclined as exc:
        raise PermanentError(str(exc)) from exc  # no retry: a dead letter at once
    Effect.objects.create(
        consumer="billing",
        message_id=message.message_id,
        attempt=message.attempt,
        payload={"order_id": order["order_id"], "charge": charge_id},
    )
    # In the handler's transaction: sent only if the charge commits.
    publish("payment.captured", {"order_id": order["order_id"], "amount": order["amount"]})


@consumer("billing.send-receipt", bindings=["payment.captured"], name="billing.send_receipt")
def send_receipt(message: Message) -> None:
    Effect.objects.create(
        consumer="receipts",
        message_id=message.message_id,
        attempt=message.attempt,
        payload=message.payload,
    )


# --8<-- [end:consumers]

# The decorators above registered both consumers, as an app's consumers.py does. The suite's other
# tests must not meet them (a `run_outbox()` there would route to them), so they are in the
# registry only while this module's tests run, and alone.
GUIDE_CONSUMERS = [find_consumer(charge_order), find_consumer(send_receipt)]


def _unregister_guide_consumers() -> None:
    from reliable_messaging.core.registry import registry

    for spec in GUIDE_CONSUMERS:
        registry.unregister(spec.name)


_unregister_guide_consumers()


@pytest.fixture(autouse=True)
def guide_consumers() -> Iterator[None]:
    from reliable_messaging.core.registry import registry

    with registry.isolated():
        for spec in GUIDE_CONSUMERS:
            registry.register(spec)
        yield


# --8<-- [start:tests]
ORDER = {"order_id": 7, "card": "4242", "amount": "19.90"}


def test_an_order_is_charged_once_and_announced(db: None) -> None:
    first = deliver(charge_order, ORDER, message_id="order-7")
    assert first == Acknowledge("processed")
    assert Effect.objects.filter(consumer="billing").count() == 1
    [captured] = published("payment.captured")
    assert captured.payload == {"order_id": 7, "amount": "19.90"}

    # The broker delivers it again (a lost ack, a restart): the inbox absorbs it.
    again = deliver(charge_order, ORDER, message_id="order-7", redelivered=True)
    assert again == Acknowledge("duplicate")
    assert Effect.objects.filter(consumer="billing").count() == 1
    assert len(published("payment.captured")) == 1


def test_a_gateway_outage_is_retried_then_dead_lettered(
    db: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    def gateway_down(card: str, amount: Decimal) -> str:
        raise ConnectionError("payment gateway unreachable")

    monkeypatch.setattr(gateway, "charge", gateway_down)

    outcome = deliver(charge_order, ORDER, message_id="order-8")
    assert isinstance(outcome, ScheduleRetry)
    assert (outcome.delay, outcome.next_attempt) == (10, 2)
    assert outcome.error == "ConnectionError: payment gateway unreachable"

    # What the relay hands back later: the same message, next attempt.
    outcome = deliver(charge_order, ORDER, message_id="order-8", attempt=outcome.next_attempt)
    assert isinstance(outcome, ScheduleRetry)
    assert (outcome.delay, outcome.next_attempt) == (60, 3)

    outcome = deliver(charge_order, ORDER, message_id="order-8", attempt=outcome.next_attempt)
    assert outcome == Acknowledge("dead_lettered", "retries_exhausted")
    letter = DeadLetter.objects.get(consumer="billing.charge_order", message_id="order-8")
    assert (letter.reason, letter.attempts) == ("retries_exhausted", 3)
    assert letter.exception_message == "payment gateway unreachable"
    # Every attempt rolled back: no charge recorded, nothing announced.
    assert not Effect.objects.filter(consumer="billing").exists()
    assert published() == []


def test_a_declined_card_is_a_dead_letter_at_once(db: None) -> None:
    outcome = deliver(charge_order, {**ORDER, "card": "0000"}, message_id="order-9")
    assert outcome == Acknowledge("dead_lettered", "permanent")
    letter = DeadLetter.objects.get(consumer="billing.charge_order", message_id="order-9")
    assert letter.exception_message == "card 0000 declined"


# --8<-- [end:tests]


# --8<-- [start:find_consumer]
def test_the_charge_consumer_is_bound_to_placed_orders() -> None:
    spec = find_consumer("billing.charge-order")  # a name, a queue or the handler itself
    assert spec.handler is charge_order
    assert spec.bindings == ("order.placed",)


# --8<-- [end:find_consumer]


# --8<-- [start:raw_body]
def test_a_body_that_is_not_json_is_a_dead_letter(db: None) -> None:
    outcome = deliver(charge_order, body=b"{not json", message_id="order-10")
    assert outcome == Acknowledge("dead_lettered", "invalid_json")


# --8<-- [end:raw_body]


# --8<-- [start:run_outbox]
def test_a_placed_order_is_charged_and_receipted(db: None) -> None:
    publish("order.placed", ORDER, message_id="order-11")  # what your view does
    assert [m.routing_key for m in published()] == ["order.placed"]

    outcomes = run_outbox()

    assert [(name, outcome) for name, _, outcome in outcomes] == [
        ("billing.charge_order", Acknowledge("processed")),
        ("billing.send_receipt", Acknowledge("processed")),
    ]
    assert outcomes[0][1] == "order-11"
    assert published() == []  # every row is marked sent
    assert Effect.objects.filter(consumer="receipts").count() == 1


def test_run_outbox_retries_at_once(db: None, monkeypatch: pytest.MonkeyPatch) -> None:
    def gateway_down(card: str, amount: Decimal) -> str:
        raise ConnectionError("payment gateway unreachable")

    monkeypatch.setattr(gateway, "charge", gateway_down)
    publish("order.placed", ORDER, message_id="order-12")

    outcomes = run_outbox()

    assert [type(outcome).__name__ for _, _, outcome in outcomes] == [
        "ScheduleRetry",
        "ScheduleRetry",
        "Acknowledge",
    ]
    assert outcomes[-1][2] == Acknowledge("dead_lettered", "retries_exhausted")


# --8<-- [end:run_outbox]


# -- what the guide says the helpers do not simulate --------------------------------------------


def test_deliver_does_not_enforce_the_handler_time_limit(db: None) -> None:
    """The watchdog that interrupts a handler past its limit runs in ``manage.py consume``."""
    from reliable_messaging.core.registry import ConsumerSpec

    def spin(message: Message) -> None:
        deadline = time.monotonic() + 0.5  # past the limit, in Python code an interrupt reaches
        while time.monotonic() < deadline:
            pass

    spec = ConsumerSpec(name="guide.spin", queue="guide.spin", handler=spin, timeout=0.1)
    assert deliver(spec, {}, message_id="slow") == Acknowledge("processed")


def test_deliver_runs_a_handler_again_after_a_database_conflict_uncharged(db: None) -> None:
    from django.db import connection

    from reliable_messaging.core.registry import ConsumerSpec

    calls: list[int] = []

    def conflicting_once(message: Message) -> None:
        calls.append(message.attempt)
        if len(calls) == 1:
            with connection.cursor() as cursor:
                cursor.execute(
                    "DO $$ BEGIN RAISE EXCEPTION 'could not serialize access (guide)' "
                    "USING ERRCODE = '40001'; END $$"
                )

    spec = ConsumerSpec(name="guide.conflict", queue="guide.conflict", handler=conflicting_once)
    assert deliver(spec, {}, message_id="conflict") == Acknowledge("processed")
    assert calls == [1, 1]  # run again in a new transaction, at the same attempt


def test_run_outbox_marks_a_row_no_consumer_matches_sent(db: None) -> None:
    """The relay would mark it ``unrouted`` (or retry it, under ``REQUIRE_ROUTE``)."""
    from reliable_messaging.models import OutboxMessage

    publish("nobody.listens", {"x": 1}, message_id="lonely")
    assert run_outbox() == []
    assert OutboxMessage.objects.get(message_id="lonely").status == "sent"
