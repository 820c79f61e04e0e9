"""The inbox on PostgreSQL: one partition per UTC day, dropped whole once it has expired.

An inbox that remembers every message for ``DEDUP_RETENTION`` at a thousand messages a second
holds over a billion rows, and deleting a day of them row by row costs as much as inserting
them did (WAL, index upkeep, vacuum). So on PostgreSQL the inbox table is partitioned by
``processed_at``, one partition per UTC day, and the retention purge drops the partitions
whose every row has expired: a catalog change, whatever the rows.

- ``<table>_pYYYYMMDD``: the partition of one UTC day, created ahead of time (the consumer at
  start and every hour, the purge), each with the inbox's indexes.
- ``<table>_legacy``: on a system that had inbox rows before the table was partitioned, the old
  table itself, attached as the partition of everything before the cut-over day (migration
  0009). Its expired rows are deleted in batches, as before, until it is dropped whole.
- ``<table>_default``: a safety net. A row for which no day's partition exists (a consumer
  that ran for days while no process could create one, a clock far ahead) is kept there,
  never refused. When its day's partition is created after all, the rows of that day move in;
  the rest are deleted in batches once expired, like the legacy table's.

Duplicates are detected across every partition, not only the current day's: a unique index
only spans one partition, so the inbox claim takes an advisory lock per (consumer, message_id)
and then looks for the key in the whole table before inserting (see ``inbox.py``). A row is
kept between ``DEDUP_RETENTION`` and ``DEDUP_RETENTION`` plus a day.

Elsewhere (SQLite) the table stays one table and the purge deletes rows in batches.
"""

from __future__ import annotations

import datetime as dt
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.db import DatabaseError, OperationalError, connections, transaction

logger = logging.getLogger("reliable_messaging.partitions")

# The inbox table (ProcessedMessage's db_table; fixed, so migrations can use it too).
INBOX_TABLE = "reliable_messaging_processedmessage"
LEGACY = f"{INBOX_TABLE}_legacy"
DEFAULT = f"{INBOX_TABLE}_default"
# Days created ahead of the current one, so a consumer never needs a partition nobody made.
AHEAD_DAYS = 3
# How long partition upkeep waits for a table lock, and how often it tries, before it gives
# up until next time: a waiting DDL statement queues every insert behind it.
DDL_LOCK_TIMEOUT = "500ms"
DDL_ATTEMPTS = 3
DDL_RETRY_AFTER = 1.0
# PostgreSQL's SQLSTATE for a lock wait cut short by lock_timeout.
LOCK_NOT_AVAILABLE = "55P03"
# The advisory lock (two-int form: this class, then the purpose) that serializes upkeep.
ADVISORY_CLASS = 0x726D  # "rm"
UPKEEP_LOCK = 1
# The class of the inbox claim's per-key advisory locks (the key is a hash of the pair).
CLAIM_LOCK_CLASS = 0x726D0001


@dataclass(frozen=True)
class Partition:
    name: str
    # Its range of processed_at, [start, end); None for an open end (MINVALUE, the default).
    start: dt.datetime | None
    end: dt.datetime | None
    default: bool = False

    def overlaps(self, start: dt.datetime, end: dt.datetime) -> bool:
        if self.default:
            return False
        return (self.start is None or self.start < end) and (self.end is None or start < self.end)


def day_name(day: dt.date) -> str:
    return f"{INBOX_TABLE}_p{day:%Y%m%d}"


def day_start(day: dt.date) -> dt.datetime:
    return dt.datetime(day.year, day.month, day.day, tzinfo=dt.UTC)


def is_partitioned(using: str) -> bool:
    connection = connections[using]
    if connection.vendor != "postgresql":
        return False
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT EXISTS (SELECT 1 FROM pg_partitioned_table WHERE partrelid = to_regclass(%s))",
            [INBOX_TABLE],
        )
        row = cursor.fetchone()
    return bool(row and row[0])


_BOUND = re.compile(r"FROM \((?P<start>[^)]*)\) TO \((?P<end>[^)]*)\)")


def _bound_value(text: str) -> dt.datetime | None:
    text = text.strip()
    if text.upper() in ("MINVALUE", "MAXVALUE"):
        return None
    return dt.datetime.fromisoformat(text.strip("'"))


