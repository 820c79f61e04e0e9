"""The day partitions of the inbox and of the outbox's sent rows on PostgreSQL, made ahead and
dropped concurrently (``docs/operations.md#how-the-tables-are-laid-out``)."""

from __future__ import annotations

import datetime as dt
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from django.db import DatabaseError, OperationalError, connections, transaction

from .. import metrics
from ..core.advisory_locks import ADVISORY_CLASS, UPKEEP_LOCK
from ..core.database_errors import sqlstate
from ..core.liveness import HealthState

logger = logging.getLogger("reliable_messaging.partitions")

# The models' db_tables (fixed, so the migration can use them too) and the outbox's partitions.
INBOX_TABLE = "reliable_messaging_processedmessage"
OUTBOX_TABLE = "reliable_messaging_outboxmessage"
OUTBOX_UNSENT = f"{OUTBOX_TABLE}_unsent"
OUTBOX_SENT = f"{OUTBOX_TABLE}_sent"
OUTBOX_SCHEDULED = f"{OUTBOX_TABLE}_scheduled"
# The function that claims a batch of inbox rows (the migration makes it; storage.inbox calls it).
INBOX_CLAIM_FUNCTION = "rm_inbox_claim"
# The statuses of each side of the outbox (its list partitions): relay queries name the unsent.
UNSENT_STATUSES = ("pending", "failed")
SENT_STATUSES = ("sent", "unrouted")
UNSENT_SQL = ", ".join(f"'{status}'" for status in UNSENT_STATUSES)
SENT_SQL = ", ".join(f"'{status}'" for status in SENT_STATUSES)
# Days made ahead of the current one; fewer than UPKEEP_WARN_DAYS: the upkeep failed a day.
AHEAD_DAYS = 7
UPKEEP_WARN_DAYS = AHEAD_DAYS - 1
# How long partition upkeep waits for a table lock (another process's DDL), and how often.
DDL_LOCK_TIMEOUT = "500ms"
DDL_ATTEMPTS = 3
DDL_RETRY_AFTER = 1.0
# PostgreSQL's SQLSTATEs for a lock wait cut short by lock_timeout, and a serialization failure.
LOCK_NOT_AVAILABLE = "55P03"
SERIALIZATION_FAILURE = "40001"


# Tries of what meets a row another transaction moved to another partition meanwhile.
MOVED_TRIES = 3

T = TypeVar("T")


def row_moved(exc: BaseException) -> bool:
    """Whether ``exc`` says a row moved to another partition meanwhile (run it again)."""
    return isinstance(exc, OperationalError) and sqlstate(exc) == SERIALIZATION_FAILURE


def again_if_moved(run: Callable[[], T], on_moved: Callable[[], object] | None = None) -> T:
    """``run()``, run again (MOVED_TRIES in all) while it meets a row that another transaction
    moved to another partition meanwhile (another relay sent it, or made it pending): the next
    statement's snapshot no longer sees it there. ``run`` is a transaction or a savepoint of
    its own, or one statement in autocommit."""
    for attempt in range(1, MOVED_TRIES + 1):
        try:
            return run()
        except DatabaseError as exc:
            if not row_moved(exc) or attempt == MOVED_TRIES:
                raise
            if on_moved is not None:
                on_moved()
    raise AssertionError("unreachable")  # pragma: no cover


def _inbox_leaf_sql(name: str) -> list[str]:
    return [
        f'CREATE TABLE "{name}" (LIKE "{INBOX_TABLE}" INCLUDING DEFAULTS)',
        f'ALTER TABLE "{name}" ADD CONSTRAINT "{name}_pkey" PRIMARY KEY (id)',
        f'ALTER TABLE "{name}" ADD CONSTRAINT "{name}_uniq" UNIQUE (message_id, consumer)',
        f'CREATE INDEX "{name}_consumer" ON "{name}" (consumer)',
        f'CREATE INDEX "{name}_processed_at" ON "{name}" (processed_at)',
    ]


def outbox_leaf_sql(name: str) -> list[str]:
    """A standalone table shaped like an outbox partition: its primary key and unique index of
    idempotency keys (the other indexes come as it is attached)."""
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
    table: str  # partitioned by range of ``column`` (for the outbox, its sent side)
    column: str
    prefix: str  # a day's partition is this and the day, YYYYMMDD
    leaf_sql: Callable[[str], list[str]]  # a standalone table shaped like a partition
    # What its rows satisfy beyond the range (``table``'s own bound), so attaching needs no scan.
    also: str = ""


