"""Retention: old inbox rows and sent outbox rows go, without long transactions.

On PostgreSQL the inbox and the outbox's sent rows are partitioned by day (see
``partitions.py``): their expired days are dropped whole, whatever their rows, and only the rows
of the pre-partitioning (legacy) tables are deleted one batch at a time.
Everywhere else rows are deleted in batches of short transactions. Resolved and discarded dead
letters older than ``DEAD_LETTER_RETENTION`` go in batches too (their failure groups' counts
follow, by the triggers of ``DeadLetterGroup``); dead and replayed ones are never purged. Then
the failure groups' deltas are folded and the groups left empty forgotten."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass

from django.db import connections, router, transaction
from django.utils import timezone

from ..conf import MessagingSettings, messaging_settings
from ..managers import BatchDeletingQuerySet
from ..models import DeadLetter, DeadLetterGroup, OutboxMessage, ProcessedMessage, SuspectDelivery
from . import partitions


@dataclass(frozen=True)
class PurgeResult:
    # Inbox rows deleted, plus PostgreSQL's estimate of those in the partitions dropped.
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
            using, partitions.INBOX, inbox_before, now, batch_size, dry_run, on_batch
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
            outbox_using, partitions.OUTBOX, outbox_before, now, batch_size, dry_run, on_batch
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
    batch_size: int,
    dry_run: bool,
    on_batch: OnBatch | None,
) -> tuple[int, tuple[str, ...]]:
    """Drop the expired day partitions of ``spec`` (for a dry run, estimate their rows), then
    delete in batches the expired rows of its legacy tables (those that are
    ``spec.finished``). Returns the rows and the names of the partitions dropped."""
    where = f"{spec.finished} AND " if spec.finished else ""
    if dry_run:
        dropped: list[partitions.Dropped] = []
        expired = [
            p.name
            for p in partitions.partitions(using, spec)
            if p.end is not None and p.end <= before
        ]
        rows = partitions.estimated_rows_of(using, expired)
    else:
        partitions.ensure_partitions(using, now=now, spec=spec)
        dropped = partitions.drop_expired(using, before, spec)
        if now > timezone.now():
            # A clock ahead (a test's, a what-if) may have dropped the days being written now.
            partitions.ensure_partitions(using, spec=spec)
        rows = sum(d.rows for d in dropped)
    names = [d.name for d in dropped]
    for name in partitions.row_partitions(using, spec):
        rows += _purge_partition(
            using, spec.label, name, spec.column, where, before, batch_size, dry_run, on_batch
        )
        if name in spec.legacy and not dry_run and partitions.drop_if_empty(using, name):
            names.append(name)
    return rows, tuple(names)


def _purge_partition(
    using: str,
    label: str,
    table: str,
    column: str,
    where: str,
    before: dt.datetime,
    batch_size: int,
    dry_run: bool,
    on_batch: OnBatch | None,
) -> int:
    """Delete, in batches, the rows of one partition (a legacy table)
    whose ``column`` is before ``before`` and that match ``where`` (a condition followed by
    AND, or empty)."""
    quoted = connections[using].ops.quote_name(table)
    with connections[using].cursor() as cursor:
        if dry_run or on_batch:
            cursor.execute(
                f"SELECT count(*) FROM {quoted} WHERE {where}{column} < %s",  # noqa: S608
                [before],
            )
            total = int(cursor.fetchone()[0])
            if dry_run:
                return total
    deleted = 0
    while True:
        with transaction.atomic(using=using), connections[using].cursor() as cursor:
            cursor.execute(
                f"DELETE FROM {quoted} WHERE id IN (SELECT id FROM {quoted} "  # noqa: S608
                f"WHERE {where}{column} < %s ORDER BY {column} LIMIT %s)",
                [before, batch_size],
            )
            batch = cursor.rowcount
        deleted += batch
        if batch and on_batch:
            on_batch(label, deleted, total)
        if batch < batch_size:
            return deleted
