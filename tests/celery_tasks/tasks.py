"""Idempotent Celery tasks the suite runs eagerly and through a real worker.

Each records an :class:`~tests.testapp.models.Effect` (consumer = the task's label,
message_id = what it is about) before doing what its arguments ask: fail, or sleep. The effect
rolls back whenever the body raises.
"""

from __future__ import annotations

import time
from typing import Any

from celery import Task, shared_task

from reliable_messaging import idempotent_task
from tests.testapp.models import Effect


def record(label: str, about: str, attempt: int = 1) -> int:
    return Effect.objects.create(consumer=label, message_id=about, attempt=attempt).pk


@shared_task(name="tests.celery_tasks.email_receipt", acks_late=True)
@idempotent_task(key=lambda order_id, **options: f"receipt:{order_id}")
def email_receipt(order_id: int, fail: bool = False, sleep: float = 0.0) -> int:
    """Keyed by order: two calls for one order take effect once."""
    effect = record("receipt", str(order_id))
    time.sleep(sleep)
    if fail:
        raise RuntimeError(f"mail server refused the receipt of order {order_id}")
    return effect


@shared_task(name="tests.celery_tasks.restock", acks_late=True)
@idempotent_task
def restock(sku: str) -> int:
    """Keyed by the Celery task id: a redelivered task message takes effect once."""
    return record("restock", sku)


@shared_task(
    name="tests.celery_tasks.charge",
    bind=True,
    autoretry_for=(ConnectionError,),
    retry_backoff=False,
    default_retry_delay=0,
    max_retries=2,
)
@idempotent_task(key=lambda order_id: f"charge:{order_id}", scope="tests.charges")
def charge(self: Task[Any, Any], order_id: int) -> int:
    """Bound, with Celery's automatic retry: its first attempt fails after writing."""
    effect = record("charge", str(order_id), attempt=self.request.retries + 1)
    if self.request.retries == 0:
        raise ConnectionError("payment gateway timed out")
    return effect


@shared_task(name="tests.celery_tasks.long_key")
@idempotent_task(key=lambda text: text)
def long_key(text: str) -> int:
    return record("long_key", text[:100])