INBOX = DayPartitioned("inbox", INBOX_TABLE, "processed_at", f"{INBOX_TABLE}_p", _inbox_leaf_sql)
OUTBOX = DayPartitioned(
    "outbox",
    OUTBOX_SENT,
    "sent_at",
    f"{OUTBOX_TABLE}_p",
    outbox_leaf_sql,
    also=f"status IN ({SENT_SQL}) AND sent_at IS NOT NULL",
)


@dataclass(frozen=True)
class Partition:
    name: str
    start: dt.datetime  # its range, [start, end)
    end: dt.datetime
    detaching: bool = False  # a DETACH ... CONCURRENTLY did not finish

    def overlaps(self, start: dt.datetime, end: dt.datetime) -> bool:
        return self.start < end and start < self.end


def day_name(day: dt.date, spec: DayPartitioned = INBOX) -> str:
    return f"{spec.prefix}{day:%Y%m%d}"


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


def _bound_value(text: str) -> dt.datetime:
    return dt.datetime.fromisoformat(text.strip().strip("'"))


def partitions(using: str, spec: DayPartitioned = INBOX) -> list[Partition]:
    """The partitions of ``spec`` (the inbox's, by default), oldest first."""
    with connections[using].cursor() as cursor:
        # The bounds are printed in the session's time zone, with its offset: read as such.
        cursor.execute(
            "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid), i.inhdetachpending "
            "FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = to_regclass(%s)",
            [spec.table],
        )
        rows = cursor.fetchall()
    found: list[Partition] = []
    for name, bound, detaching in rows:
        match = _BOUND.search(bound)
        if match is None or "MINVALUE" in bound or "MAXVALUE" in bound:
            # Not one of ours: a DEFAULT partition, or a range open at one end.
            logger.warning(
                "%s partition %s has a bound this code does not read: %s", spec.label, name, bound
            )
            continue
        start, end = _bound_value(match["start"]), _bound_value(match["end"])
        found.append(Partition(name, start, end, detaching=detaching))
    return sorted(found, key=lambda p: (p.start, p.end))


def create_partition_sql(
    name: str, start: dt.datetime, end: dt.datetime, spec: DayPartitioned = INBOX
) -> list[str]:
    """Make ``name`` a table with a CHECK of its range (no scan to attach), then attach it."""
    column, start_at, end_at = spec.column, start.isoformat(), end.isoformat()
    also = f" AND {spec.also}" if spec.also else ""
    return [
        *spec.leaf_sql(name),
        f'ALTER TABLE "{name}" ADD CONSTRAINT "{name}_range" '
        f"CHECK ({column} >= '{start_at}' AND {column} < '{end_at}'{also})",
        f'ALTER TABLE "{spec.table}" ATTACH PARTITION "{name}" '
        f"FOR VALUES FROM ('{start_at}') TO ('{end_at}')",
        # Once attached, the partition bound does what the CHECK did.
        f'ALTER TABLE "{name}" DROP CONSTRAINT "{name}_range"',
    ]


def _statements(*statements: str) -> Callable[[Any], bool]:
    """A work for :func:`_ddl` that runs ``statements``."""

    def work(cursor: Any) -> bool:
        for statement in statements:
            cursor.execute(statement)
        return True

    return work


