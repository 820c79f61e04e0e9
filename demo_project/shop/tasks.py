"""The shop's Celery task: email a customer the receipt of their order, once.

Customers can ask for their receipt by email as often as they like (and a web request retried
by a proxy asks twice); ``@idempotent_task`` keyed by the order makes all of those calls one
email. The key is remembered in the inbox, in the same transaction as the email's record.
"""

from __future__ import annotations

from celery import shared_task

from reliable_messaging import idempotent_task

from .models import ReceiptEmail

EMAIL_RECEIPT = "shop.email_receipt"


@shared_task(name=EMAIL_RECEIPT, acks_late=True)
@idempotent_task(key=lambda order_id: f"receipt-email:{order_id}")
def email_receipt(order_id: int) -> int:
    """Email the receipt of ``order_id``; returns the email's id (None for a repeated call)."""
    return ReceiptEmail.objects.create(order_id=order_id).pk
