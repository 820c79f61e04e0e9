"""Celery tasks, for teams that schedule work with Celery beat instead of running processes.

Add to your beat schedule::

    CELERY_BEAT_SCHEDULE = {
        "relay-outbox": {"task": "reliable_messaging.relay_outbox", "schedule": 5.0},
    }

Each run drains the outbox for at most ``max_seconds`` and returns a summary. Runs may overlap:
rows are claimed with ``SELECT ... FOR UPDATE SKIP LOCKED``, so no row is sent twice by two runs.
"""

from __future__ import annotations

from typing import Any

from celery import shared_task

from .relay import OutboxRelay


@shared_task(name="reliable_messaging.relay_outbox", ignore_result=False)
def relay_outbox(max_seconds: float = 50.0, batch_size: int | None = None) -> dict[str, Any]:
    """Publish pending outbox rows until none is left or ``max_seconds`` have passed."""
    report = OutboxRelay(
        once=True, max_seconds=max_seconds, batch_size=batch_size, listen=False
    ).run()
    return {
        "sent": report.sent,
        "nacked": report.nacked,
        "unroutable": report.returned,
        "pending": report.left_pending,
        "failed": report.left_failed,
    }