def _ddl(using: str, what: str, work: Callable[[Any], bool]) -> bool | None:
    """``work(cursor)`` under the upkeep's lock, lock waits bounded, up to ``DDL_ATTEMPTS``
    times; its result, or None when it did not go through (logged)."""
    for attempt in range(1, DDL_ATTEMPTS + 1):
        try:
            with transaction.atomic(using=using), connections[using].cursor() as cursor:
                # SET LOCAL: the setting ends with the transaction, also on a pooled session.
                cursor.execute(f"SET LOCAL lock_timeout = '{DDL_LOCK_TIMEOUT}'")
                cursor.execute(
                    "SELECT pg_advisory_xact_lock(%s, %s)", [ADVISORY_CLASS, UPKEEP_LOCK]
                )
                return work(cursor)
        except DatabaseError as exc:
            busy = isinstance(exc, OperationalError) and sqlstate(exc) == LOCK_NOT_AVAILABLE
            if busy and attempt < DDL_ATTEMPTS:
                time.sleep(DDL_RETRY_AFTER)
                continue
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
    """Create the missing day partitions of ``spec``, yesterday to ``ahead`` days on; names."""
    if not is_partitioned(using, spec):
        return []
    today = (now or dt.datetime.now(dt.UTC)).astimezone(dt.UTC).date()
    known = partitions(using, spec)
    created: list[str] = []
    for offset in range(-1, ahead + 1):
        day = today + dt.timedelta(days=offset)
        start, end = day_start(day), day_start(day + dt.timedelta(days=1))
        name = day_name(day, spec)
        if any(p.overlaps(start, end) for p in known):
            continue  # the usual case: no transaction, no lock

        def create(
            cursor: Any, start: dt.datetime = start, end: dt.datetime = end, name: str = name
        ) -> bool:
            # Again, under the lock: another process may have made it.
            if any(p.overlaps(start, end) for p in partitions(using, spec)):
                return False
            return _statements(*create_partition_sql(name, start, end, spec))(cursor)

        done = _ddl(using, f"create the {spec.label} partition of {day}", create)
        if done is None:
            break
        if done:
            created.append(name)
    if created:
        logger.info("created %s partitions %s", spec.label, ", ".join(created))
    return created


def covered_until(using: str, at: dt.datetime, spec: DayPartitioned = INBOX) -> dt.datetime | None:
    """The instant before which rows from ``at`` on have a partition; None if not partitioned."""
    if not is_partitioned(using, spec):
        return None
    until = at
    for partition in partitions(using, spec):
        if not partition.detaching and partition.start <= until < partition.end:
            until = partition.end
    return until


def days_ahead(using: str, at: dt.datetime, spec: DayPartitioned = INBOX) -> float | None:
    """Days from ``at`` that have their partitions; None where not partitioned."""
    until = covered_until(using, at, spec)
    return None if until is None else max(0.0, (until - at).total_seconds() / 86400)


def expired(using: str, before: dt.datetime, spec: DayPartitioned = INBOX) -> list[str]:
    """The partitions of ``spec`` whose whole range lies before ``before``, oldest first."""
    if not is_partitioned(using, spec):
        return []
    return [p.name for p in partitions(using, spec) if p.end <= before]


# Per (database alias, table): the instant before which claims know their rows have a partition.
_COVERED: dict[tuple[str, str], dt.datetime] = {}
_COVERED_LOCK = threading.Lock()
# How long a claim waits for the partition it makes on the spot.
ON_THE_SPOT_TIMEOUT = 30.0


def ensure_covered(using: str, at: dt.datetime, spec: DayPartitioned = INBOX) -> None:
    """Make sure a row of ``spec`` stamped ``at`` has a partition to go to (usually a comparison
    with what this process last read), else make it on the spot, on a connection of its own."""
    key = (using, spec.table)
    if at < _COVERED.get(key, at):
        return
    if connections[using].vendor != "postgresql":
        _COVERED[key] = dt.datetime.max.replace(tzinfo=dt.UTC)
        return
    with _COVERED_LOCK:
        read, until = _read_coverage(using, at, spec)
        if read and until is not None and until <= at:
            logger.error(
                "no %s partition holds %s: making it now (is the partition upkeep failing? "
                "see the log of the consume and relay processes)",
                spec.label,
                at.isoformat(),
            )
            maker = threading.Thread(
                target=_make_on_the_spot, args=(using, at, spec), name="partition-on-the-spot"
            )
            maker.start()
            maker.join(ON_THE_SPOT_TIMEOUT)
            read, until = _read_coverage(using, at, spec)
        if not read:
            return
        if until is None:  # not partitioned
            until = dt.datetime.max.replace(tzinfo=dt.UTC)
        if until > at:
            _COVERED[key] = until


def forget_coverage() -> None:
    """Forget what :func:`ensure_covered` read (a table re-partitioned, in tests)."""
    _COVERED.clear()


def _read_coverage(
    using: str, at: dt.datetime, spec: DayPartitioned
) -> tuple[bool, dt.datetime | None]:
    """Whether the catalog could be read, and :func:`covered_until`, in a savepoint of the
    caller's connection (behind a pooler a second connection could wait for ever)."""
    try:
        with transaction.atomic(using=using):
            return True, covered_until(using, at, spec)
    except DatabaseError as exc:
        logger.warning("could not read the %s partitions: %s", spec.label, exc)
        return False, None


