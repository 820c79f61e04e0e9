"""The inbox and the outbox on PostgreSQL: one partition per UTC day, dropped whole once expired.

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

The outbox (see :data:`OUTBOX`) is partitioned the same way for its sent rows, by ``sent_at``;
its unsent rows, the only ones the relay reads, live in a small partition of their own:

- ``<outbox>``: partitioned by ``status``. ``<outbox>_unsent`` holds the pending and failed
  rows; ``<outbox>_sent`` the sent and unrouted ones, partitioned by UTC day of ``sent_at``
  like the inbox (``<outbox>_pYYYYMMDD``, a default partition ``<outbox>_default``). Marking a
  row sent moves it from one to the other (PostgreSQL does that as a delete and an insert,
  which costs what the update of an indexed column did before).
- On a system that had outbox rows before (migration 0010), ``<outbox>`` is partitioned by
  ``id`` first: the old table, rows of every status, is ``<outbox>_legacy`` (the ids up to the
  cut-over) and the layout above is ``<outbox>_current`` (the ids after). The relay sends the
  legacy table's pending rows where they are; its sent rows expire in batches, as before.
- ``publish(idempotency_key=...)`` finds an earlier message of its key in any partition, under
  an advisory lock on the key (``publishing/publish.py``): unique indexes span one partition
  only. Each partition's unique index of keys (``<leaf>_idem``) is partial, keys that are not
  NULL only (migration 0014; day partitions made before it keep a full unique constraint until
  they expire).
- Indexes: the outbox's partitioned indexes (the relay's due index, the index of unsent rows by
  ordering key) have a copy on every partition. The (status, sent_at) and message_id indexes
  (``rm_outbox_status_sent_idx``, ``rm_outbox_message_id_idx``) are partitioned indexes of
  ``<outbox>_sent`` only, since migration 0015: every publish inserts into the unsent
  partition, and what they serve reads the sent side (the purge's expired rows, the unrouted
  count, a sent row found by its message_id). A day partition gets them as it is attached; the
  legacy table keeps copies of its own. The unsent partition has instead a partial index of
  its failed rows, ``<outbox>_unsent_failed``, which a publish (a pending row) writes nothing
  into: a publish without keys writes into its primary key and its due index only.

Elsewhere (SQLite) the tables stay plain tables and the purge deletes rows in batches.
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

from django.db import (
    DatabaseError,
    NotSupportedError,
    OperationalError,
    connections,
    migrations,
    transaction,
)

logger = logging.getLogger("reliable_messaging.partitions")

# The inbox table (ProcessedMessage's db_table; fixed, so migrations can use it too).
INBOX_TABLE = "reliable_messaging_processedmessage"
LEGACY = f"{INBOX_TABLE}_legacy"
DEFAULT = f"{INBOX_TABLE}_default"
# The outbox (OutboxMessage's db_table) and its partitions (see the module's docstring).
OUTBOX_TABLE = "reliable_messaging_outboxmessage"
OUTBOX_LEGACY = f"{OUTBOX_TABLE}_legacy"
OUTBOX_CURRENT = f"{OUTBOX_TABLE}_current"
OUTBOX_UNSENT = f"{OUTBOX_TABLE}_unsent"
OUTBOX_SENT = f"{OUTBOX_TABLE}_sent"
OUTBOX_DEFAULT = f"{OUTBOX_TABLE}_default"
# The statuses of each side of the outbox (the values of its list partitions); every relay
# query names the unsent ones, so that PostgreSQL reads only that partition.
UNSENT_STATUSES = ("pending", "failed")
SENT_STATUSES = ("sent", "unrouted")
UNSENT_SQL = ", ".join(f"'{status}'" for status in UNSENT_STATUSES)
SENT_SQL = ", ".join(f"'{status}'" for status in SENT_STATUSES)
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
# ... and the one that lets one fold of the failure groups' deltas run at a time (managers.py).
GROUP_FOLD_LOCK = 2
# The class of the inbox claim's per-key advisory locks (the key is a hash of the pair).
CLAIM_LOCK_CLASS = 0x726D0001
# The class of publish()'s advisory lock per idempotency key (a hash of the key).
IDEMPOTENCY_LOCK_CLASS = 0x726D0002
# PostgreSQL's SQLSTATE for a serialization failure; in READ COMMITTED it is raised when a row
# to be locked or updated was moved to another partition (sent) by a transaction that
# committed meanwhile: the statement is simply run again.
SERIALIZATION_FAILURE = "40001"


def row_moved(exc: BaseException) -> bool:
    """Whether ``exc`` is PostgreSQL's serialization failure, which in READ COMMITTED means that
    a row to be locked or updated was moved to another partition (an outbox row marked sent)
    by a transaction that committed meanwhile: the statement is to be run again, and will then
    not find that row among the unsent ones."""
    return isinstance(exc, OperationalError) and (
        getattr(exc.__cause__, "sqlstate", None) == SERIALIZATION_FAILURE
    )


def _inbox_leaf_sql(name: str) -> list[str]:
    return [
        f'CREATE TABLE "{name}" (LIKE "{INBOX_TABLE}" INCLUDING DEFAULTS)',
        f'ALTER TABLE "{name}" ADD CONSTRAINT "{name}_pkey" PRIMARY KEY (id)',
        f'ALTER TABLE "{name}" ADD CONSTRAINT "{name}_uniq" UNIQUE (message_id, consumer)',
        f'CREATE INDEX "{name}_consumer" ON "{name}" (consumer)',
        f'CREATE INDEX "{name}_processed_at" ON "{name}" (processed_at)',
    ]


def outbox_leaf_sql(name: str) -> list[str]:
    """A standalone table shaped like the outbox with what each of its partitions has of its
    own: the primary key and the unique index of idempotency keys (a partitioned table can hold
    neither across partitions). Its other indexes are the partitioned indexes of the tables it
    is attached under (the outbox's and, for a day, the sent side's), which PostgreSQL creates
    on a table as it is attached.

    The idempotency index is partial: almost every row has no key, and a B-tree stores an
    entry for each NULL, which every publish and every row marked sent would pay for. It still
    answers ``idempotency_key = %s`` (the planner proves the key is not NULL from the
    equality); ``publish()``'s advisory lock and lookup are what keep a key unique across
    partitions, this index a second line of defence within one."""
    return [
        f'CREATE TABLE "{name}" (LIKE "{OUTBOX_TABLE}" INCLUDING DEFAULTS INCLUDING CONSTRAINTS)',
        f'ALTER TABLE "{name}" ADD CONSTRAINT "{name}_pkey" PRIMARY KEY (id)',
        f'CREATE UNIQUE INDEX "{name}_idem" ON "{name}" (idempotency_key) '
        "WHERE idempotency_key IS NOT NULL",
    ]


@dataclass(frozen=True)
class DayPartitioned:
    """A table partitioned by UTC day of a timestamp column."""

    label: str
    # The table partitioned by range of ``column`` (for the outbox, its sent side).
    table: str
    column: str
    default: str
    # The name of a day's partition is this and the day, YYYYMMDD.
    prefix: str
    # Creates a standalone table shaped like a partition (its range CHECK added apart).
    leaf_sql: Callable[[str], list[str]]
    # What a partition's rows satisfy beyond the range (the bound of ``table`` itself, when it
    # is a partition): stated in the CHECK too, so that attaching needs no scan.
    also: str = ""
    # What a row of a legacy table must also satisfy to be purged once expired (the legacy
    # outbox holds rows of every status, and only sent ones expire).
    finished: str = ""
    # Tables outside ``table`` whose expired rows are deleted in batches, when they exist.
    legacy: tuple[str, ...] = ()

    def day_name(self, day: dt.date) -> str:
        return f"{self.prefix}{day:%Y%m%d}"


INBOX = DayPartitioned(
    "inbox", INBOX_TABLE, "processed_at", DEFAULT, f"{INBOX_TABLE}_p", _inbox_leaf_sql
)
OUTBOX = DayPartitioned(
    "outbox",
    OUTBOX_SENT,
    "sent_at",
    OUTBOX_DEFAULT,
    f"{OUTBOX_TABLE}_p",
    outbox_leaf_sql,
    also=f"status IN ({SENT_SQL}) AND sent_at IS NOT NULL",
    finished=f"status IN ({SENT_SQL})",
    legacy=(OUTBOX_LEGACY,),
)


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


def day_name(day: dt.date, spec: DayPartitioned = INBOX) -> str:
    return spec.day_name(day)


def day_start(day: dt.date) -> dt.datetime:
    return dt.datetime(day.year, day.month, day.day, tzinfo=dt.UTC)


def is_partitioned(using: str, spec: DayPartitioned = INBOX) -> bool:
    connection = connections[using]
    if connection.vendor != "postgresql":
        return False
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT EXISTS (SELECT 1 FROM pg_partitioned_table WHERE partrelid = to_regclass(%s))",
            [spec.table],
        )
        row = cursor.fetchone()
    return bool(row and row[0])


_BOUND = re.compile(r"FROM \((?P<start>[^)]*)\) TO \((?P<end>[^)]*)\)")


def _bound_value(text: str) -> dt.datetime | None:
    text = text.strip()
    if text.upper() in ("MINVALUE", "MAXVALUE"):
        return None
    return dt.datetime.fromisoformat(text.strip("'"))


def partitions(using: str, spec: DayPartitioned = INBOX) -> list[Partition]:
    """The day partitions of ``spec`` (the inbox's, by default), oldest first (the default
    last)."""
    with connections[using].cursor() as cursor:
        # The bounds are printed in the session's time zone, with its offset: read as such.
        cursor.execute(
            "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid) FROM pg_inherits i "
            "JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = to_regclass(%s)",
            [spec.table],
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
                "%s partition %s has a bound this code does not read: %s", spec.label, name, bound
            )
            continue
        found.append(Partition(name, _bound_value(match["start"]), _bound_value(match["end"])))
    oldest = dt.datetime.min.replace(tzinfo=dt.UTC)
    newest = dt.datetime.max.replace(tzinfo=dt.UTC)
    return sorted(found, key=lambda p: (p.default, p.start or oldest, p.end or newest))


def create_partition_sql(
    name: str,
    start: dt.datetime | None,
    end: dt.datetime | None,
    spec: DayPartitioned = INBOX,
) -> list[str]:
    """The statements that make ``name`` a standalone table shaped like a partition of
    ``spec``, with its indexes and, for a range, a CHECK matching it (so attaching it needs no
    scan)."""
    statements = spec.leaf_sql(name)
    if end is not None:
        column = spec.column
        lower = "" if start is None else f"{column} >= '{start.isoformat()}' AND "
        also = f" AND {spec.also}" if spec.also else ""
        statements.append(
            f'ALTER TABLE "{name}" ADD CONSTRAINT "{name}_range" '
            f"CHECK ({lower}{column} < '{end.isoformat()}'{also})"
        )
    return statements


def _attach(
    cursor: Any,
    name: str,
    start: dt.datetime | None,
    end: dt.datetime,
    spec: DayPartitioned = INBOX,
) -> None:
    lower = "MINVALUE" if start is None else f"'{start.isoformat()}'"
    cursor.execute(
        f'ALTER TABLE "{spec.table}" ATTACH PARTITION "{name}" '
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
    using: str,
    *,
    now: dt.datetime | None = None,
    ahead: int = AHEAD_DAYS,
    spec: DayPartitioned = INBOX,
) -> list[str]:
    """Create the day partitions of ``spec`` (the inbox, by default) from yesterday to
    ``ahead`` days from now that no partition covers yet, moving into each the rows the default
    partition holds for its day; returns the names created. Does nothing where the table is
    not partitioned. Stops at the first day it cannot create (see :func:`_ddl`)."""
    if not is_partitioned(using, spec):
        return []
    today = (now or dt.datetime.now(dt.UTC)).astimezone(dt.UTC).date()
    known = partitions(using, spec)
    created: list[str] = []
    for offset in range(-1, ahead + 1):
        day = today + dt.timedelta(days=offset)
        start, end = day_start(day), day_start(day + dt.timedelta(days=1))
        name = spec.day_name(day)
        if any(p.overlaps(start, end) for p in known):
            continue  # the usual case: no transaction, no lock

        def create(
            cursor: Any,
            day: dt.date = day,
            start: dt.datetime = start,
            end: dt.datetime = end,
            name: str = name,
        ) -> bool:
            existing = partitions(using, spec)  # again, under the lock: another process may
            if any(p.overlaps(start, end) for p in existing):  # have made it
                return False
            for statement in create_partition_sql(name, start, end, spec):
                cursor.execute(statement)
            default = next((p for p in existing if p.default), None)
            if default is not None:
                # Attaching scans the default for rows of this day (none, normally); take
                # them over first, with the default locked so that none arrive meanwhile.
                cursor.execute(f'LOCK TABLE "{default.name}" IN ACCESS EXCLUSIVE MODE')
                cursor.execute(
                    f'WITH moved AS (DELETE FROM "{default.name}" '  # noqa: S608
                    f"WHERE {spec.column} >= %s AND {spec.column} < %s RETURNING *) "
                    f'INSERT INTO "{name}" SELECT * FROM moved',
                    [start, end],
                )
                if cursor.rowcount:
                    logger.warning(
                        "moved %d %s rows of %s from the default partition into %s",
                        cursor.rowcount,
                        spec.label,
                        day,
                        name,
                    )
            _attach(cursor, name, start, end, spec)
            return True

        done = _ddl(using, f"create the {spec.label} partition of {day}", create)
        if done is None:
            break
        if done:
            created.append(name)
    if created:
        logger.info("created %s partitions %s", spec.label, ", ".join(created))
    return created


@dataclass(frozen=True)
class Dropped:
    name: str
    # PostgreSQL's estimate of its rows (counting them would read the whole partition).
    rows: int


def drop_expired(using: str, before: dt.datetime, spec: DayPartitioned = INBOX) -> list[Dropped]:
    """Drop every partition of ``spec`` whose whole range lies before ``before``, oldest
    first; returns what was dropped. Dropping a partition locks the whole table for a moment
    (inserts wait for it), so the lock is awaited briefly: when it cannot be had (a long
    transaction holds the table), the rest waits for the next run."""
    if not is_partitioned(using, spec):
        return []
    dropped: list[Dropped] = []
    for partition in partitions(using, spec):
        if partition.default or partition.end is None or partition.end > before:
            continue

        def drop(cursor: Any, name: str = partition.name) -> bool:
            rows = estimated_rows_of(using, [name])
            cursor.execute(f'DROP TABLE "{name}"')
            dropped.append(Dropped(name, rows))
            return True

        what = f"drop the expired {spec.label} partition {partition.name}"
        if _ddl(using, what, drop) is None:
            break
        logger.info("dropped the expired %s partition %s", spec.label, partition.name)
    return dropped


def drop_if_empty(using: str, name: str) -> bool:
    """Drop the partition ``name`` if it holds no row (a legacy table whose last rows were
    sent and expired); True if it did."""

    def drop(cursor: Any) -> bool:
        cursor.execute(f'SELECT NOT EXISTS (SELECT 1 FROM "{name}")')  # noqa: S608
        if not cursor.fetchone()[0]:
            return False
        cursor.execute(f'DROP TABLE "{name}"')
        return True

    done = bool(_ddl(using, f"drop the empty partition {name}", drop))
    if done:
        logger.info("dropped the empty partition %s", name)
    return done


def row_partitions(using: str, spec: DayPartitioned = INBOX) -> list[str]:
    """The partitions whose expired rows are deleted one by one rather than dropped whole: the
    legacy table and the default partition."""
    found = [p.name for p in partitions(using, spec) if p.default or p.start is None]
    if spec.legacy:
        with connections[using].cursor() as cursor:
            cursor.execute(
                "SELECT t FROM unnest(%s::text[]) AS t WHERE to_regclass(t) IS NOT NULL",
                [list(spec.legacy)],
            )
            found += [row[0] for row in cursor.fetchall()]
    return found


def estimated_rows_of(using: str, tables: list[str]) -> int:
    """PostgreSQL's estimate of the rows of ``tables`` (partitions), without reading them; a
    partition never analyzed yet (autovacuum analyzes one as it fills) has no estimate and is
    counted."""
    if not tables:
        return 0
    with connections[using].cursor() as cursor:
        cursor.execute(
            "SELECT relname, reltuples FROM pg_class WHERE oid = ANY(%s::regclass[])", [tables]
        )
        found = cursor.fetchall()
        total = 0
        for name, reltuples in found:
            if reltuples >= 0:
                total += int(reltuples)
                continue
            cursor.execute(f'SELECT count(*) FROM "{name}"')  # noqa: S608
            total += int(cursor.fetchone()[0])
    return total


def estimated_rows(using: str, table: str = INBOX_TABLE) -> float | None:
    """PostgreSQL's estimate of the rows of a table (of a partitioned one, the sum over its
    partitions, however deep; one never analyzed yet, such as today's before autovacuum reached
    it, counts as empty); None while none was ever analyzed."""
    with connections[using].cursor() as cursor:
        # A plain table is its own leaf (pg_partition_tree lists nothing for it).
        cursor.execute(
            "SELECT max(c.reltuples), sum(greatest(c.reltuples, 0)) FROM pg_class c "
            "WHERE c.relkind = 'r' AND (c.oid = to_regclass(%s) OR c.oid IN ("
            "SELECT relid FROM pg_partition_tree(to_regclass(%s)) WHERE isleaf))",
            [table, table],
        )
        row = cursor.fetchone()
    if row is None or row[0] is None or row[0] < 0:
        return None
    return float(row[1])


# How often a long-running consumer or relay makes sure the coming days have their partitions.
UPKEEP_INTERVAL = 3600.0
# ... and how soon it tries again after a failure (the database down at start, say).
UPKEEP_RETRY = 60.0


class PartitionUpkeep:
    """A thread that runs :func:`ensure_partitions` for ``spec`` (the inbox, by default) at
    once, then every ``interval`` seconds, with a database connection of its own; errors are
    logged, never raised."""

    def __init__(
        self, using: str, interval: float = UPKEEP_INTERVAL, spec: DayPartitioned = INBOX
    ) -> None:
        self.using = using
        self.interval = interval
        self.spec = spec
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"{spec.label}-partitions", daemon=True
        )

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
                    ensure_partitions(self.using, spec=self.spec)
                except Exception as exc:  # noqa: BLE001 - the database may be down: retried
                    wait = min(wait, UPKEEP_RETRY)
                    logger.warning(
                        "%s partition upkeep failed, trying again in %.0fs: %s: %s",
                        self.spec.label,
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


# -- the migrations that partition a table (0009, 0010) ---------------------------------------


def sequence_value(cursor: Any, sequence: str) -> int:
    """The last value ``sequence`` gave out (0 when none)."""
    cursor.execute(f"SELECT last_value, is_called FROM {sequence}")  # noqa: S608
    last_value, is_called = cursor.fetchone()
    return int(last_value) if is_called else int(last_value) - 1


class PartitioningOperation(migrations.operations.base.Operation):
    """A migration operation that turns a model's table into a partitioned one on PostgreSQL
    (and does nothing elsewhere); the model, for the ORM, does not change."""

    model_name = ""
    reversible = True
    atomic = False
    reduces_to_sql = False

    def state_forwards(self, app_label: str, state: Any) -> None:
        """The model does not change: partitioning is invisible to the ORM."""

    def _applies(self, app_label: str, schema_editor: Any, state: Any) -> bool:
        model = state.apps.get_model(app_label, self.model_name)
        if not self.allow_migrate_model(schema_editor.connection.alias, model):
            return False
        if schema_editor.connection.vendor != "postgresql":
            return False
        if schema_editor.connection.in_atomic_block:
            raise NotSupportedError(f"{type(self).__name__} cannot run inside a transaction")
        return True
