"""Scheduled messages: ``scheduled`` outbox rows due at ``next_attempt_at``, made pending under
a new id when due, or cancelled before (``docs/scheduling.md``)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from typing import Any, NamedTuple

from django.db import connections, transaction
from django.db.models import F
from django.db.models.functions import Now

from ..choices import OutboxStatus, TaskRunStatus
from ..models import OutboxMessage, TaskRun
from ..storage.partitions import again_if_moved

# How many due rows one promotion moves, in one short transaction.
PROMOTE_CHUNK = 5000


def _scheduled(using: str) -> Any:
    return OutboxMessage.objects.using(using).filter(status=OutboxStatus.SCHEDULED)


def _cancellable(using: str) -> Any:
    """The scheduled messages ``publish()`` wrote. Not a consumer's retry copy: the only copy
    of a delivery that failed (its original was acked), whose cancel would lose it."""
    return _scheduled(using).filter(raw_properties__isnull=True)


class Cancelled(NamedTuple):
    messages: int
    tasks: int  # of them, deferred tasks' messages, whose results went with them


def cancel(message_id: str, using: str) -> bool:
    """Delete the scheduled message ``message_id`` (in a savepoint); True when one was."""
    return bool(_delete_scheduled(_cancellable(using).filter(message_id=message_id), using)[0])


def cancel_rows(pks: Iterable[int], using: str) -> Cancelled:
    """Cancel those of the rows ``pks`` still scheduled, as :func:`cancel` does."""
    return _delete_scheduled(_cancellable(using).filter(pk__in=list(pks)), using)


def _delete_scheduled(rows: Any, using: str) -> Cancelled:
    """Delete ``rows``, and the result of each that is a deferred task's message: a task
    cancelled before it was due is as if never enqueued (no result READY for ever)."""

    def delete() -> Cancelled:
        # A relay that made a row pending meanwhile moved it: the next try does not find it.
        with transaction.atomic(using=using):
            taken = dict(rows.select_for_update().values_list("pk", "message_id"))
            if not taken:
                return Cancelled(0, 0)
            OutboxMessage.objects.using(using).filter(pk__in=taken)._raw_delete(using)
            results = TaskRun.objects.using(using).filter(
                status=TaskRunStatus.READY, run_after__isnull=False
            )
            tasks = results.filter(id__in=set(taken.values()))._raw_delete(using)
            return Cancelled(len(taken), int(tasks))

    return again_if_moved(delete)


def promote_due(using: str, limit: int = PROMOTE_CHUNK, due_by: dt.datetime | None = None) -> int:
    """Make up to ``limit`` due scheduled rows pending under new ids in due order, skipping
    those another relay holds; how many. ``due_by`` replaces the database's clock. Again when
    another relay promoted a row meanwhile: moved after this statement's snapshot, it is not a
    lock that SKIP LOCKED can skip."""
    return again_if_moved(lambda: _promote(using, limit, due_by))


def _promote(using: str, limit: int, due_by: dt.datetime | None) -> int:
    connection = connections[using]
    if connection.vendor == "postgresql":
        table = connection.ops.quote_name(OutboxMessage._meta.db_table)
        with transaction.atomic(using=using), connection.cursor() as cursor:
            # Both CTEs run once (MATERIALIZED): as a subquery, a planner that thinks the
            # partition empty rescans it for each row of a nested loop, promoting more than
            # ``limit`` rows and numbering them out of due order. nextval() numbers the rows
            # as ``due`` yields them: in due order.
            cursor.execute(
                "WITH due AS MATERIALIZED ("  # noqa: S608
                f"SELECT id FROM {table} WHERE status = 'scheduled' "
                "AND next_attempt_at <= coalesce(%s, now()) "
                "ORDER BY next_attempt_at, id LIMIT %s FOR UPDATE SKIP LOCKED), "
                "numbered AS MATERIALIZED ("
                f"SELECT id, nextval(pg_get_serial_sequence('{table}', 'id')) AS new_id FROM due) "
                f"UPDATE {table} o SET id = n.new_id, status = 'pending', "
                "next_attempt_at = now() FROM numbered n "
                "WHERE o.id = n.id AND o.status = 'scheduled'",
                [due_by, limit],
            )
            return int(cursor.rowcount)
    with transaction.atomic(using=using):
        rows = list(
            _scheduled(using)
            .filter(next_attempt_at__lte=Now() if due_by is None else due_by)
            .order_by("next_attempt_at", "id")[:limit]
        )
        if not rows:
            return 0
        pks = [row.pk for row in rows]
        OutboxMessage.objects.using(using).filter(pk__in=pks)._raw_delete(using)
        for row in rows:
            row.pk = None
            row.status = OutboxStatus.PENDING
            row.next_attempt_at = Now()
        OutboxMessage.objects.using(using).bulk_create(rows)
        return len(rows)


def next_due_in(using: str) -> float | None:
    """Seconds until the next scheduled row is due; None when none is scheduled."""
    return first_due_in(_scheduled(using))


def first_due_in(rows: Any) -> float | None:
    """Seconds until the first of ``rows`` is due by the database's clock (0 when overdue)."""
    due_in: dt.timedelta | None = (
        rows.order_by("next_attempt_at")
        .annotate(due_in=F("next_attempt_at") - Now())
        .values_list("due_in", flat=True)
        .first()
    )
    return None if due_in is None else max(0.0, due_in.total_seconds())
