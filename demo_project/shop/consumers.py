"""The shop's handlers; ``reliable_messaging`` imports this module on startup.

Each runs inside ``transaction.atomic()`` with its inbox row, so a duplicated or redelivered
message_id never charges, ships or receipts twice.
"""

from __future__ import annotations

import datetime as dt

from reliable_messaging import Message, PermanentError, cancel_scheduled, consumer, publish

from .contracts import (
    OFFER_SENT,
    ORDER_PLACED,
    PAYMENT_CAPTURED,
    PAYMENT_REMINDER,
    Offer,
    OrderEvent,
    OrderPlaced,
    PaymentCaptured,
    PaymentReminderDue,
)
from .models import Card, Order, Payment, PaymentReminder, Receipt, Shipment, TimelineEvent

# Consumer names are the inbox's deduplication scope; the demo's report looks them up too.
BILLING = "billing.charge-order"
SHIPPING = "shipping.ship-order"
RECEIPTS = "receipts.send-receipt"
TIMELINE = "timeline.record-event"
REMINDERS = "reminders.payment-reminder"
OFFERS = "offers.show-offer"
# An order not paid this long after it was placed gets a reminder (a real shop: a day).
REMINDER_DELAY = dt.timedelta(seconds=6)


def reminder_id(order: Order) -> str:
    """The message_id of an order's payment reminder: the payment cancels it by this id."""
    return f"payment-reminder-{order.pk}"


def order_of(message: Message) -> Order:
    """The order a message is about (its payload is one of the declared types, each with an
    ``order_id``). An order that does not exist can never be found by retrying: a permanent
    error."""
    order_id = message.payload.order_id
    try:
        return Order.objects.get(pk=order_id)
    except Order.DoesNotExist:
        raise PermanentError(f"order {order_id!r} does not exist") from None


@consumer("shop.billing", bindings=[ORDER_PLACED], name=BILLING, payload=OrderPlaced)
def charge_order(message: Message) -> None:
    """Charge the order once, then announce it with ``payment.captured``."""
    order = order_of(message)
    if order.card == Card.DECLINED:
        raise PermanentError("card declined")
    if order.card == Card.FLAKY and message.attempt < 2:
        # Any exception other than PermanentError is retried after RETRY_DELAYS.
        raise ConnectionError("payment gateway timed out")
    Payment.objects.create(order=order, amount=order.amount, attempt=message.attempt)
    # Same transaction as the payment: the event exists exactly when the charge does, and the
    # reminder scheduled with the order is cancelled exactly when the charge is made.
    publish(PAYMENT_CAPTURED, {"order_id": order.pk}, ordering_key=str(order.pk))
    cancel_scheduled(reminder_id(order))


@consumer("shop.shipping", bindings=[ORDER_PLACED], name=SHIPPING, payload=OrderPlaced)
def ship_order(message: Message) -> None:
    """Ship the order."""
    Shipment.objects.create(order=order_of(message))


@consumer("shop.receipts", bindings=[PAYMENT_CAPTURED], name=RECEIPTS, payload=PaymentCaptured)
def send_receipt(message: Message) -> None:
    """Send the receipt of a captured payment."""
    Receipt.objects.create(order=order_of(message))


@consumer(
    "shop.timeline",
    bindings=[ORDER_PLACED, PAYMENT_CAPTURED],
    name=TIMELINE,
    ordered=True,
    payload=OrderEvent,
)
def record_event(message: Message) -> None:
    """The order's timeline, in publish order: both events carry the order as ordering key, so
    they reach the same partition and are handled one after the other, never the other way
    round, however many consume processes run."""
    TimelineEvent.objects.create(order=order_of(message), event=message.routing_key)


@consumer("shop.reminders", bindings=[PAYMENT_REMINDER], name=REMINDERS, payload=PaymentReminderDue)
def remind_unpaid(message: Message) -> None:
    """Remind the customer of an order still unpaid when its reminder fell due. Scheduled when
    the order was placed, in its transaction; the payment cancels it, so it arrives only for
    orders nobody paid (a payment made as it fell due finds the reminder sent: it is skipped)."""
    order = order_of(message)
    if order.payments.exists():
        return
    PaymentReminder.objects.create(order=order, due_at=message.published_at or order.created_at)


@consumer("shop.offers", bindings=[OFFER_SENT], name=OFFERS, payload=Offer)
def show_offer(message: Message) -> None:
    """Show a customer a time-limited offer. Offers are published with ``expires=...``: one that
    reaches this handler too late is not shown at all (outcome ``expired``, no inbox row), which
    is the point of a deadline; the inbox row of a shown one is the demo's record of it."""
