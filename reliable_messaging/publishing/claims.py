"""The relay's database side, on its database workers: claim due outbox rows, and hold or lease
them while in flight (``docs/design.md#the-relay-a-pipeline-with-publisher-confirms``)."""

from __future__ import annotations

import datetime as dt
import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from django.db import DatabaseError, connections, transaction
from django.db.models import BigIntegerField, DurationField, Min, Value
from django.db.models.expressions import RawSQL
from django.db.models.functions import Now

from ..choices import OutboxStatus
from ..conf import MessagingSettings
from ..models import OutboxMessage
from ..storage.partitions import again_if_moved
from . import scheduled
from .wake_after_commit import release_next_sql

# A claimed row's age counts from its publish() or its later due time, in microseconds since
# the epoch: date_part's double (cheaper than extract's numeric) is exact until 2255.
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_PUBLISHED_US = "round(date_part('epoch', GREATEST(created_at, deliver_at)) * 1000000)::bigint"

# The bytes of bodies one claim takes at most (its first row whatever its size).
CLAIM_BYTES = 16 * 1024 * 1024
# A row's bytes as they go out (octet_length does not decompress).
_ROW_BYTES = "coalesce(octet_length({t}.raw_body), octet_length({t}.body))"

logger = logging.getLogger("reliable_messaging.relay")

T = TypeVar("T")


def _behind() -> RawSQL:
    """``behind``: the id of an unsent row before the outer row in its key, or NULL."""
    table = f'"{OutboxMessage._meta.db_table}"'
    sql = (
        f"CASE WHEN {table}.ordering_key IS NULL THEN NULL ELSE ("  # noqa: S608
        f"SELECT u.id FROM {table} u WHERE u.status IN ('pending', 'failed')"
        f" AND u.ordering_key = {table}.ordering_key"
        f" AND (u.ordering_key, u.id) < ({table}.ordering_key, {table}.id)"
        " ORDER BY u.ordering_key, u.id LIMIT 1) END"
    )
    # No input of anyone in this SQL: only the table name and constants.
    return RawSQL(sql, (), output_field=BigIntegerField())  # noqa: S611


def claimable(using: str) -> Any:
    """Due pending rows, earliest due first, each with ``behind`` (see :func:`_behind`)."""
    return (
        OutboxMessage.objects.using(using)
        # The database's clock, which writes next_attempt_at too: not this process's.
        .filter(status=OutboxStatus.PENDING, next_attempt_at__lte=Now())
        .annotate(behind=_behind())
        .order_by("next_attempt_at", "id")
    )


def any_id_of(using: str, pks: Iterable[int]) -> Any:
    """``pk__in``'s right-hand side: on PostgreSQL one array parameter, cheap to compile."""
    if connections[using].vendor == "postgresql":
        return RawSQL("SELECT unnest(%s::bigint[])", (list(pks),))
    return list(pks)


def release_next_of_keys(using: str, keys: set[str]) -> int:
    """Make the first unsent row of each key due, if it is parked (the row before it was sent)."""
    if not keys:
        return 0
    connection = connections[using]
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(release_next_sql(OutboxMessage._meta.db_table), [sorted(keys)])
            return int(cursor.rowcount)
    first_unsent = (
        OutboxMessage.objects.using(using)
        .filter(ordering_key__in=keys, status__in=[OutboxStatus.PENDING, OutboxStatus.FAILED])
        .values("ordering_key")
        .annotate(first=Min("id"))
        .values("first")
    )
    return (
        OutboxMessage.objects.using(using)
        .filter(pk__in=first_unsent, status=OutboxStatus.PENDING, next_attempt_at__isnull=True)
        .update(next_attempt_at=Now())
    )


# The most rows one claim parks (park_behind), in one short transaction.
PARK_CHUNK = 10_000


def park_behind(using: str, blockers: set[int]) -> int:
    """Park up to PARK_CHUNK due rows behind their key's row in ``blockers`` (unsent rows this
    transaction locks), skipping rows another holds; returns how many."""
    table = connections[using].ops.quote_name(OutboxMessage._meta.db_table)
    with connections[using].cursor() as cursor:
        # The rows are chosen once (MATERIALIZED), as scheduled.promote_due chooses its own:
        # a subquery may be run again for every row of a nested loop.
        cursor.execute(
            "WITH chosen AS MATERIALIZED ("  # noqa: S608
            f"SELECT o.id FROM {table} b JOIN {table} o ON o.ordering_key = b.ordering_key "
            "AND (o.ordering_key, o.id) > (b.ordering_key, b.id) "
            "WHERE b.id = ANY(%s::bigint[]) AND b.status IN ('pending', 'failed') "
            "AND o.status = 'pending' AND o.next_attempt_at <= now() "
            "LIMIT %s FOR UPDATE OF o SKIP LOCKED) "
            f"UPDATE {table} SET next_attempt_at = NULL "
            "WHERE id IN (SELECT id FROM chosen) AND status = 'pending'",
            [sorted(blockers), PARK_CHUNK],
        )
        return int(cursor.rowcount)


