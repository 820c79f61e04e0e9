"""Exactly once: a handler's effects commit together with its inbox row, or not at all
(``docs/design.md#the-inbox-claim``)."""

from __future__ import annotations

import contextlib
import threading
import time
import zlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from django.db import IntegrityError, OperationalError, connections, transaction
from django.utils import timezone

from ..choices import OPEN_DEAD_LETTER_STATUSES
from ..core.advisory_locks import CLAIM_LOCK_CLASS
from ..models import ProcessedMessage
from .partitions import INBOX_CLAIM_FUNCTION, LOCK_NOT_AVAILABLE, ensure_covered

CLIENT_CURSOR: type | None
try:
    from psycopg import ClientCursor as CLIENT_CURSOR
except ImportError:  # psycopg2, or no PostgreSQL at all
    CLIENT_CURSOR = None

# An inbox row's key: (consumer, message_id).
InboxKey = tuple[str, str]
# A claim's keys inserted (each with whether an open dead letter of it may exist), and busy.
Claimed = tuple[dict[InboxKey, bool], set[InboxKey]]


# How long a row is tried alone after its batch's claim timed out (a row still locked is busy).
ROW_LOCK_PROBE = 0.1


# Keys found held by another transaction, and when (monotonic): for BUSY_MEMORY their copies
# wait only ROW_LOCK_PROBE (``docs/design.md#the-inbox-claim``).
_BUSY_KEYS: dict[InboxKey, float] = {}
BUSY_MEMORY = 60.0
_BUSY_LOCK = threading.Lock()


def remember_busy(keys: Iterable[InboxKey]) -> None:
    now = time.monotonic()
    with _BUSY_LOCK:
        for key in keys:
            _BUSY_KEYS[key] = now
        if len(_BUSY_KEYS) > 10_000:
            for key, at in list(_BUSY_KEYS.items()):
                if now - at > BUSY_MEMORY:
                    del _BUSY_KEYS[key]


# Seconds a claim waits for an inbox row another transaction holds before its delivery is
# deferred instead of stalling the consumer.
LOCK_TIMEOUT = 2.0


def lock_wait_for(keys: Iterable[InboxKey], redelivered: bool) -> float:
    """How long a claim of ``keys`` may wait on held rows: ``LOCK_TIMEOUT``, or ROW_LOCK_PROBE
    for a redelivery or a key found held lately."""
    now = time.monotonic()
    with _BUSY_LOCK:
        held = any(now - _BUSY_KEYS.get(key, -BUSY_MEMORY) < BUSY_MEMORY for key in keys)
    return min(ROW_LOCK_PROBE, LOCK_TIMEOUT) if redelivered or held else LOCK_TIMEOUT


class InboxRowBusy(Exception):
    """Another transaction holds this message's inbox row and did not end in time."""


@contextlib.contextmanager
def bounded_lock_wait(using: str, seconds: float) -> Iterator[None]:
    """Bound lock waits to ``seconds`` in the current transaction, then restore the bound; a
    wait cut short raises :class:`InboxRowBusy` (roll the savepoint back)."""
    connection = connections[using]
    if connection.vendor != "postgresql" or seconds <= 0:
        yield
        return
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT current_setting('lock_timeout'), set_config('lock_timeout', %s, true)",
            [f"{max(1, round(seconds * 1000))}ms"],
        )
        previous = cursor.fetchone()[0]
    try:
        yield
    except OperationalError as exc:
        if getattr(exc.__cause__, "sqlstate", None) == LOCK_NOT_AVAILABLE:
            raise InboxRowBusy(str(exc)) from exc
        raise
    with connection.cursor() as cursor:
        cursor.execute("SELECT set_config('lock_timeout', %s, true)", [previous])


@contextlib.contextmanager
def claimed_atomic(
    using: str, consumer: str, message_id: str, *, lock_wait: float = 0.0
) -> Iterator[bool]:
    """``transaction.atomic(using)`` with the inbox row of (consumer, message_id) inserted;
    yields whether it went in. Past ``lock_wait`` (0: no bound) raises :class:`InboxRowBusy`."""
    with transaction.atomic(using=using):
        with bounded_lock_wait(using, lock_wait):
            if not insert_inbox_row(using, consumer, message_id):
                # Before the bound is restored: a caller that raises spares that round trip.
                yield False
                return
        yield True


# Databases with INSERT ... ON CONFLICT DO NOTHING RETURNING; others claim one by one.
CLAIM_VENDORS = frozenset({"postgresql", "sqlite"})


