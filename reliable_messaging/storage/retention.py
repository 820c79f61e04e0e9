"""Retention: expired inbox rows, sent outbox rows, crash-guard rows and closed dead letters go,
without long transactions.

On PostgreSQL the inbox and the outbox's sent rows are partitioned by day (``partitions.py``):
their expired days are dropped whole. Everything else, and every table on SQLite, is deleted in
batches of short transactions. Dead and replayed dead letters are never purged; the failure
groups follow the deleted dead letters through their triggers, and the purge then folds their
deltas and forgets the groups left empty."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass

from django.db import router
from django.utils import timezone

from ..conf import MessagingSettings, messaging_settings
from ..managers import BatchDeletingQuerySet
from ..models import DeadLetter, DeadLetterGroup, OutboxMessage, ProcessedMessage, SuspectDelivery
from . import partitions


@dataclass(frozen=True)
class PurgeResult:
    # Rows deleted (on PostgreSQL, its estimate of the rows of the day partitions dropped).
    inbox: int
    outbox: int
    # Crash-guard rows of deliveries that never came back (dead-lettered elsewhere, purged).
    suspects: int = 0
    # The day partitions dropped whole (PostgreSQL).
    inbox_partitions: tuple[str, ...] = ()
    outbox_partitions: tuple[str, ...] = ()
    # Resolved and discarded dead letters past DEAD_LETTER_RETENTION.
    dead_letters: int = 0


# Called after each deleted batch with the table ("inbox" or "outbox"), the rows deleted from
# it so far, and how many were due when its purge started.
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

    def progress(deleted: int, total: int) -> None:
        if on_batch:
            on_batch(table, deleted, total)

    return queryset.delete_in_batches(batch_size, progress if on_batch else None)


def purge_messages(
    *,
    now: dt.datetime | None = None,
    batch_size: int = 5000,
    dry_run: bool = False,
    settings: MessagingSettings = messaging_settings,
    on_batch: OnBatch | None = None,
) -> PurgeResult:
    """Delete inbox rows older than ``DEDUP_RETENTION``, sent outbox rows older than
    ``OUTBOX_RETENTION``, crash-guard rows untouched for ``DEDUP_RETENTION``, and resolved
    and discarded dead letters untouched for ``DEAD_LETTER_RETENTION`` (unless None). Pending and
    failed outbox rows are never touched. ``on_batch`` is told of each deleted batch (see
    :data:`OnBatch`)."""
    now = now or timezone.now()
    using = router.db_for_write(ProcessedMessage)
    inbox_before = now - settings.dedup_retention
    if partitions.is_partitioned(using, partitions.INBOX):
        inbox_rows, inbox_partitions = _purge_days(
            using, partitions.INBOX, inbox_before, now, dry_run
        )
    else:
        inbox = ProcessedMessage.objects.expired(inbox_before)
        inbox_rows = _purge("inbox", inbox, batch_size, dry_run, on_batch)
        inbox_partitions = ()
    outbox_before = now - settings.outbox_retention
    outbox_using = router.db_for_write(OutboxMessage)
    if partitions.is_partitioned(outbox_using, partitions.OUTBOX):
        # Unrouted rows (events nobody subscribed to) are finished like sent ones.
        outbox_rows, outbox_partitions = _purge_days(
            outbox_using, partitions.OUTBOX, outbox_before, now, dry_run
        )
    else:
        outbox = OutboxMessage.objects.finished_before(outbox_before)
        outbox_rows = _purge("outbox", outbox, batch_size, dry_run, on_batch)
        outbox_partitions = ()
    suspects = SuspectDelivery.objects.expired(now - settings.dedup_retention)
    dead_letters = 0
    if settings.dead_letter_retention is not None:
        closed = DeadLetter.objects.closed_before(now - settings.dead_letter_retention)
        dead_letters = _purge("dead letters", closed, batch_size, dry_run, on_batch)
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
    )


def _purge_days(
    using: str,
    spec: partitions.DayPartitioned,
    before: dt.datetime,
    now: dt.datetime,
    dry_run: bool,
) -> tuple[int, tuple[str, ...]]:
    """Drop the expired day partitions of ``spec`` (for a dry run, estimate their rows).
    Returns PostgreSQL's estimate of their rows and their names."""
    if dry_run:
        expired = partitions.expired(using, before, spec)
        return partitions.estimated_rows_of(using, expired), ()
    partitions.ensure_partitions(using, now=now, spec=spec)
    dropped = partitions.drop_expired(using, before, spec)
    if now > timezone.now():
        # A clock ahead (a test's, a what-if) may have dropped the days being written now.
        partitions.ensure_partitions(using, spec=spec)
    return sum(d.rows for d in dropped), tuple(d.name for d in dropped)