def release_parked(using: str, after: int = 0, limit: int = 2000) -> tuple[int, int | None]:
    """Make due up to ``limit`` parked rows past id ``after`` that nothing holds back; how many,
    and the id to go on after (None at the last parked row). Again when another relay sent one
    of them meanwhile (its update waited for that relay's lock, then found the row moved)."""
    return again_if_moved(lambda: _release_parked(using, after, limit))


def _release_parked(using: str, after: int, limit: int) -> tuple[int, int | None]:
    outbox = OutboxMessage.objects.using(using)
    found = list(
        outbox.filter(status=OutboxStatus.PENDING, next_attempt_at__isnull=True, id__gt=after)
        .annotate(behind=_behind())
        .order_by("next_attempt_at", "id")  # the due index: its NULLs, in id order
        .values_list("id", "behind")[:limit]
    )
    free = [pk for pk, behind in found if behind is None]
    released = (
        outbox.filter(
            pk__in=free, status=OutboxStatus.PENDING, next_attempt_at__isnull=True
        ).update(next_attempt_at=Now())
        if free
        else 0
    )
    return released, (found[-1][0] if len(found) >= limit else None)


def _microseconds(moment: dt.datetime) -> int:
    return (moment - _EPOCH) // dt.timedelta(microseconds=1)


def _headers_of(value: Any) -> dict[str, Any]:
    """A row's headers as Django's cursor returns JSON (its text): most rows have none."""
    if not isinstance(value, str):
        return value  # type: ignore[no-any-return]
    return {} if value == "{}" else json.loads(value)  # type: ignore[no-any-return]


@dataclass(slots=True)
class ClaimedRow:
    """The columns of a claimed outbox row the relay needs (cheaper than a model instance)."""

    pk: int
    message_id: str
    exchange: str
    routing_key: str
    body: str
    headers: dict[str, Any]
    # A retry copy's exact bytes and encoded AMQP properties; None for what publish() wrote.
    raw_body: bytes | None
    raw_properties: bytes | None
    ordering_key: str | None
    attempts: int
    published_us: int  # of its publish() or later due time (see _PUBLISHED_US)

    @property
    def wire_body(self) -> bytes:
        """The body as it goes out."""
        return self.body.encode("utf-8") if self.raw_body is None else bytes(self.raw_body)

    @property
    def stored_properties(self) -> bytes | None:
        return None if self.raw_properties is None else bytes(self.raw_properties)

    @property
    def published_at(self) -> dt.datetime:
        """``published_us`` as a time."""
        return _EPOCH + dt.timedelta(microseconds=self.published_us)


CLAIMED_FIELDS = tuple(column.name for column in fields(ClaimedRow))
_BEHIND = len(CLAIMED_FIELDS)  # the position of ``behind`` in a claimed tuple
_HEADERS = CLAIMED_FIELDS.index("headers")
_PUBLISHED = CLAIMED_FIELDS.index("published_us")  # the last column of a ClaimedRow
_BODY, _RAW_BODY = CLAIMED_FIELDS.index("body"), CLAIMED_FIELDS.index("raw_body")


class ClaimTransaction:
    """A claim's ``atomic``, exited later (record, lease, rollback) on the same worker thread."""

    def __init__(self, using: str) -> None:
        self._atomic = transaction.atomic(using=using)
        self._atomic.__enter__()

    def commit(self) -> None:
        self._atomic.__exit__(None, None, None)

    def rollback(self, error: BaseException | None = None) -> None:
        error = error if error is not None else RuntimeError("rolled back")
        self._atomic.__exit__(type(error), error, error.__traceback__)

    def run(self, work: Callable[[], T]) -> T:
        """Do ``work`` in this transaction and commit; roll back and raise if it fails."""
        try:
            result = work()
        except BaseException as exc:
            self.rollback(exc)
            raise
        self.commit()
        return result


@dataclass
class Claim:
    """What a claim found: rows under their transaction, rows parked, the wait, or an error."""

    rows: list[ClaimedRow]
    transaction: ClaimTransaction | None = None
    parked: int = 0
    wait: float = 0.0
    error: DatabaseError | None = None


