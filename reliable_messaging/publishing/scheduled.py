"""Scheduled messages: made pending when due, and cancelled before.

A message published with ``deliver_at``/``delay`` waits as a ``scheduled`` outbox row whose
``next_attempt_at`` is its due time. On PostgreSQL those rows have a partition of their own, so
a month of them costs the claim (which reads the index of due pending rows) and every publish
nothing. The relay moves the due ones to the pending rows a chunk at a time (:func:`promote_due`,
run before a claim when something is due, see :class:`.claims.OutboxClaims`), each under a new
id: per ordering key, the relay sends rows in id order, so a scheduled message takes its place in
its key's order at its due time and holds nothing back before then.

Times are the database's clock, as for every other outbox row.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Iterable
from typing import Any

from django.db import DatabaseError, connections, transaction
from django.db.models import F
from django.db.models.functions import Now

from ..choices import OutboxStatus
from ..models import OutboxMessage
from ..storage.partitions import row_moved

logger = logging.getLogger("reliable_messaging.relay")

# How many due rows one promotion moves, in one short transaction. A burst due at one second
# is moved this many at a time, each chunk well ahead of what the relay sends meanwhile.
PROMOTE_CHUNK = 5000
# How often a cancel is tried again when the row was moved by the relay meanwhile (see
# storage.partitions.row_moved): the next try finds it no longer scheduled.
MOVED_TRIES = 3


def _scheduled(using: str) -> Any:
    return OutboxMessage.objects.using(using).filter(status=OutboxStatus.SCHEDULED)


def cancel(message_id: str, using: str) -> bool:
    """Delete the scheduled row of ``message_id`` in the caller's transaction (in a savepoint,
    so a race with the relay leaves that transaction usable). True when one was deleted."""
    return bool(_delete_scheduled(_scheduled(using).filter(message_id=message_id), using))


def cancel_rows(pks: Iterable[int], using: str) -> int:
    """Delete those of the rows ``pks`` that still wait for their due time, and no other row
    (another row may have the same message_id), as :func:`cancel` does; returns how many."""
    return _delete_scheduled(_scheduled(using).filter(pk__in=list(pks)), using)


def _delete_scheduled(rows: Any, using: str) -> int:
    for attempt in range(1, MOVED_TRIES + 1):
        try:
            with transaction.atomic(using=using):
                return int(rows._raw_delete(using))
        except DatabaseError as exc:
            # The relay made it pending meanwhile (PostgreSQL moved it to another partition):
            # it is being sent; the next try does not find it among the scheduled ones.
            if not row_moved(exc) or attempt == MOVED_TRIES:
                raise
    raise AssertionError("unreachable")  # pragma: no cover


def promote_due(using: str, limit: int = PROMOTE_CHUNK, due_by: dt.datetime | None = None) -> int:
    """Make up to ``limit`` due scheduled rows pending, earliest due first, each under a new id
    (in due order); returns how many. Rows another relay is promoting are skipped. ``due_by``
    (the testing helpers' "a day later") replaces the database's clock."""
    connection = connections[using]
    if connection.vendor == "postgresql":
        table = connection.ops.quote_name(OutboxMessage._meta.db_table)
        with transaction.atomic(using=using), connection.cursor() as cursor:
            # The inner SELECT yields the rows in due order, and nextval() numbers them as they
            # come: the new ids keep that order.
            cursor.execute(
                f"UPDATE {table} o SET id = r.new_id, status = 'pending', "  # noqa: S608
                "next_attempt_at = now() FROM ("
                f"SELECT d.id, nextval(pg_get_serial_sequence('{table}', 'id')) AS new_id FROM ("
                f"SELECT id FROM {table} WHERE status = 'scheduled' "
                "AND next_attempt_at <= coalesce(%s, now()) "
                "ORDER BY next_attempt_at, id LIMIT %s FOR UPDATE SKIP LOCKED) d) r "
                "WHERE o.id = r.id AND o.status = 'scheduled'",
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
        OutboxMessage.objects.using(using).filter(pk__in=[row.pk for row in rows])._raw_delete(
            using
        )
        for row in rows:
            row.pk = None
            row.status = OutboxStatus.PENDING
            row.next_attempt_at = Now()
        OutboxMessage.objects.using(using).bulk_create(rows)
        return len(rows)


def next_due_in(using: str) -> float | None:
    """Seconds until the next scheduled row is due by the database's clock (0 when one is due
    now); None when none is scheduled. Reads the first entry of the scheduled rows' index."""
    due_in: dt.timedelta | None = (
        _scheduled(using)
        .order_by("next_attempt_at")
        .annotate(due_in=F("next_attempt_at") - Now())
        .values_list("due_in", flat=True)
        .first()
    )
    return None if due_in is None else max(0.0, due_in.total_seconds())


def scheduled_count(using: str) -> int:
    """How many messages wait for their due time (the metrics and the status count them)."""
    return int(_scheduled(using).count())
