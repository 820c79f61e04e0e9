"""A rolling deploy: producer and consumer on different versions of a payload type, both ways
(old producer → new consumer, new producer → old consumer), through the real outbox, relay,
broker and consumer (``docs/contracts.md#versions``).

Each test runs the old and the new consumer side by side (their own queues, both bound), and
publishes one message with each version's declaration: every pair is seen in one run.
"""

from __future__ import annotations

import decimal
from typing import Any

import pydantic
import pytest
from django.db import transaction

from reliable_messaging import publish
from reliable_messaging.choices import DeadLetterReason
from reliable_messaging.contracts import published_registry, publishes
from reliable_messaging.models import DeadLetter, OutboxMessage
from tests.e2e.test_replay_routing import relay_once
from tests.integration.contracts.support import Handled, recording_spec
from tests.support import drained

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]


class PlacedV1(pydantic.BaseModel):
    order_id: int
    amount: decimal.Decimal


class PlacedV2(pydantic.BaseModel):
    """V1 and a field added with a default."""

    order_id: int
    amount: decimal.Decimal
    currency: str = "EUR"


class PlacedV3(pydantic.BaseModel):
    """V1 with ``amount`` removed."""

    order_id: int


class PlacedV1Tolerant(pydantic.BaseModel):
    """V1 as its consumers must run it before producers remove ``amount``: with a default."""

    order_id: int
    amount: decimal.Decimal | None = None


def publish_as(version: type[pydantic.BaseModel], routing_key: str, **payload: Any) -> str:
    """Publish as a producer that declares ``version`` for ``routing_key`` (and commit)."""
    with published_registry.isolated(), transaction.atomic():
        publishes(routing_key, version)
        return publish(routing_key, payload)


def test_a_field_added_with_a_default_flows_both_ways(
    ns: str, rm_settings: dict[str, Any], service: Any
) -> None:
    handled = Handled()
    old = recording_spec(ns, "old", handled, PlacedV1)
    new = recording_spec(ns, "new", handled, PlacedV2)
    service([old, new], on_outcome=handled.on_outcome)
    from_old = publish_as(PlacedV1, "order.placed", order_id=1, amount="1.00")
    from_new = publish_as(PlacedV2, "order.placed", order_id=2, amount="2.00", currency="SEK")
    relay_once(ns)
    handled.wait(old.name, 2)
    handled.wait(new.name, 2)
    expected = {from_old: ["processed"], from_new: ["processed"]}
    assert handled.results(old.name) == expected
    assert handled.results(new.name) == expected
    # New producer → old consumer: the added field is ignored.
    assert handled.given(old.name) == [
        PlacedV1(order_id=1, amount=decimal.Decimal("1.00")),
        PlacedV1(order_id=2, amount=decimal.Decimal("2.00")),
    ]
    # Old producer → new consumer: the field missing, its default is used.
    assert handled.given(new.name) == [
        PlacedV2(order_id=1, amount=decimal.Decimal("1.00"), currency="EUR"),
        PlacedV2(order_id=2, amount=decimal.Decimal("2.00"), currency="SEK"),
    ]


def test_a_removed_field_is_refused_by_consumers_that_still_require_it(
    ns: str, rm_settings: dict[str, Any], service: Any
) -> None:
    handled = Handled()
    old = recording_spec(ns, "old", handled, PlacedV1)
    tolerant = recording_spec(ns, "tolerant", handled, PlacedV1Tolerant)
    new = recording_spec(ns, "new", handled, PlacedV3)
    service([old, tolerant, new], on_outcome=handled.on_outcome)
    from_old = publish_as(PlacedV1, "order.placed", order_id=1, amount="1.00")
    from_new = publish_as(PlacedV3, "order.placed", order_id=2)
    relay_once(ns)
    for spec in (old, tolerant, new):
        handled.wait(spec.name, 2)
    # Old producer → new consumer: the removed field is ignored.
    assert handled.results(new.name) == {from_old: ["processed"], from_new: ["processed"]}
    # New producer → old consumer still requiring it: a dead letter before its handler, which
    # replays once the consumer is deployed with the field optional (as "tolerant" is).
    assert handled.results(old.name) == {
        from_old: ["processed"],
        from_new: ["dead_lettered:invalid_payload"],
    }
    letter = DeadLetter.objects.get(consumer=old.name, message_id=from_new)
    assert letter.reason == DeadLetterReason.INVALID_PAYLOAD
    assert letter.exception_message.endswith("amount: Field required")
    assert handled.results(tolerant.name) == {from_old: ["processed"], from_new: ["processed"]}
    assert handled.given(tolerant.name)[1] == PlacedV1Tolerant(order_id=2, amount=None)


def test_a_renamed_routing_key_reaches_only_consumers_bound_to_it(
    ns: str, rm_settings: dict[str, Any], service: Any
) -> None:
    handled = Handled()
    old = recording_spec(ns, "old", handled, PlacedV1, bindings=("order.placed",))
    new = recording_spec(ns, "new", handled, PlacedV1, bindings=("order.placed", "order.created"))
    service([old, new], on_outcome=handled.on_outcome)
    from_old = publish_as(PlacedV1, "order.placed", order_id=1, amount="1")
    from_new = publish_as(PlacedV1, "order.created", order_id=2, amount="2")
    relay_once(ns)
    # New consumer, bound to both keys through the deploy: both producers reach it.
    handled.wait(new.name, 2)
    assert handled.results(new.name) == {from_old: ["processed"], from_new: ["processed"]}
    # Old consumer, bound to the old key only: the renamed key never reaches its queue (the
    # broker routed it elsewhere; with no queue bound at all it would be "unrouted").
    handled.wait(old.name, 1)
    assert drained(old.queue, new.queue)
    assert handled.results(old.name) == {from_old: ["processed"]}
    assert OutboxMessage.objects.get(message_id=from_new).status == "sent"
