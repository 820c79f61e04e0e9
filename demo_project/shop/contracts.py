"""The shop's message contracts: what each routing key it publishes carries.

``reliable_messaging`` imports this module on startup (like ``consumers.py``), so every
``publish()`` of these keys is checked against its type before its row is written, and
``manage.py asyncapi`` documents each with its schema. The handlers in ``consumers.py`` declare
the same types with ``@consumer(..., payload=...)`` and are given their objects. A pydantic
model, a dataclass and a TypedDict: the three kinds a payload type may be.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from typing import TypedDict

from pydantic import BaseModel

from reliable_messaging.contracts import publishes

ORDER_PLACED = "order.placed"
PAYMENT_CAPTURED = "payment.captured"
PAYMENT_REMINDER = "payment.reminder"
OFFER_SENT = "offer.sent"


class OrderEvent(BaseModel):
    """What every event about an order carries (the timeline reads only this)."""

    order_id: int


@publishes(ORDER_PLACED)
class OrderPlaced(OrderEvent):
    amount: Decimal


@publishes(PAYMENT_CAPTURED)
class PaymentCaptured(OrderEvent):
    pass


@publishes(PAYMENT_REMINDER)
@dataclass(frozen=True)
class PaymentReminderDue:
    order_id: int


class Offer(TypedDict):
    offer: str


publishes(OFFER_SENT, Offer)