def claim_inbox_rows(using: str, keys: list[InboxKey], lock_wait: float) -> Claimed:
    """Insert the inbox rows of ``keys``, sorted; those held past ``lock_wait`` come back busy
    (``docs/design.md#the-inbox-claim``)."""
    ordered = sorted(set(keys))
    if connections[using].vendor not in CLAIM_VENDORS:
        return {key: True for key in ordered if insert_inbox_row(using, *key)}, set()
    if lock_wait <= ROW_LOCK_PROBE and connections[using].vendor == "postgresql":
        return _claim_around_held(using, ordered)
    try:
        return _claim(using, ordered, lock_wait), set()
    except InboxRowBusy:
        pass
    if connections[using].vendor == "postgresql":
        return _claim_around_held(using, ordered)
    return _claim_one_by_one(using, ordered)


def _claim(using: str, keys: list[InboxKey], lock_wait: float) -> dict[InboxKey, bool]:
    """The batch claim of sorted ``keys`` in a savepoint; :class:`InboxRowBusy` past
    ``lock_wait``."""
    if _one_round_trip(using):
        return _claim_in_one_round_trip(using, keys, lock_wait)
    with transaction.atomic(using=using), bounded_lock_wait(using, lock_wait):
        return _insert_inbox_rows(using, keys)


def _claim_around_held(using: str, keys: list[InboxKey]) -> Claimed:
    """PostgreSQL: keys whose claim lock is held (found without waiting) are busy; the others
    are claimed, waiting ``ROW_LOCK_PROBE`` at most."""
    hashes = sorted({_key_hash(consumer, message_id) for consumer, message_id in keys})
    with connections[using].cursor() as cursor:
        cursor.execute(
            "SELECT k FROM unnest(%s::int[]) AS k WHERE NOT pg_try_advisory_xact_lock(%s, k)",
            [hashes, CLAIM_LOCK_CLASS],
        )
        held = {row[0] for row in cursor.fetchall()}
    busy = {key for key in keys if _key_hash(*key) in held}
    free = [key for key in keys if key not in busy]
    if not free:
        return {}, busy
    try:
        return _claim(using, free, ROW_LOCK_PROBE), busy
    except InboxRowBusy:
        claimed, more = _claim_one_by_one(using, free)
        return claimed, busy | more


def _claim_one_by_one(using: str, keys: list[InboxKey]) -> Claimed:
    """Each of ``keys`` claimed alone, waiting ``ROW_LOCK_PROBE`` at most; the held ones busy."""
    claimed: dict[InboxKey, bool] = {}
    busy: set[InboxKey] = set()
    for key in keys:
        try:
            claimed.update(_claim(using, [key], ROW_LOCK_PROBE))
        except InboxRowBusy:
            busy.add(key)
    return claimed, busy


# The batch claim's savepoint, and the setting keeping the lock_timeout it replaces.
CLAIM_SAVEPOINT = "rm_inbox_claim"
SAVED_LOCK_TIMEOUT = "reliable_messaging.saved_lock_timeout"


def _one_round_trip(using: str) -> bool:
    """Whether the claim may go as one script: psycopg 3 with client-side binding (Django's
    default)."""
    connection = connections[using]
    if connection.vendor != "postgresql" or CLIENT_CURSOR is None:
        return False
    with connection.cursor() as cursor:
        return isinstance(cursor.cursor, CLIENT_CURSOR)


def _claim_in_one_round_trip(
    using: str, keys: list[InboxKey], lock_wait: float
) -> dict[InboxKey, bool]:
    """:func:`bounded_lock_wait` around :func:`_insert_inbox_rows` in a savepoint, in one round
    trip instead of five; :class:`InboxRowBusy` after rolling back to the savepoint."""
    connection = connections[using]
    lock, lock_params = _key_locks_sql(keys)
    insert, params = _insert_inbox_rows_sql(using, keys)
    params = [*lock_params, *params]
    bounded = lock_wait > 0
    script = [f"SAVEPOINT {CLAIM_SAVEPOINT}"]
    if bounded:
        script.append(
            f"SELECT set_config('{SAVED_LOCK_TIMEOUT}', current_setting('lock_timeout'), true), "
            "set_config('lock_timeout', %s, true)"
        )
        params = [f"{max(1, round(lock_wait * 1000))}ms", *params]
    script += [lock, insert]
    if bounded:
        script.append(
            f"SELECT set_config('lock_timeout', current_setting('{SAVED_LOCK_TIMEOUT}'), true)"
        )
    script.append(f"RELEASE SAVEPOINT {CLAIM_SAVEPOINT}")
    with connection.cursor() as cursor:
        try:
            cursor.execute("; ".join(script), params)
        except OperationalError as exc:
            if getattr(exc.__cause__, "sqlstate", None) != LOCK_NOT_AVAILABLE:
                raise
            cursor.execute(
                f"ROLLBACK TO SAVEPOINT {CLAIM_SAVEPOINT}; RELEASE SAVEPOINT {CLAIM_SAVEPOINT}"
            )
            raise InboxRowBusy(str(exc)) from exc
        raw = cursor.cursor
        while raw.description is None or raw.description[0].name != "consumer":
            if not raw.nextset():  # pragma: no cover - the script always has the claim
                raise RuntimeError("the inbox claim returned no rows")
        return {(consumer, message_id): bool(open_) for consumer, message_id, open_ in raw}