def partitions(using: str) -> list[Partition]:
    """The inbox's partitions, oldest first (the default last)."""
    with connections[using].cursor() as cursor:
        # The bounds are printed in the session's time zone, with its offset: read as such.
        cursor.execute(
            "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid) FROM pg_inherits i "
            "JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = to_regclass(%s)",
            [INBOX_TABLE],
        )
        rows = cursor.fetchall()
    found: list[Partition] = []
    for name, bound in rows:
        if bound.strip().upper() == "DEFAULT":
            found.append(Partition(name, None, None, default=True))
            continue
        match = _BOUND.search(bound)
        if match is None:  # pragma: no cover - every partition of ours is a range
            logger.warning(
                "inbox partition %s has a bound this code does not read: %s", name, bound
            )
            continue
        found.append(Partition(name, _bound_value(match["start"]), _bound_value(match["end"])))
    oldest = dt.datetime.min.replace(tzinfo=dt.UTC)
    newest = dt.datetime.max.replace(tzinfo=dt.UTC)
    return sorted(found, key=lambda p: (p.default, p.start or oldest, p.end or newest))


def create_partition_sql(
    name: str, start: dt.datetime | None, end: dt.datetime | None
) -> list[str]:
    """The statements that make ``name`` a standalone table shaped like the inbox, with its
    indexes and, for a range, a CHECK matching it (so attaching it needs no scan)."""
    statements = [
        f'CREATE TABLE "{name}" (LIKE "{INBOX_TABLE}" INCLUDING DEFAULTS)',
        f'ALTER TABLE "{name}" ADD CONSTRAINT "{name}_pkey" PRIMARY KEY (id)',
        f'ALTER TABLE "{name}" ADD CONSTRAINT "{name}_uniq" UNIQUE (message_id, consumer)',
        f'CREATE INDEX "{name}_consumer" ON "{name}" (consumer)',
        f'CREATE INDEX "{name}_processed_at" ON "{name}" (processed_at)',
    ]
    if end is not None:
        lower = "" if start is None else f"processed_at >= '{start.isoformat()}' AND "
        statements.append(
            f'ALTER TABLE "{name}" ADD CONSTRAINT "{name}_range" '
            f"CHECK ({lower}processed_at < '{end.isoformat()}')"
        )
    return statements


def _attach(cursor: Any, name: str, start: dt.datetime | None, end: dt.datetime) -> None:
    lower = "MINVALUE" if start is None else f"'{start.isoformat()}'"
    cursor.execute(
        f'ALTER TABLE "{INBOX_TABLE}" ATTACH PARTITION "{name}" '
        f"FOR VALUES FROM ({lower}) TO ('{end.isoformat()}')"
    )
    # Once attached, the partition bound does what the CHECK did.
    cursor.execute(f'ALTER TABLE "{name}" DROP CONSTRAINT "{name}_range"')


def _ddl(using: str, what: str, work: Callable[[Any], bool]) -> bool | None:
    """Run ``work(cursor)`` in a transaction whose lock waits last ``DDL_LOCK_TIMEOUT``, up to
    ``DDL_ATTEMPTS`` times while a lock is what stops it; returns what ``work`` returned, or
    None when it did not go through (logged: the next upkeep or purge tries again). Serialized
    with every other upkeep by an advisory lock."""
    for attempt in range(1, DDL_ATTEMPTS + 1):
        try:
            with transaction.atomic(using=using), connections[using].cursor() as cursor:
                cursor.execute(
                    "SELECT pg_advisory_xact_lock(%s, %s)", [ADVISORY_CLASS, UPKEEP_LOCK]
                )
                cursor.execute(f"SET LOCAL lock_timeout = '{DDL_LOCK_TIMEOUT}'")
                return work(cursor)
        except OperationalError as exc:
            busy = getattr(exc.__cause__, "sqlstate", None) == LOCK_NOT_AVAILABLE
            if busy and attempt < DDL_ATTEMPTS:
                time.sleep(DDL_RETRY_AFTER)
                continue
            logger.warning("could not %s (will try again later): %s", what, exc)
        except DatabaseError as exc:
            logger.warning("could not %s (will try again later): %s", what, exc)
        return None
    return None  # pragma: no cover - the loop always returns