@dataclass(eq=False)
class OutboxClaims:
    """The queries of one relay lane, on the database alias ``using``."""

    using: str
    settings: MessagingSettings
    batch_size: int
    lease_for: dt.timedelta  # how long claimed rows stay leased past a claim's transaction
    # Rows the next claim locks: one past what a CLAIM_BYTES cut returned, doubling back.
    lock_limit: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.lock_limit = self.batch_size

    def claim(self) -> Claim:
        """Lock a batch of due rows in a transaction left open for it (again if a row moved)."""
        return again_if_moved(
            self._claim,
            lambda: logger.debug(
                "relay: a row was sent by another relay meanwhile; claiming again"
            ),
        )

    def _select(self) -> list[tuple[Any, ...]]:
        """Up to ``lock_limit`` due rows, locked, in claim order, cut after ``CLAIM_BYTES``."""
        limit = self.lock_limit
        query = claimable(self.using).select_for_update(skip_locked=True)
        connection = connections[self.using]
        if connection.vendor != "postgresql":
            found: list[tuple[Any, ...]] = []
            taken, locked = 0, 0
            for row in query.values_list(
                *CLAIMED_FIELDS[:_PUBLISHED], "created_at", "deliver_at", "behind"
            )[:limit]:
                locked += 1
                if found and taken >= CLAIM_BYTES:
                    break
                raw_body, body = row[_RAW_BODY], row[_BODY]
                taken += len(raw_body) if raw_body is not None else len(body.encode())
                found.append(
                    (*row[:_PUBLISHED], _microseconds(max(row[-3], row[-2] or row[-3])), row[-1])
                )
            self._next_limit(limit, locked, len(found))
            return found
        # Times as integers and no ORM converters: they cost more CPU than the rest of the claim
        # (docs/benchmarks.md). Rows locked past CLAIM_BYTES stay locked until the batch ends.
        published = RawSQL(_PUBLISHED_US, (), output_field=BigIntegerField())  # noqa: S611
        columns = [*CLAIMED_FIELDS, "behind"]
        inner, params = (
            query.annotate(published_us=published)
            .values_list(*columns, "next_attempt_at")[:limit]
            .query.get_compiler(using=self.using)
            .as_sql()
        )
        sql = (
            f"SELECT {', '.join(columns)}, w.locked FROM (SELECT c.*, "  # noqa: S608
            f"count(*) OVER () AS locked, sum({_ROW_BYTES.format(t='c')}) OVER (ORDER BY "
            "c.next_attempt_at, c.pk ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) "
            f"AS bytes_before FROM ({inner}) c) w "
            "WHERE coalesce(w.bytes_before, 0) < %s ORDER BY w.next_attempt_at, w.pk"
        )
        with connection.cursor() as cursor:
            cursor.execute(sql, [*params, CLAIM_BYTES])
            rows = cursor.fetchall()
        self._next_limit(limit, rows[0][-1] if rows else 0, len(rows))
        return [
            (*row[:_HEADERS], _headers_of(row[_HEADERS]), *row[_HEADERS + 1 : -1]) for row in rows
        ]

    def _next_limit(self, limit: int, locked: int, returned: int) -> None:
        if returned < locked:
            self.lock_limit = returned + 1
        elif returned == limit:
            self.lock_limit = min(self.batch_size, limit * 2)

    def _claim(self) -> Claim:
        """Park the rows behind an earlier unsent row of their key first, then claim."""
        outbox = OutboxMessage.objects.using(self.using)
        held = ClaimTransaction(self.using)
        parked_count = 0
        try:
            found = self._select()
            behind = {values[0]: values[_BEHIND] for values in found if values[_BEHIND] is not None}
            if behind:
                # Parked only while the row holding it back is locked here, so that row's
                # release cannot run before this park commits; others are skipped for now.
                locked = {values[0] for values in found}
                locked |= set(
                    outbox.filter(
                        # Still unsent in this statement's (newer) snapshot.
                        pk__in=set(behind.values()) - locked,
                        status__in=[OutboxStatus.PENDING, OutboxStatus.FAILED],
                    )
                    .select_for_update(skip_locked=True)
                    .values_list("pk", flat=True)
                )
                parked = [pk for pk, blocker in behind.items() if blocker in locked]
                if parked and connections[self.using].vendor == "postgresql":
                    # Every due row behind those blockers, not only this batch's.
                    parked_count = park_behind(self.using, {behind[pk] for pk in parked})
                elif parked:
                    parked_count = outbox.filter(pk__in=parked, status=OutboxStatus.PENDING).update(
                        next_attempt_at=None
                    )
                held.commit()
                held = ClaimTransaction(self.using)
                found = self._select()
            rows = [ClaimedRow(*values[:_BEHIND]) for values in found if values[_BEHIND] is None]
        except BaseException as exc:
            held.rollback(exc)
            raise
        if not rows:
            held.commit()
            return Claim(rows=[], parked=parked_count)
        return Claim(rows=rows, transaction=held, parked=parked_count)

    def next_due_in(self) -> float | None:
        """Seconds until the next row backing off or leased is due; None when none waits."""
        outbox = OutboxMessage.objects.using(self.using)
        return scheduled.first_due_in(
            outbox.filter(status=OutboxStatus.PENDING, next_attempt_at__gt=Now())
        )

    def forget_connection(self) -> None:
        """After a database error: the next query opens a fresh connection."""
        connections[self.using].close()

    def lease(self, rows: list[ClaimedRow], held: ClaimTransaction | None) -> None:
        """Lease ``rows`` ``lease_for`` ahead and commit ``held`` (or a new transaction)."""
        leased = OutboxMessage.objects.using(self.using).filter(
            pk__in=any_id_of(self.using, (row.pk for row in rows)), status=OutboxStatus.PENDING
        )
        until = Now() + Value(self.lease_for, output_field=DurationField())
        try:
            (held or ClaimTransaction(self.using)).run(lambda: leased.update(next_attempt_at=until))
        except DatabaseError as exc:
            self.forget_connection()
            logger.warning(
                "relay: cannot lease the rows of a batch in flight (%s); another relay may send "
                "them again, which consumers absorb",
                exc,
            )