def _make_on_the_spot(using: str, at: dt.datetime, spec: DayPartitioned) -> None:
    try:
        ensure_partitions(using, now=at, spec=spec)
    except DatabaseError as exc:
        logger.error("could not make the %s partition of %s: %s", spec.label, at.date(), exc)
    finally:
        connections.close_all()


@dataclass(frozen=True)
class Dropped:
    name: str
    rows: int  # PostgreSQL's estimate


def _detach_concurrently(using: str, parent: str, name: str, finalize: bool) -> bool:
    """Detach ``name`` ``CONCURRENTLY`` (plainly in a test's transaction), or ``finalize``."""
    connection = connections[using]
    detach = f'ALTER TABLE "{parent}" DETACH PARTITION "{name}"'
    if connection.in_atomic_block:
        plain = detach + (" FINALIZE" if finalize else "")
        return bool(_ddl(using, f"detach {name}", _statements(plain)))
    statement = f"{detach} {'FINALIZE' if finalize else 'CONCURRENTLY'}"
    # No SET LOCAL outside a transaction: a bounded lock probe first, then a watchdog.
    probe = _statements(f'LOCK TABLE "{parent}" IN SHARE UPDATE EXCLUSIVE MODE')
    if not _ddl(using, f"lock {parent} to detach {name}", probe):
        return False
    watchdog = threading.Timer(DETACH_TIMEOUT, _cancel, args=(using, statement))
    watchdog.daemon = True
    watchdog.start()
    try:
        with connection.cursor() as cursor:
            cursor.execute(statement)
    except DatabaseError as exc:
        logger.warning("could not detach %s (will try again later): %s", name, exc)
        return False
    finally:
        watchdog.cancel()
    return True


# How long a concurrent detach may wait before it is cancelled (the next run finishes it).
DETACH_TIMEOUT = 300.0


def _cancel(using: str, statement: str) -> None:
    """Cancel ``statement`` where it still runs (found by its text, for a pooler's sake)."""
    try:
        with connections[using].cursor() as cursor:
            cursor.execute(
                "SELECT count(pg_cancel_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND state = 'active' AND query = %s",
                [statement],
            )
            if cursor.fetchone()[0]:
                logger.warning("cancelled after %.0fs: %s", DETACH_TIMEOUT, statement)
    except DatabaseError as exc:
        logger.warning("could not cancel %s: %s", statement, exc)
    finally:
        connections.close_all()


def _drop_detached(using: str, name: str) -> bool:
    """Drop ``name``, a table no longer attached: a lock on it alone, which nobody holds."""
    drop = _statements(f'DROP TABLE IF EXISTS "{name}"')
    return bool(_ddl(using, f"drop the detached partition {name}", drop))


def _leftovers(using: str, before: dt.datetime, spec: DayPartitioned) -> list[str]:
    """Detached day tables of ``spec`` (a process died before dropping them) that expired."""
    with connections[using].cursor() as cursor:
        cursor.execute(
            "SELECT relname FROM pg_class WHERE relkind = 'r' AND NOT relispartition "
            "AND relnamespace = current_schema()::regnamespace AND relname ~ %s",
            [f"^{re.escape(spec.prefix)}[0-9]{{8}}$"],
        )
        names = [row[0] for row in cursor.fetchall()]
    found = []
    for name in names:
        day = dt.datetime.strptime(name[len(spec.prefix) :], "%Y%m%d").date()
        if day_start(day + dt.timedelta(days=1)) <= before:
            found.append(name)
    return sorted(found)


def drop_expired(using: str, before: dt.datetime, spec: DayPartitioned = INBOX) -> list[Dropped]:
    """Detach concurrently and drop the partitions of ``spec`` wholly before ``before``."""
    if not is_partitioned(using, spec):
        return []
    dropped: list[Dropped] = []
    for name in _leftovers(using, before, spec):
        if _drop_detached(using, name):
            logger.info("dropped the detached %s partition %s", spec.label, name)
    for partition in partitions(using, spec):
        if partition.end > before:
            continue
        rows = estimated_rows_of(using, [partition.name])
        if not _detach_concurrently(using, spec.table, partition.name, partition.detaching):
            break
        if not _drop_detached(using, partition.name):
            break
        dropped.append(Dropped(partition.name, rows))
        logger.info("dropped the expired %s partition %s", spec.label, partition.name)
    if dropped:
        forget_coverage()  # what ensure_covered read may include what is gone
    return dropped


