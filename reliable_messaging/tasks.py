"""The Celery task ``reliable_messaging.relay_outbox`` (found by Celery's
``autodiscover_tasks()``), for teams that run the relay from Celery beat instead of
``manage.py relay`` (``docs/reference/commands.md``)."""

from __future__ import annotations

from typing import Any

try:
    from celery import shared_task
except ImportError as exc:  # the "celery" extra is not installed
    from .exceptions import MissingExtra

    raise MissingExtra("reliable_messaging.relay_outbox", "celery", "celery") from exc
from django.db import router

from .core.registry import registry
from .models import OutboxMessage
from .publishing.relay import build_relay
from .storage.partitions import OUTBOX, ensure_partitions


@shared_task(name="reliable_messaging.relay_outbox", ignore_result=False)
def relay_outbox(max_seconds: float = 50.0, batch_size: int | None = None) -> dict[str, Any]:
    """Publish pending outbox rows until none is left or ``max_seconds`` have passed."""
    # The sent rows' day partitions, made ahead as `manage.py relay` makes them.
    ensure_partitions(router.db_for_write(OutboxMessage), spec=OUTBOX)
    report = build_relay(
        once=True,
        max_seconds=max_seconds,
        batch_size=batch_size,
        listen=False,
        # Declared before it sends, as `manage.py relay` does, but once per worker process.
        consumers=registry.all(),
        declare_once_per_process=True,
    ).run()
    return {
        "sent": report.sent,
        "nacked": report.nacked,
        "unroutable": report.returned,
        "pending": report.left_pending,
        "failed": report.left_failed,
    }
