"""Idempotent Celery tasks the suite runs eagerly and through a real worker.

Each records an :class:`~tests.testapp.models.Effect` (consumer = the task's label,
message_id = what it is about) before doing what its arguments ask: fail, sleep, or kill its own
pool child. The effect rolls back whenever the body raises or its process dies.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from celery import Task, shared_task

from reliable_messaging import idempotent_task
from tests.testapp.consumers import serialization_failure
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


@shared_task(name="tests.celery_tasks.reserve_stock", acks_late=True)
@idempotent_task(key=lambda order_id, conflicts=0: f"reserve:{order_id}")
def reserve_stock(order_id: int, conflicts: int = 0) -> int:
    """Meets a serialization failure (SQLSTATE 40001) on its first ``conflicts`` runs."""
    effect = record("reserve", str(order_id))
    serialization_failure("reserve", str(order_id), conflicts)
    return effect


@shared_task(name="tests.celery_tasks.long_key")
@idempotent_task(key=lambda text: text)
def long_key(text: str) -> int:
    return record("long_key", text[:100])


@shared_task(name="tests.celery_tasks.kill_child", bind=True)
@idempotent_task(key=lambda about, **options: f"kill:{about}")
def kill_child(self: Task[Any, Any], about: str, only_first_delivery: bool = False) -> int:
    """Records its effect, then SIGKILLs its own pool child, as the OOM killer would: every
    time, or only on the first delivery of its message (then it succeeds on the redelivery)."""
    if self.request.is_eager or self.request.called_directly:
        raise RuntimeError("kill_child only runs in a worker's pool child, never in the tests")
    effect = record("kill_child", about)
    if not (only_first_delivery and self.request.delivery_info.get("redelivered")):
        os.kill(os.getpid(), signal.SIGKILL)
    return effect