def estimated_rows_of(using: str, tables: list[str]) -> int:
    """PostgreSQL's estimate of the rows of ``tables`` (one never analyzed yet is counted)."""
    if not tables:
        return 0
    with connections[using].cursor() as cursor:
        cursor.execute(
            "SELECT relname, reltuples FROM pg_class WHERE oid = ANY(%s::regclass[])", [tables]
        )
        total = 0
        for name, reltuples in cursor.fetchall():
            if reltuples < 0:
                cursor.execute(f'SELECT count(*) FROM "{name}"')  # noqa: S608
                reltuples = cursor.fetchone()[0]
            total += int(reltuples)
    return total


def estimated_rows(using: str, table: str = INBOX_TABLE) -> float | None:
    """PostgreSQL's estimate of a table's rows over its partitions; None if never analyzed."""
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


# How often a consumer or relay keeps the partitions, and how soon it tries again after a failure.
UPKEEP_INTERVAL = 3600.0
UPKEEP_RETRY = 60.0


class PartitionUpkeep:
    """A thread that makes the coming day partitions of ``spec`` every ``interval`` seconds and
    drops those past ``retention``; a failed run is tried again after ``retry``."""

    def __init__(
        self,
        using: str,
        interval: float = UPKEEP_INTERVAL,
        spec: DayPartitioned = INBOX,
        *,
        retention: dt.timedelta | None = None,
        health: HealthState | None = None,
        retry: float = UPKEEP_RETRY,
        clock: Callable[[], dt.datetime] | None = None,
    ) -> None:
        self.using = using
        self.interval = interval
        self.spec = spec
        self.retention = retention
        self.health = health
        self.retry = retry
        self.clock = clock or (lambda: dt.datetime.now(dt.UTC))
        self.failures = 0  # runs that failed in a row
        self.problem: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"{spec.label}-partitions", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def run_once(self) -> bool:
        """One run of the upkeep; whether it left the partitions as they should be."""
        now = self.clock()
        before = None if self.retention is None else now - self.retention
        problem: str | None = None
        try:
            ensure_partitions(self.using, now=now, spec=self.spec)
            if before is not None:
                drop_expired(self.using, before, self.spec)
            ahead = days_ahead(self.using, now, self.spec)
            if ahead is None:  # not partitioned: nothing to keep
                return True
            left = [] if before is None else expired(self.using, before, self.spec)

            if ahead < AHEAD_DAYS:
                problem = f"only {ahead:.1f} day(s) of {self.spec.label} partitions are made ahead"
            elif left:
                problem = f"expired {self.spec.label} partition(s) not dropped: {', '.join(left)}"
            metrics.partition_days_ahead(self.spec.label, ahead)
        except Exception as exc:  # noqa: BLE001 - the database may be down: tried again soon
            problem = f"{self.spec.label} partition upkeep failed: {type(exc).__name__}: {exc}"
            ahead = None
        finally:
            connections.close_all()
        self._record(problem, ahead)
        return problem is None

    def _record(self, problem: str | None, ahead: float | None) -> None:
        key = f"{self.spec.label}-partitions"
        if problem is None:
            if self.failures:
                logger.info("%s partition upkeep works again", self.spec.label)
            self.failures, self.problem = 0, None
            if self.health is not None:
                self.health.note(key, None)
            return
        self.failures += 1
        self.problem = problem
        metrics.partition_upkeep_failed(self.spec.label)
        urgent = ahead is not None and ahead < UPKEEP_WARN_DAYS
        logger.log(
            logging.ERROR if urgent else logging.WARNING,
            "%s (%d run(s) in a row; trying again in %.0fs)%s",
            problem,
            self.failures,
            self.retry,
            ": rows of a day with no partition make it on the spot, but find why the upkeep "
            "fails (docs/operations.md#partition-upkeep)"
            if urgent
            else "",
        )
        if self.health is not None:
            self.health.note(key, f"{problem} ({self.failures} upkeep run(s) failed in a row)")

    def _run(self) -> None:
        try:
            while True:
                ok = self.run_once()
                if self._stop.wait(self.interval if ok else min(self.interval, self.retry)):
                    return
        finally:
            connections.close_all()