def ensure_partitions(
    using: str, *, now: dt.datetime | None = None, ahead: int = AHEAD_DAYS
) -> list[str]:
    """Create the day partitions from yesterday to ``ahead`` days from now that no partition
    covers yet, moving into each the rows the default partition holds for its day; returns the
    names created. Does nothing where the inbox is not partitioned. Stops at the first day it
    cannot create (see :func:`_ddl`)."""
    if not is_partitioned(using):
        return []
    today = (now or dt.datetime.now(dt.UTC)).astimezone(dt.UTC).date()
    known = partitions(using)
    created: list[str] = []
    for offset in range(-1, ahead + 1):
        day = today + dt.timedelta(days=offset)
        start, end = day_start(day), day_start(day + dt.timedelta(days=1))
        name = day_name(day)
        if any(p.overlaps(start, end) for p in known):
            continue  # the usual case: no transaction, no lock

        def create(
            cursor: Any,
            day: dt.date = day,
            start: dt.datetime = start,
            end: dt.datetime = end,
            name: str = name,
        ) -> bool:
            existing = partitions(using)  # again, under the lock: another process may have
            if any(p.overlaps(start, end) for p in existing):
                return False
            for statement in create_partition_sql(name, start, end):
                cursor.execute(statement)
            default = next((p for p in existing if p.default), None)
            if default is not None:
                # Attaching scans the default for rows of this day (none, normally); take
                # them over first, with the default locked so that none arrive meanwhile.
                cursor.execute(f'LOCK TABLE "{default.name}" IN ACCESS EXCLUSIVE MODE')
                cursor.execute(
                    f'WITH moved AS (DELETE FROM "{default.name}" '  # noqa: S608
                    "WHERE processed_at >= %s AND processed_at < %s RETURNING *) "
                    f'INSERT INTO "{name}" SELECT * FROM moved',
                    [start, end],
                )
                if cursor.rowcount:
                    logger.warning(
                        "moved %d inbox rows of %s from the default partition into %s",
                        cursor.rowcount,
                        day,
                        name,
                    )
            _attach(cursor, name, start, end)
            return True

        done = _ddl(using, f"create the inbox partition of {day}", create)
        if done is None:
            break
        if done:
            created.append(name)
    if created:
        logger.info("created inbox partitions %s", ", ".join(created))
    return created


@dataclass(frozen=True)
class Dropped:
    name: str
    # PostgreSQL's estimate of its rows (counting them would read the whole partition).
    rows: int


def drop_expired(using: str, before: dt.datetime) -> list[Dropped]:
    """Drop every partition whose whole range lies before ``before``, oldest first; returns
    what was dropped. Dropping a partition locks the whole inbox for a moment (inserts wait for
    it), so the lock is awaited briefly: when it cannot be had (a long transaction holds the
    inbox), the rest waits for the next run."""
    if not is_partitioned(using):
        return []
    dropped: list[Dropped] = []
    for partition in partitions(using):
        if partition.default or partition.end is None or partition.end > before:
            continue

        def drop(cursor: Any, name: str = partition.name) -> bool:
            rows = estimated_rows_of(using, [name])
            cursor.execute(f'DROP TABLE "{name}"')
            dropped.append(Dropped(name, rows))
            return True

        if _ddl(using, f"drop the expired inbox partition {partition.name}", drop) is None:
            break
        logger.info("dropped the expired inbox partition %s", partition.name)
    return dropped


def row_partitions(using: str) -> list[str]:
    """The partitions whose expired rows are deleted one by one rather than dropped whole: the
    legacy table and the default partition."""
    return [p.name for p in partitions(using) if p.default or p.start is None]


def estimated_rows_of(using: str, tables: list[str]) -> int:
    """PostgreSQL's estimate of the rows of ``tables`` (partitions), without reading them."""
    if not tables:
        return 0
    with connections[using].cursor() as cursor:
        cursor.execute(
            "SELECT coalesce(sum(greatest(reltuples, 0)), 0)::bigint FROM pg_class "
            "WHERE oid = ANY(%s::regclass[])",
            [tables],
        )
        row = cursor.fetchone()
    return int(row[0]) if row else 0


def estimated_rows(using: str) -> float | None:
    """PostgreSQL's estimate of the inbox's rows (the sum over its partitions; one never
    analyzed yet, such as today's before autovacuum reached it, counts as empty); None while
    no partition was ever analyzed."""
    with connections[using].cursor() as cursor:
        cursor.execute(
            "SELECT max(c.reltuples), sum(greatest(c.reltuples, 0)) FROM pg_inherits i "
            "JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = to_regclass(%s)",
            [INBOX_TABLE],
        )
        row = cursor.fetchone()
    if row is None or row[0] is None or row[0] < 0:
        return None
    return float(row[1])


# How often a long-running consumer makes sure the coming days have their partitions.
UPKEEP_INTERVAL = 3600.0
# ... and how soon it tries again after a failure (the database down at start, say).
UPKEEP_RETRY = 60.0


class PartitionUpkeep:
    """A thread that runs :func:`ensure_partitions` at once, then every ``interval`` seconds,
    with a database connection of its own; errors are logged, never raised."""

    def __init__(self, using: str, interval: float = UPKEEP_INTERVAL) -> None:
        self.using = using
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="inbox-partitions", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def _run(self) -> None:
        try:
            while True:
                wait = self.interval
                try:
                    ensure_partitions(self.using)
                except Exception as exc:  # noqa: BLE001 - the database may be down: retried
                    wait = min(wait, UPKEEP_RETRY)
                    logger.warning(
                        "inbox partition upkeep failed, trying again in %.0fs: %s: %s",
                        wait,
                        type(exc).__name__,
                        exc,
                    )
                finally:
                    connections.close_all()
                if self._stop.wait(wait):
                    return
        finally:
            connections.close_all()
