"""Orders and what the handlers do with them: payments, shipments, receipts; and the receipt
emails a Celery task sends.

No unique constraint ties a payment, shipment, receipt or email to its order, on purpose: the
inbox alone must keep them single, and a doubled charge would show up as a second row.

The managers and ``order_id`` are declared explicitly because the repository's mypy runs the
django-stubs plugin with ``tests.settings``, where this app is not installed, so the plugin
cannot add them.
"""

from __future__ import annotations

from typing import ClassVar

from django.db import models
from django.utils import timezone


class Card(models.TextChoices):
    """How the payment gateway treats the order's card."""

    OK = "ok", "ok"
    FLAKY = "flaky", "flaky (gateway times out once)"
    DECLINED = "declined", "declined"


class Order(models.Model):
    customer = models.CharField(max_length=100)
    amount = models.DecimalField(max_digits=10, decimal_places=2)
    card = models.CharField(max_length=10, choices=Card.choices, default=Card.OK)
    created_at = models.DateTimeField(default=timezone.now)

    objects: ClassVar[models.Manager[Order]] = models.Manager()

    def __str__(self) -> str:
        return f"order {self.pk} ({self.customer}, {self.amount})"


class Payment(models.Model):
    order = models.ForeignKey(Order, on_delete=models.CASCADE, related_name="payments")
    order_id: int
    amount = models.DecimalField(max_digits=10, decimal_places=2)
    # The delivery attempt whose transaction committed the charge: 2 after one transient failure.
    attempt = models.PositiveIntegerField()
    created_at = models.DateTimeField(default=timezone.now)

    objects: ClassVar[models.Manager[Payment]] = models.Manager()

    def __str__(self) -> str:
        return f"payment of {self.amount} for order {self.order_id}"


class Shipment(models.Model):
    order = models.ForeignKey(Order, on_delete=models.CASCADE, related_name="shipments")
    order_id: int
    created_at = models.DateTimeField(default=timezone.now)

    objects: ClassVar[models.Manager[Shipment]] = models.Manager()

    def __str__(self) -> str:
        return f"shipment of order {self.order_id}"


class Receipt(models.Model):
    order = models.ForeignKey(Order, on_delete=models.CASCADE, related_name="receipts")
    order_id: int
    created_at = models.DateTimeField(default=timezone.now)

    objects: ClassVar[models.Manager[Receipt]] = models.Manager()

    def __str__(self) -> str:
        return f"receipt for order {self.order_id}"


class TimelineEvent(models.Model):
    """One event of an order's timeline, written by the ordered ``timeline`` consumer: its rows
    of one order must come in publish order (placed, then paid)."""

    order = models.ForeignKey(Order, on_delete=models.CASCADE, related_name="timeline")
    order_id: int
    event = models.CharField(max_length=50)

    objects: ClassVar[models.Manager[TimelineEvent]] = models.Manager()

    def __str__(self) -> str:
        return f"{self.event} of order {self.order_id}"


class ReceiptEmail(models.Model):
    """A receipt emailed to the customer by the ``shop.email_receipt`` Celery task."""

    order = models.ForeignKey(Order, on_delete=models.CASCADE, related_name="receipt_emails")
    order_id: int
    created_at = models.DateTimeField(default=timezone.now)

    objects: ClassVar[models.Manager[ReceiptEmail]] = models.Manager()

    def __str__(self) -> str:
        return f"receipt email for order {self.order_id}"


class PaymentReminder(models.Model):
    """A reminder to pay, sent by the ``reminders`` consumer when a message scheduled with the
    order (``publish(delay=...)``) fell due and the order was still unpaid; the payment cancels
    it before then (``cancel_scheduled``)."""

    order = models.ForeignKey(Order, on_delete=models.CASCADE, related_name="reminders")
    order_id: int
    # When the scheduled message was due (its x-rm-published-at), and when it was handled.
    due_at = models.DateTimeField()
    created_at = models.DateTimeField(default=timezone.now)

    objects: ClassVar[models.Manager[PaymentReminder]] = models.Manager()

    def __str__(self) -> str:
        return f"payment reminder for order {self.order_id}"
