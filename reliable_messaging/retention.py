"""Deleting old inbox rows and sent outbox rows, in bounded batches."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass

from django.db import models, router, transaction
from django.utils import timezone

from .conf import MessagingSettings, messaging_settings
from .models import OutboxMessage, OutboxStatus, ProcessedMessage, SuspectDelivery


@dataclass(frozen=True)
class PurgeResult:
    inbox: int
    outbox: int
    # Crash-guard rows of deliveries that never came back (dead-lettered elsewhere, purged).
    suspects: int = 0


# Called after each deleted batch with the table ("inbox" or "outbox"), the rows deleted from
# it so far, and how many were due when its purge started.
OnBatch = Callable[[str, int, int], None]


def _purge(
    table: str,
    queryset: models.QuerySet,
    batch_size: int,
    dry_run: bool,
    on_batch: OnBatch | None,
) -> int:
    if dry_run:
        return queryset.count()
    model = queryset.model
    using = router.db_for_write(model)
    # Counted only for a progress display: one more scan, cheap next to deleting the rows.
    total = queryset.using(using).count() if on_batch else 0
    deleted = 0
    while True:
        # One short transaction per batch: never a huge delete holding locks for minutes.
        with transaction.atomic(using=using):
            ids = list(
                queryset.using(using).order_by("pk").values_list("pk", flat=True)[:batch_size]
            )
            if not ids:
                return deleted
            deleted += model._default_manager.using(using).filter(pk__in=ids).delete()[0]
        if on_batch:
            on_batch(table, deleted, total)


def purge_messages(
    *,
    now: dt.datetime | None = None,
    batch_size: int = 5000,
    dry_run: bool = False,
    settings: MessagingSettings = messaging_settings,
    on_batch: OnBatch | None = None,
) -> PurgeResult:
    """Delete inbox rows older than ``DEDUP_RETENTION`` and sent outbox rows older than
    ``OUTBOX_RETENTION``, and crash-guard rows untouched for ``DEDUP_RETENTION``. Pending and
    failed outbox rows are never touched. ``on_batch`` is told of each deleted batch (see
    :data:`OnBatch`)."""
    now = now or timezone.now()
    inbox = ProcessedMessage.objects.filter(processed_at__lt=now - settings.dedup_retention)
    outbox = OutboxMessage.objects.filter(
        # Unrouted rows (events nobody subscribed to) are finished like sent ones.
        status__in=[OutboxStatus.SENT, OutboxStatus.UNROUTED],
        sent_at__lt=now - settings.outbox_retention,
    )
    suspects = SuspectDelivery.objects.filter(updated_at__lt=now - settings.dedup_retention)
    return PurgeResult(
        inbox=_purge("inbox", inbox, batch_size, dry_run, on_batch),
        outbox=_purge("outbox", outbox, batch_size, dry_run, on_batch),
        suspects=_purge("suspects", suspects, batch_size, dry_run, on_batch),
    )
