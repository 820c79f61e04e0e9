"""Retention without long transactions: day partitions dropped, or batches of short deletes."""

from __future__ import annotations

import datetime as dt
import functools
from collections.abc import Callable
from dataclasses import dataclass

from django.db import router
from django.utils import timezone

from ..conf import MessagingSettings, messaging_settings
from ..managers import BatchDeletingQuerySet
from ..models import (
    DeadLetter,
    DeadLetterGroup,
    OutboxMessage,
    ProcessedMessage,
    SuspectDelivery,
    TaskRun,
)
from . import partitions


@dataclass(frozen=True)
class PurgeResult:
    # Rows deleted (of the day partitions dropped: PostgreSQL's estimate).
    inbox: int
    outbox: int
    suspects: int = 0  # crash-guard rows of deliveries that never came back
    inbox_partitions: tuple[str, ...] = ()
    outbox_partitions: tuple[str, ...] = ()
    dead_letters: int = 0
    task_results: int = 0  # of finished django.tasks tasks


# Told after each deleted batch the table, the rows deleted so far and those due at the start.
OnBatch = Callable[[str, int, int], None]


def _purge(
    table: str,
    queryset: BatchDeletingQuerySet,
    batch_size: int,
    dry_run: bool,
    on_batch: OnBatch | None,
) -> int:
    if dry_run:
        return queryset.count()
    progress = None if on_batch is None else functools.partial(on_batch, table)
    return queryset.delete_in_batches(batch_size, progress)


def purge_messages(
    *,
    now: dt.datetime | None = None,
    batch_size: int = 5000,
    dry_run: bool = False,
    settings: MessagingSettings = messaging_settings,
    on_batch: OnBatch | None = None,
) -> PurgeResult:
    """Delete the inbox, crash-guard, sent outbox rows, closed dead letters and finished tasks'
    results past their retention settings; ``on_batch`` is told of each deleted batch."""
    now = now or timezone.now()

    def expire(
        spec: partitions.DayPartitioned, before: dt.datetime, rows: BatchDeletingQuerySet
    ) -> tuple[int, tuple[str, ...]]:
        """Drop the expired day partitions of ``spec``, or delete the expired ``rows``."""
        using = router.db_for_write(rows.model)
        if not partitions.is_partitioned(using, spec):
            return _purge(spec.label, rows, batch_size, dry_run, on_batch), ()
        if dry_run:
            return partitions.estimated_rows_of(using, partitions.expired(using, before, spec)), ()
        partitions.ensure_partitions(using, now=now, spec=spec)
        dropped = partitions.drop_expired(using, before, spec)
        if now > timezone.now():
            # A clock ahead (a test's, a what-if) may have dropped the days being written now.
            partitions.ensure_partitions(using, spec=spec)
        return sum(d.rows for d in dropped), tuple(d.name for d in dropped)

    inbox_before = now - settings.dedup_retention
    inbox_rows, inbox_partitions = expire(
        partitions.INBOX, inbox_before, ProcessedMessage.objects.expired(inbox_before)
    )
    outbox_before = now - settings.outbox_retention
    outbox_rows, outbox_partitions = expire(
        partitions.OUTBOX, outbox_before, OutboxMessage.objects.finished_before(outbox_before)
    )
    suspects = SuspectDelivery.objects.expired(now - settings.dedup_retention)
    dead_letters = 0
    if settings.dead_letter_retention is not None:
        closed = DeadLetter.objects.closed_before(now - settings.dead_letter_retention)
        dead_letters = _purge("dead letters", closed, batch_size, dry_run, on_batch)
    task_results = 0
    if settings.task_result_retention is not None:
        finished = TaskRun.objects.finished_before(now - settings.task_result_retention)
        task_results = _purge("task results", finished, batch_size, dry_run, on_batch)
    if not dry_run:
        # Folds the deltas (the purge's deletes among them) before it looks for empty groups.
        DeadLetterGroup.objects.forget_empty()
    return PurgeResult(
        inbox=inbox_rows,
        outbox=outbox_rows,
        suspects=_purge("suspects", suspects, batch_size, dry_run, on_batch),
        inbox_partitions=inbox_partitions,
        outbox_partitions=outbox_partitions,
        dead_letters=dead_letters,
        task_results=task_results,
    )