def _insert_inbox_rows_sql(using: str, keys: list[InboxKey]) -> tuple[str, list[Any]]:
    """The claim's statement and parameters; see :func:`_insert_inbox_rows`."""
    connection = connections[using]
    now = timezone.now()
    if connection.vendor != "postgresql":
        table = connection.ops.quote_name(ProcessedMessage._meta.db_table)
        params: list[Any] = []
        for consumer, message_id in keys:
            params += [consumer, message_id, now]
        rows = ", ".join(["(%s, %s, %s)"] * len(keys))
        insert = (
            f"INSERT INTO {table} (consumer, message_id, processed_at) "  # noqa: S608
            f"VALUES {rows} ON CONFLICT (consumer, message_id) DO NOTHING "
            "RETURNING consumer, message_id"
        )
        # SQLite has no INSERT in a WITH: every claimed row may have an open dead letter.
        return f"{insert}, 1", params
    # A day with no partition (every upkeep failing for days, a clock far ahead) is made first.
    ensure_covered(using, now)
    # The function (migrations/0001_initial.py) looks for each key in every day's partition,
    # after _key_locks_sql's statement, in a snapshot that sees copies committed meanwhile.
    sql = (
        "SELECT consumer, message_id, open_letter "  # noqa: S608
        f"FROM {INBOX_CLAIM_FUNCTION}(%s::text[], %s::text[], %s, %s::text[])"
    )
    consumers = [consumer for consumer, _ in keys]
    message_ids = [message_id for _, message_id in keys]
    return sql, [consumers, message_ids, now, [str(s) for s in OPEN_DEAD_LETTER_STATUSES]]


def _insert_inbox_rows(using: str, keys: list[InboxKey]) -> dict[InboxKey, bool]:
    """Insert the inbox rows of ``keys`` not there yet; those inserted, each with whether an
    open dead letter of it may exist (for ``dead_letters.ledger.settle_processed``)."""
    sql, params = _insert_inbox_rows_sql(using, keys)
    with connections[using].cursor() as cursor:
        if connections[using].vendor == "postgresql":
            cursor.execute(*_key_locks_sql(keys))
        cursor.execute(sql, params)
        return {(consumer, message_id): bool(open_) for consumer, message_id, open_ in cursor}


def _key_hash(consumer: str, message_id: str) -> int:
    """A stable 32-bit signed hash of the pair (a collision only costs a wait)."""
    value = zlib.crc32(f"{consumer}\x1f{message_id}".encode("utf-8", "surrogatepass"))
    return value - (1 << 32) if value >= 1 << 31 else value


def _key_locks_sql(keys: Sequence[InboxKey]) -> tuple[str, list[Any]]:
    """The statement that takes a transaction-scoped advisory lock per key, in one order for
    everyone: two copies wait for each other whatever day's partition they go to."""
    hashes = sorted({_key_hash(consumer, message_id) for consumer, message_id in keys})
    return (
        "SELECT count(pg_advisory_xact_lock(%s, k)) FROM unnest(%s::int[]) AS k",
        [CLAIM_LOCK_CLASS, hashes],
    )


def insert_inbox_row(using: str, consumer: str, message_id: str) -> bool:
    """Insert the inbox row of one message in the caller's transaction; False: a duplicate."""
    if connections[using].vendor in CLAIM_VENDORS:
        return (consumer, message_id) in _insert_inbox_rows(using, [(consumer, message_id)])
    try:
        with transaction.atomic(using=using):
            ProcessedMessage.objects.using(using).create(consumer=consumer, message_id=message_id)
    except IntegrityError:
        return False
    return True
