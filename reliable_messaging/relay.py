"""The outbox relay: sends committed outbox rows with pipelined publisher confirms.

One thread runs pika's asynchronous ``SelectConnection`` I/O loop; the database work runs on
``MAX_IN_FLIGHT`` worker threads, each with its own connection, so that publishing and waiting
on PostgreSQL overlap. A batch goes like this:

1. ``claim`` (a worker): in a transaction, ``SELECT ... FOR UPDATE SKIP LOCKED`` the due rows
   through the index of due pending rows (rows sent, backing off, leased or parked are outside
   the range it reads, so its cost does not grow with them). Relays running side by side never
   take the same row. A keyed row goes only when no earlier row of its key is unsent; one
   behind such a row is *parked* (``next_attempt_at`` NULL, in a transaction of its own that
   locks the row holding it back) and is never read again until that row is sent, which
   releases the next one in the transaction that marks it sent. (A sweep every 30 s releases
   any left parked by other means, an operator's edit say.)
2. ``publish`` (the I/O loop): every row goes out at once (``mandatory=True``, persistent).
   While its confirms come back the next batch is claimed and published, up to
   ``MAX_IN_FLIGHT`` batches.
3. ``settle`` (the batch's worker): confirms arrive, ``multiple=True`` settling every tag up
   to the one named. When all of a batch are in (or ``RELAY_CONFIRM_TIMEOUT`` passes) the
   confirmed rows are marked sent, the others get their error, an attempt and a backoff, and
   the claim's transaction commits. An event the broker returned as unroutable (no queue
   bound: nobody subscribes yet) is marked ``unrouted`` instead, for good; only routing keys
   matching ``REQUIRE_ROUTE`` (commands) are retried. When the broker refuses a publish by
   closing the channel (403, 406, ...), the row it names is charged and what was confirmed is
   marked sent; the unconfirmed rest are due again at once.

A claim's transaction stays open while its confirms arrive (milliseconds) but never longer
than ``HOLD_LIMIT`` (2 s): a batch still unconfirmed then (a slow or blocked broker) trades its
row locks for a *lease*, ``next_attempt_at`` set ``RELAY_CONFIRM_TIMEOUT`` + 5 s ahead and
renewed while the batch is in flight, and the transaction commits. So no snapshot and no lock
is held long on the busiest table, which would hold back vacuum.

Every time the relay compares or computes ``next_attempt_at`` it uses the database's clock, the
one ``publish()`` writes it with, so hosts with skewed clocks agree on when a row is due.

A crash before a batch is recorded rolls its transaction back: the rows are due again at once
(or, if leased, when the lease runs out) and a relay sends them again (consumers absorb the
duplicate by message_id). Nothing committed is lost.

On PostgreSQL the relay also LISTENs on a channel that a trigger NOTIFYs on every committed
insert, with the listening socket watched by the same I/O loop (a new LISTEN connection for
each broker connection, since each has its own loop), so a new row leaves within
milliseconds; polling every ``RELAY_POLL_INTERVAL`` remains as the fallback (the only mode on
other databases).

Flow control: when the broker runs low on memory or disk it stops reading from publishing
connections and says so with ``connection.blocked``. The relay then claims nothing more (rows
stay pending in the database, not piled up in memory) and stops the confirm timer of the batch
in flight: its confirms are late because of the block, not lost, and charging its rows a failed
attempt for that would mark them failed after a long enough alarm. On ``connection.unblocked``
the relay goes on by itself. A block longer than the connection's ``blocked_connection_timeout``
ends the connection; the batch rolls back and goes again after the reconnect.

Each relay counts what it does in :mod:`.metrics` and reports to a
:class:`~reliable_messaging.metrics.HealthState` (broker, database, a heartbeat from the I/O
loop) that ``--metrics-port`` serves as ``/healthz``.
"""

from __future__ import annotations

import datetime as dt
import functools
import logging
import queue
import re
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import pika
import pika.channel
import pika.exceptions
from django.db import DatabaseError, connections, router, transaction
from django.db.models import (
    BigIntegerField,
    DurationField,
    F,
    Min,
    Value,
)
from django.db.models.expressions import RawSQL
from django.db.models.functions import Now
from pika.spec import Basic, BasicProperties

from . import metrics
from .backoff import Backoff
from .conf import MessagingSettings, messaging_settings
from .console import announce
from .envelope import CONTENT_TYPE, ORDERING_KEY_HEADER, PUBLISHED_AT_HEADER
from .metrics import HealthState
from .models import OutboxMessage, OutboxStatus
from .partitions import UNSENT_STATUSES, row_moved
from .pika_logs import expecting_not_found
from .routing import topic_matches
from .topology import connect, connection_parameters
from .write_coalescing import coalesce_writes

logger = logging.getLogger(__name__)

NOTIFY_CHANNEL = "reliable_messaging_outbox"
OUTBOX_ID_HEADER = "x-rm-outbox-id"
NOT_FOUND = 404
_MISSING_EXCHANGE = re.compile(r"no exchange '([^']*)'")
# The exchange a 403 names ("access to exchange 'x' in vhost '/' refused", "cannot publish to
# internal exchange 'x'") and the size a 406 names ("message size 123 is larger than ...").
_NAMED_EXCHANGE = re.compile(r"exchange '([^']*)'")
_MESSAGE_SIZE = re.compile(r"message size (\d+)")


def resend_backoff(attempts: int) -> dt.timedelta:
    """Wait before the next try of a row that failed ``attempts`` times: 1 s doubling to 5 min."""
    return dt.timedelta(seconds=min(2 ** max(attempts - 1, 0), 300))


# Batches published and awaiting confirms at once: the next is claimed and sent while the
# previous one's confirms come back.
MAX_IN_FLIGHT = 3
# Seconds a claim's lease lasts past RELAY_CONFIRM_TIMEOUT.
LEASE_MARGIN = 5.0
# Seconds a batch's claim transaction may stay open while its confirms are awaited; past it
# the rows are leased instead and the transaction commits (see _renew_leases).
HOLD_LIMIT = 2.0
# The statuses of a row not sent yet. Each statement that reads or changes such rows names them:
# on PostgreSQL that confines it to the outbox's unsent partition (partitions.py).
UNSENT = UNSENT_STATUSES
# How often a claim or a record is tried again at once when a row it reached was moved to the
# sent partition meanwhile (a serialization failure, in READ COMMITTED only that).
MOVED_TRIES = 3
# Parked rows are released by the relay that sends the row before them; this sweep catches
# any left parked by other means (a row deleted by hand, say).
SWEEP_INTERVAL = 30.0


def _earlier_unsent_sql() -> str:
    """SQL for the id of an unsent row before the outer outbox row in its key, or NULL.

    Compared as a row, ``(ordering_key, id) < (...)``, so that only the key index can answer
    it, reading one entry: with ``id < ...`` apart, the planner takes the LIMIT 1 as a cue to
    walk the primary key from the start instead, and reads every earlier row of the table."""
    table = f'"{OutboxMessage._meta.db_table}"'
    return (
        f"CASE WHEN {table}.ordering_key IS NULL THEN NULL ELSE ("  # noqa: S608
        f"SELECT u.id FROM {table} u WHERE u.status IN ('pending', 'failed')"
        f" AND u.ordering_key = {table}.ordering_key"
        f" AND (u.ordering_key, u.id) < ({table}.ordering_key, {table}.id)"
        " ORDER BY u.ordering_key, u.id LIMIT 1) END"
    )


def claimable(using: str) -> Any:
    """Due pending rows, earliest due first, each with ``behind``: the id of an earlier unsent
    row of its key (it must wait, parked) or None. Read through the index of due pending rows,
    with one probe of the key index per keyed row."""
    return (
        OutboxMessage.objects.using(using)
        # The database's clock, not this process's: next_attempt_at is written with it too, so
        # a relay whose clock is off neither sends rows early nor sits on due ones.
        .filter(status=OutboxStatus.PENDING, next_attempt_at__lte=Now())
        # No input of anyone in this SQL: only the table name and constants.
        .annotate(behind=RawSQL(_earlier_unsent_sql(), (), output_field=BigIntegerField()))  # noqa: S611
        .order_by("next_attempt_at", "id")
    )


def any_id_of(using: str, pks: Iterable[int]) -> Any:
    """The right-hand side of ``pk__in`` for a batch of ids. On PostgreSQL one array parameter
    (``id IN (SELECT unnest(...))``): Django and psycopg compile it in the same time whatever
    its length, and PostgreSQL parses one value. A placeholder per id, as a plain list gets,
    made compiling a batch's statements an eighth of the relay's Python time."""
    if connections[using].vendor == "postgresql":
        return RawSQL("SELECT unnest(%s::bigint[])", (list(pks),))
    return list(pks)


def release_next_of_keys(using: str, keys: set[str]) -> int:
    """Make the first unsent row of each key due, if it is parked: the row before it was just
    sent. On PostgreSQL one statement finds each key's first row through the key index."""
    if not keys:
        return 0
    connection = connections[using]
    if connection.vendor == "postgresql":
        table = connection.ops.quote_name(OutboxMessage._meta.db_table)
        with connection.cursor() as cursor:
            cursor.execute(
                f"UPDATE {table} SET next_attempt_at = now() WHERE id IN ("  # noqa: S608
                f"SELECT (SELECT o.id FROM {table} o WHERE o.ordering_key = k.key"
                " AND o.status IN ('pending', 'failed') ORDER BY o.id LIMIT 1)"
                " FROM unnest(%s::text[]) AS k(key))"
                " AND status = 'pending' AND next_attempt_at IS NULL",
                [sorted(keys)],
            )
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


def release_parked(using: str, after: int = 0, limit: int = 2000) -> tuple[int, int | None]:
    """Make due the parked rows (up to ``limit`` of them with an id over ``after``) that no
    earlier unsent row of their key holds back any more. Returns how many it released and the
    id to go on after, or None when it reached the last parked row."""
    outbox = OutboxMessage.objects.using(using)
    found = list(
        outbox.filter(status=OutboxStatus.PENDING, next_attempt_at__isnull=True, id__gt=after)
        .annotate(behind=RawSQL(_earlier_unsent_sql(), (), output_field=BigIntegerField()))  # noqa: S611
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


@dataclass(frozen=True)
class ClaimedRow:
    """The columns of a claimed outbox row the relay needs (no model instance: cheaper)."""

    pk: int
    message_id: str
    exchange: str
    routing_key: str
    body: str
    headers: dict[str, Any]
    ordering_key: str | None
    attempts: int
    created_at: dt.datetime


CLAIMED_FIELDS = (
    "pk",
    "message_id",
    "exchange",
    "routing_key",
    "body",
    "headers",
    "ordering_key",
    "attempts",
    "created_at",
)
_BEHIND = len(CLAIMED_FIELDS)  # the position of ``behind`` in a claimed tuple


def message_properties(row: ClaimedRow) -> BasicProperties:
    headers: dict[str, Any] = dict(row.headers or {})
    headers[PUBLISHED_AT_HEADER] = int(row.created_at.timestamp() * 1000)
    headers[OUTBOX_ID_HEADER] = row.pk
    if row.ordering_key is not None:
        headers[ORDERING_KEY_HEADER] = row.ordering_key
    return BasicProperties(
        content_type=CONTENT_TYPE,
        delivery_mode=pika.DeliveryMode.Persistent,
        message_id=row.message_id,
        timestamp=int(row.created_at.timestamp()),
        headers=headers,
    )


@dataclass
class RelayReport:
    """What a relay did; ``left_failed`` counts failed rows in the outbox when it stopped."""

    sent: int = 0
    nacked: int = 0
    returned: int = 0
    unrouted: int = 0  # events no queue was bound for, marked unrouted (also in ``returned``)
    timed_out: int = 0
    batches: int = 0
    left_failed: int = 0
    left_pending: int = 0
    left_retrying: int = 0  # pending rows that already failed at least once

    def summary(self) -> str:
        return (
            f"sent {self.sent}, nacked {self.nacked}, unroutable {self.returned} "
            f"({self.unrouted} event(s) with no subscriber marked unrouted), "
            f"confirm timeouts {self.timed_out} in {self.batches} batch(es); outbox now has "
            f"{self.left_pending} pending ({self.left_retrying} after failed sends) and "
            f"{self.left_failed} failed row(s)"
        )


@dataclass
class _Batch:
    """Rows published and awaiting confirms, under the lease their claim took."""

    rows: dict[int, ClaimedRow]  # published, by delivery tag
    claimed: list[ClaimedRow] = field(default_factory=list)  # every row the claim took
    worker: Any = None  # the _DatabaseWorker whose connection holds its transaction
    # The claim's transaction, holding the row locks, until HOLD_LIMIT: then the rows are
    # leased instead and it commits (touched on the worker's thread only).
    atomic: Any = None
    unpublished: list[ClaimedRow] = field(default_factory=list)  # refused before publishing
    errors: dict[int, str] = field(default_factory=dict)  # row id -> why it was not sent
    confirmed: set[int] = field(default_factory=set)  # row ids acked by the broker
    unrouted: set[int] = field(default_factory=set)  # row ids of events returned unroutable
    settled: set[int] = field(default_factory=set)  # delivery tags acked or nacked
    lowest_unsettled: int = 0
    pks: set[int] = field(default_factory=set)  # ids of the claimed rows
    timer: Any = None
    published_at: float = 0.0  # monotonic time the rows went out, for the confirm latency
    leased_at: float = 0.0  # monotonic time the lease was taken or renewed; 0: not leased

    def holds(self, pk: int) -> bool:
        return pk in self.pks

    def unconfirmed(self) -> list[ClaimedRow]:
        """Published rows not confirmed nor charged yet, in the order they went out."""
        return [
            self.rows[tag]
            for tag in sorted(self.rows)
            if self.rows[tag].pk not in self.confirmed and self.rows[tag].pk not in self.errors
        ]


class _ExchangeProbe:
    """Checks that an exchange exists before rows are published to it.

    Publishing to a missing exchange makes the broker close the channel, which would throw away
    the confirms of every other row in flight (and send them twice). A passive declare on a
    separate, blocking connection costs one round trip per exchange per minute instead.
    """

    TTL = 60.0

    def __init__(self, settings: MessagingSettings) -> None:
        self.settings = settings
        self._known: dict[str, float] = {"": float("inf")}  # the default exchange always exists
        self._connection: pika.BlockingConnection | None = None
        self._channel: Any = None

    def exists(self, exchange: str) -> bool:
        if self._known.get(exchange, 0.0) > time.monotonic():
            return True
        try:
            if self._connection is None or not self._connection.is_open:
                self._connection = connect(self.settings, name="relay exchange probe")
            if self._channel is None or not self._channel.is_open:
                self._channel = self._connection.channel()
            with expecting_not_found():
                self._channel.exchange_declare(exchange, passive=True)
        except pika.exceptions.ChannelClosedByBroker as exc:
            if exc.reply_code == NOT_FOUND:
                return False
            raise
        except pika.exceptions.AMQPError:
            # The probe cannot tell; let the publish try (a 404 there is handled too).
            self.close()
            return True
        self._known[exchange] = time.monotonic() + self.TTL
        return True

    def forget(self, exchange: str | None) -> None:
        """The broker said ``exchange`` is gone: check it again before the next publish."""
        if exchange is not None and exchange != "":
            self._known.pop(exchange, None)

    def close(self) -> None:
        connection, self._connection, self._channel = self._connection, None, None
        if connection is not None and connection.is_open:
            try:
                connection.close()
            except Exception:
                logger.debug("closing the exchange probe failed", exc_info=True)


# Connection parameters Django's PostgreSQL backend adds that are Python objects of the driver,
# not libpq settings: the LISTEN connection has no use for them.
_DRIVER_ONLY_PARAMS = frozenset({"cursor_factory", "context", "prepare_threshold"})


def listen_conninfo(using: str) -> str:
    """A libpq connection string for the LISTEN connection, built from the parameters Django's
    own connection to ``using`` uses, so ``OPTIONS`` (``service``, ``sslmode``, ``options``,
    ``application_name``, ...) apply to it as to every other connection of the project."""
    import psycopg

    params = {
        key: str(value)
        for key, value in connections[using].get_connection_params().items()
        if key not in _DRIVER_ONLY_PARAMS and value is not None
    }
    params.setdefault("connect_timeout", "5")
    return psycopg.conninfo.make_conninfo(**params)


class _Listener:
    """A dedicated autocommit psycopg connection LISTENing for committed outbox inserts."""

    def __init__(self, using: str) -> None:
        import psycopg

        self.connection = psycopg.connect(listen_conninfo(using), autocommit=True)
        self.connection.execute(f"LISTEN {NOTIFY_CHANNEL}")

    def fileno(self) -> int:
        return self.connection.fileno()

    def drain(self) -> int:
        """Read what arrived; returns how many notifications there were. Raises when the
        connection is broken."""
        pgconn = self.connection.pgconn
        pgconn.consume_input()
        count = 0
        while pgconn.notifies() is not None:
            count += 1
        return count

    def close(self) -> None:
        try:
            self.connection.close()
        except Exception:
            logger.debug("error closing the LISTEN connection", exc_info=True)


def outbox_backlog(using: str) -> tuple[int, int, int] | None:
    """(pending, pending after failed sends, failed) rows; None when the database is down.

    Three counts, each read through an index of the rows it counts (one aggregate with
    filters would read every row of the table, sent ones included: seconds at 30 M rows)."""
    outbox = OutboxMessage.objects.using(using)
    try:
        pending = outbox.filter(status=OutboxStatus.PENDING)
        counts = (
            pending.count(),
            pending.filter(attempts__gt=0).count(),
            outbox.filter(status=OutboxStatus.FAILED).count(),
        )
    except DatabaseError:
        logger.warning("relay: cannot count the outbox rows left (database unavailable)")
        return None
    return counts


@dataclass
class _Claim:
    """What a claim found: rows to send under the transaction that locks them (or None when
    there are none), rows it parked, seconds until the next row is due, or an error."""

    rows: list[ClaimedRow]
    atomic: Any = None
    parked: int = 0
    wait: float = 0.0
    error: DatabaseError | None = None


class _DatabaseWorker:
    """Runs the relay's database work, one job at a time, on a thread of its own with its own
    connection, so the I/O loop publishes and takes confirms while a claim or the recording
    of a batch waits on PostgreSQL: on two cores the two overlap instead of taking turns.

    A batch's rows stay locked by its claim's transaction on its worker's connection until
    the batch is recorded, so each batch in flight has a worker of its own."""

    def __init__(self, name: str) -> None:
        # Set and read on the I/O loop only: the batch whose transaction this worker's
        # connection holds, and whether a claim was given to it.
        self.batch: _Batch | None = None
        self.claiming = False
        # A claim's answer, handed from this worker's thread to the I/O loop.
        self.claimed: _Claim | None = None
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def drain(self) -> None:
        """Wait until every job submitted so far has run."""
        self._jobs.join()

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(30)

    def _run(self) -> None:
        try:
            while True:
                job = self._jobs.get()
                try:
                    if job is None:
                        return
                    job()
                except Exception:
                    # Jobs handle their own database errors; anything else is a bug to see,
                    # never a reason for the relay to stop recording batches.
                    logger.exception("relay: unexpected error in database work")
                finally:
                    self._jobs.task_done()
        finally:
            connections.close_all()  # this thread's connections


class OutboxRelay:
    """Publishes the outbox until stopped; with ``once`` until nothing is pending."""

    def __init__(
        self,
        *,
        batch_size: int | None = None,
        once: bool = False,
        max_seconds: float | None = None,
        listen: bool = True,
        settings: MessagingSettings = messaging_settings,
        on_batch: Callable[[RelayReport], None] | None = None,
        health: HealthState | None = None,
    ) -> None:
        self.settings = settings
        self.batch_size = batch_size or settings.relay_batch_size
        self.once = once
        self.deadline = None if max_seconds is None else time.monotonic() + max_seconds
        self.using = router.db_for_write(OutboxMessage)
        self.listen = listen and connections[self.using].vendor == "postgresql"
        self.on_batch = on_batch
        self.health = health if health is not None else HealthState()
        self.report = RelayReport()
        self._stop_requested = False
        self._finished = False
        self._blocked = False  # the broker sent connection.blocked on the current connection
        self._connection: pika.SelectConnection | None = None
        self._channel: pika.channel.Channel | None = None
        self._next_tag = 1
        self._batches: list[_Batch] = []  # in flight, oldest first
        # Rows stay leased this long after a claim: the confirm timeout and a margin to record
        # the outcome. A batch that takes longer (a broker block) has its lease renewed.
        self.lease = dt.timedelta(seconds=settings.relay_confirm_timeout + LEASE_MARGIN)
        self._next_sweep = 0.0  # monotonic time of the next release_parked sweep
        self._sweep_after: int | None = None  # where the sweep's pass goes on
        # One per batch that may be in flight; they run every query of the batches.
        self._workers: list[_DatabaseWorker] = []
        self._look_again = False  # a claim was asked for while one was under way
        self._tick_at = 0.0  # monotonic time the pending tick timer fires
        self._tick_timer: Any = None
        self._watch_timer: Any = None
        self._listener: _Listener | None = None
        self._listener_retry_at = 0.0
        self._probe = _ExchangeProbe(settings)
        self._reconnect = Backoff(0.5, settings.reconnect_max_delay)
        # Broker URLs not yet tried in this round of connects (see _next_broker).
        self._brokers: list[pika.URLParameters] = []
        self._db_backoff = Backoff(0.5, settings.reconnect_max_delay)

    # -- lifecycle --------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Finish the batch in flight, then return from :meth:`run`. Only sets a flag, so it
        is safe from a signal handler; the I/O loop notices within 0.2 s."""
        self._stop_requested = True

    def run(self) -> RelayReport:
        name = threading.current_thread().name
        self._workers = [_DatabaseWorker(f"{name}-db{i}") for i in range(MAX_IN_FLIGHT)]
        try:
            while not (self._finished or self._stop_requested or self._past_deadline()):
                # Each connection runs its own I/O loop, and the LISTEN socket is watched by
                # the loop it was added to: drop it with the old loop, and _watch opens a
                # fresh one on the new loop. (Kept, it would sit on a loop that no longer
                # runs: no wake-ups, and notifications piling up unread.)
                self._close_listener()
                self._listener_retry_at = 0.0
                self._connection = pika.SelectConnection(
                    self._next_broker(),
                    on_open_callback=self.on_connection_open,
                    on_open_error_callback=self.on_connection_open_error,
                    on_close_callback=self.on_connection_closed,
                )
                try:
                    self._connection.ioloop.start()
                except Exception:
                    # A callback failed in a way nothing above handled (a channel closing under
                    # a publish, say). Never die for it: roll back, reconnect, go on.
                    logger.exception("relay: unexpected error; reconnecting")
                    self._abort_batches("unexpected error")
                    self._close_quietly()
                self._after_loop()
                if self._finished or self._stop_requested or self._past_deadline():
                    break
                # Another node of the list is tried at once; the backoff is for a whole round.
                wait = 0.1 if self._brokers else self._reconnect.next()
                logger.warning(
                    "relay: broker %s unavailable; reconnecting in %.1fs",
                    self.settings.broker_shown,
                    wait,
                )
                self._sleep(wait)
        finally:
            self.health.stopping()
            self._close_listener()
            self._probe.close()
            self._after_loop()
            for worker in self._workers:
                worker.close()
        self._count_left()
        return self.report

    def _after_loop(self) -> None:
        """A connection's loop ended: let the database workers finish what they were given
        (the outcomes of the batches in flight), and roll back a claim never published."""
        self._abort_batches("the connection's loop ended")
        for worker in self._workers:
            worker.drain()
            claimed, worker.claimed = worker.claimed, None
            worker.claiming = False
            worker.batch = None
            if claimed is not None and claimed.atomic is not None:
                worker.submit(functools.partial(self._roll_back, claimed.atomic))
                worker.drain()

    @staticmethod
    def _roll_back(atomic: Any) -> None:
        """Database worker: end a claim's transaction without a trace: its rows are due."""
        try:
            atomic.__exit__(RuntimeError, RuntimeError("not published"), None)
        except DatabaseError:
            logger.debug("rolling back an unpublished claim failed", exc_info=True)

    def _post(self, callback: Callable[[], None]) -> None:
        """From the database worker: run ``callback`` on the I/O loop. Lost when the loop has
        ended, which :meth:`_after_loop` accounts for."""
        connection = self._connection
        if connection is not None:
            try:
                connection.ioloop.add_callback_threadsafe(callback)
            except Exception:
                logger.debug("the I/O loop is gone; dropping a callback", exc_info=True)

    def _next_broker(self) -> pika.URLParameters:
        """The broker URL to try next: each connect takes the next one of a shuffled list, so
        a node that is down costs one attempt and the next connect goes elsewhere."""
        if not self._brokers:
            self._brokers = connection_parameters(self.settings, name="relay")
        return self._brokers.pop()

    def _close_quietly(self) -> None:
        connection, self._connection, self._channel = self._connection, None, None
        if connection is not None and connection.is_open:
            try:
                connection.close()
                connection.ioloop.start()  # runs until on_connection_closed stops it
            except Exception:
                logger.debug("closing a broken relay connection failed", exc_info=True)

    def _past_deadline(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def _sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while not self._stop_requested and time.monotonic() < end:
            self.health.heartbeat()  # waiting to reconnect is alive, not stuck
            time.sleep(min(0.2, end - time.monotonic()))

    def _count_left(self) -> None:
        counts = outbox_backlog(self.using)
        if counts is not None:
            (self.report.left_pending, self.report.left_retrying, self.report.left_failed) = counts

    def on_connection_open(self, connection: pika.SelectConnection) -> None:
        connection.add_on_connection_blocked_callback(self.on_connection_blocked)
        connection.add_on_connection_unblocked_callback(self.on_connection_unblocked)
        connection.channel(on_open_callback=self.on_channel_open)

    def on_connection_open_error(
        self, connection: pika.SelectConnection, error: BaseException | str
    ) -> None:
        logger.warning("relay: cannot connect to %s: %s", self.settings.broker_shown, error)
        self.health.set_broker(False)
        connection.ioloop.stop()

    def on_connection_closed(
        self, connection: pika.SelectConnection, reason: BaseException
    ) -> None:
        self._channel = None
        self.health.set_broker(False)
        self._set_blocked(False)
        self._abort_batches(f"connection closed: {reason}")
        self._cancel_timers(connection)
        if not (self._finished or self._stop_requested):
            logger.warning("relay: broker connection closed: %s", reason)
        connection.ioloop.stop()

    def on_channel_open(self, channel: pika.channel.Channel) -> None:
        self._channel = channel
        self._next_tag = 1
        channel.add_on_close_callback(self.on_channel_closed)
        channel.add_on_return_callback(self.on_return)
        channel.confirm_delivery(
            ack_nack_callback=self.on_delivery_confirmation, callback=self.on_confirm_mode
        )

    def on_confirm_mode(self, frame: Any) -> None:
        logger.info(
            "relay: publishing the outbox to %s with confirms (batch size %d%s)",
            self.settings.broker_shown,
            self.batch_size,
            ", LISTEN/NOTIFY wake-ups" if self.listen else ", polling",
        )
        self._reconnect.reset()
        self.health.set_broker(True)
        self._watch()
        self._schedule_tick(0)

    def on_channel_closed(self, channel: pika.channel.Channel, reason: BaseException) -> None:
        self._channel = None
        batches = self._batches
        if (
            batches
            and isinstance(reason, pika.exceptions.ChannelClosedByBroker)
            and reason.reply_code == NOT_FOUND
        ):
            # Publishing to an exchange that does not exist closes the channel. Charge the rows
            # bound for it; the rest of the batches are due again, untouched.
            match = _MISSING_EXCHANGE.search(reason.reply_text)
            missing = match.group(1) if match else None
            refused = 0
            for batch in batches:
                for row in batch.unconfirmed():
                    if row.exchange == missing:
                        batch.errors[row.pk] = f"exchange {missing!r} does not exist"
                        refused += 1
            if not refused:  # a 404 about something else: charge the row it came at
                for batch, row in self._refused_rows(reason):
                    batch.errors[row.pk] = f"the broker closed the channel: {reason}"[:2000]
                    refused += 1
            metrics.relay_failed("refused", refused)
            self._probe.forget(missing)
            self._finish_all()
        elif batches and isinstance(reason, pika.exceptions.ChannelClosedByBroker):
            # The broker refused a publish (403: no write permission, an internal exchange;
            # 406: a body over max_message_size, ...) and closed the channel at it. Sending
            # the same rows again at once would hit the same wall forever: rows before it
            # re-sent many times a second, rows after it never. So charge the row it was
            # about, with backoff, and keep what was confirmed: the rows after it go out in
            # the next batch, and OUTBOX_MAX_ATTEMPTS retires the culprit.
            refused_rows = self._refused_rows(reason)
            error = f"the broker closed the channel: {reason.reply_code} {reason.reply_text}"
            for batch, row in refused_rows:
                batch.errors[row.pk] = error[:2000]
            metrics.relay_failed("refused", len(refused_rows))
            self._finish_all()
        else:
            self._abort_batches(f"channel closed: {reason}")
        connection = self._connection
        if connection is not None and connection.is_open and not self._finished:
            logger.warning("relay: channel closed (%s); opening a new one", reason)
            self._cancel_timers(connection)
            connection.channel(on_open_callback=self.on_channel_open)

    def _refused_rows(
        self, reason: pika.exceptions.ChannelClosedByBroker
    ) -> list[tuple[_Batch, ClaimedRow]]:
        """The unconfirmed rows a channel close was caused by: those bound for the exchange
        the broker named, or with the body size it named; failing that, the first one
        published (the broker closes at the offending publish, so the culprit is the first
        row it did not confirm or the rows after it were never looked at)."""
        unconfirmed = [(batch, row) for batch in self._batches for row in batch.unconfirmed()]
        text = str(reason.reply_text)
        named = _NAMED_EXCHANGE.search(text)
        if named is not None:
            matching = [(b, row) for b, row in unconfirmed if row.exchange == named.group(1)]
            if matching:
                return matching
        size = _MESSAGE_SIZE.search(text)
        if size is not None:
            matching = [
                (b, row)
                for b, row in unconfirmed
                if len(row.body.encode("utf-8")) == int(size.group(1))
            ]
            if matching:
                return matching[:1]
        return unconfirmed[:1]

    def on_return(
        self,
        channel: pika.channel.Channel,
        method: Basic.Return,
        properties: BasicProperties,
        body: bytes,
    ) -> None:
        """An unroutable message (mandatory): the broker still acks it afterwards, so record
        why here and let the confirm settle it.

        A command (routing key matching ``REQUIRE_ROUTE``) that reaches no queue is an error:
        it is retried with backoff, then failed. Any other row is an event, and an event nobody
        subscribes to yet is normal in publish-subscribe: it is marked unrouted, not retried."""
        row_id = (properties.headers or {}).get(OUTBOX_ID_HEADER)
        if not isinstance(row_id, int):
            return
        batch = next((b for b in self._batches if b.holds(row_id)), None)
        if batch is None:
            return
        self.report.returned += 1
        metrics.relay_failed("returned")
        routing_key = method.routing_key or ""
        if not any(topic_matches(p, routing_key) for p in self.settings.require_route):
            batch.unrouted.add(row_id)  # its ack follows; _finish_batch keeps it from "sent"
            return
        batch.errors[row_id] = (
            f"unroutable: {method.reply_code} {method.reply_text} (exchange "
            f"{method.exchange!r}, routing key {method.routing_key!r}): no queue is bound for "
            f"it, and REQUIRE_ROUTE says it must reach one"
        )

    def on_connection_blocked(self, connection: pika.SelectConnection, frame: Any) -> None:
        """The broker stopped reading from this connection (a memory or disk alarm)."""
        if self._blocked:
            return
        self._set_blocked(True)
        logger.warning(
            "relay: the broker blocked the connection (%s); claiming no rows until it is "
            "unblocked, the batches in flight wait for their confirms",
            getattr(frame.method, "reason", "") or "no reason given",
        )
        for batch in self._batches:
            if batch.timer is not None:
                # Its confirms are held up by the block, not lost: no timeout while it lasts.
                connection.ioloop.remove_timeout(batch.timer)
                batch.timer = None

    def on_connection_unblocked(self, connection: pika.SelectConnection, frame: Any) -> None:
        if not self._blocked:
            return
        self._set_blocked(False)
        logger.info("relay: the broker unblocked the connection; resuming")
        for batch in self._batches:
            if batch.timer is None:
                self._start_confirm_timer(batch)
        self._schedule_tick(0)

    def _set_blocked(self, blocked: bool) -> None:
        if blocked != self._blocked:
            self._blocked = blocked
            metrics.relay_blocked(blocked)
            # A note, not a failure: the relay is fine, and restarting it would not help.
            self.health.note(
                "publish_blocked",
                "the broker blocks publishing (a resource alarm): outbox rows wait"
                if blocked
                else None,
            )

    def on_delivery_confirmation(self, frame: Any) -> None:
        method = frame.method
        acked = isinstance(method, Basic.Ack)
        tag = method.delivery_tag
        now = time.monotonic()
        for batch in list(self._batches):
            if not batch.rows or (not method.multiple and tag not in batch.rows):
                continue
            if method.multiple:
                # Tags are consecutive across batches: settle from the batch's lowest
                # unsettled one up to tag.
                tags = range(batch.lowest_unsettled, min(tag, max(batch.rows)) + 1)
                batch.lowest_unsettled = max(batch.lowest_unsettled, tags.stop)
            else:
                tags = range(tag, tag + 1)
            for settled in tags:
                row = batch.rows.get(settled)
                if row is None or settled in batch.settled:
                    continue
                batch.settled.add(settled)
                if acked:
                    batch.confirmed.add(row.pk)
                    metrics.relay_confirm_latency(now - batch.published_at)
                else:
                    batch.errors.setdefault(row.pk, "nacked by the broker")
                    self.report.nacked += 1
                    metrics.relay_failed("nacked")
            if len(batch.settled) >= len(batch.rows):
                self._finish_batch(batch)

    # -- timers -----------------------------------------------------------------------------

    def _schedule_tick(self, delay: float) -> None:
        """Claim again in ``delay`` seconds, unless a claim is already due sooner: a later
        wait must never push back a claim something asked for (a batch recorded, a row
        released, a NOTIFY)."""
        connection = self._connection
        if connection is None or not connection.is_open:
            return
        at = time.monotonic() + delay
        if self._tick_timer is not None:
            if self._tick_at <= at:
                return
            connection.ioloop.remove_timeout(self._tick_timer)
        self._tick_at = at
        self._tick_timer = connection.ioloop.call_later(delay, self._tick)

    def _watch(self) -> None:
        """Every 0.2 s: beat the heart, honour a stop request or the deadline, and look after
        LISTEN."""
        connection = self._connection
        if connection is None or not connection.is_open:
            return
        self.health.heartbeat()
        if self._stop_requested:
            self.health.stopping()
        if self._stop_requested or self._past_deadline():
            if self._blocked:
                self._leave_blocked(connection)
                return
            if not (self._batches or self._db_busy()):
                self._close(connection)
                return
        self._renew_leases()
        if self.listen and self._listener is None and time.monotonic() >= self._listener_retry_at:
            self._open_listener(connection)
        self._watch_timer = connection.ioloop.call_later(0.2, self._watch)

    def _cancel_timers(self, connection: pika.SelectConnection) -> None:
        for timer in (self._tick_timer, self._watch_timer):
            if timer is not None:
                connection.ioloop.remove_timeout(timer)
        self._tick_timer = self._watch_timer = None

    def _close(self, connection: pika.SelectConnection) -> None:
        self._finished = True
        self._cancel_timers(connection)
        if connection.is_open:
            connection.close()
        else:
            connection.ioloop.stop()

    def _leave_blocked(self, connection: pika.SelectConnection) -> None:
        """Stop while the broker blocks us, without waiting for the alarm to clear, which may
        take long. A batch in flight cannot be confirmed until then: it rolls back (its rows go
        again later; any the broker did take become duplicates that consumers absorb). The
        closing handshake cannot complete either (the broker reads nothing, so no Close-Ok
        would come), so the loop just ends and the socket goes with the connection."""
        self._abort_batches("stopping while the broker blocks the connection")
        self._set_blocked(False)
        self._finished = True
        self._cancel_timers(connection)
        connection.ioloop.stop()

    # -- LISTEN/NOTIFY -------------------------------------------------------------------------

    def _open_listener(self, connection: pika.SelectConnection) -> None:
        try:
            self._listener = _Listener(self.using)
        except ImportError as exc:
            # Not going to change while this process runs: say it once and poll from now on.
            self.listen = False
            logger.warning(
                "relay: cannot LISTEN for new outbox rows (%s): psycopg 3 is needed for it; "
                'pip install "reliable-messaging[postgres]". Polling every %ss meanwhile',
                exc,
                self.settings.relay_poll_interval,
            )
            return
        except Exception as exc:  # noqa: BLE001 - any failure: poll and try again later
            self._listener_retry_at = time.monotonic() + 5
            logger.warning(
                "relay: cannot LISTEN for new outbox rows (%s); polling every %ss",
                exc,
                self.settings.relay_poll_interval,
            )
            return
        connection.ioloop.add_handler(
            self._listener.fileno(), self._on_notify, connection.ioloop.READ
        )

    def _on_notify(self, fd: int, events: int) -> None:
        listener = self._listener
        if listener is None:
            return
        try:
            listener.drain()
        except Exception as exc:  # noqa: BLE001 - the database went away: poll meanwhile
            logger.warning("relay: LISTEN connection lost (%s); polling until it is back", exc)
            self._close_listener()
            self._listener_retry_at = time.monotonic() + 1
            return
        if len(self._batches) < MAX_IN_FLIGHT:
            self._schedule_tick(0)
        # else: the next batch to finish schedules a claim

    def _close_listener(self) -> None:
        listener, self._listener = self._listener, None
        if listener is None:
            return
        connection = self._connection
        if connection is not None:
            try:
                connection.ioloop.remove_handler(listener.fileno())
            except Exception:
                logger.debug("removing the LISTEN handler failed", exc_info=True)
        listener.close()

    # -- batches -----------------------------------------------------------------------------

    def _db_busy(self) -> bool:
        """A claim is under way or a batch is in flight or being recorded: each ends in a
        callback on the I/O loop that schedules the next claim."""
        return any(w.claiming or w.batch is not None for w in self._workers)

    def _free_worker(self) -> _DatabaseWorker | None:
        # A worker still finishing a job (recording a batch) takes the claim after it.
        for worker in self._workers:
            if not (worker.claiming or worker.batch is not None):
                return worker
        return None

    def _tick(self) -> None:
        """I/O loop: give the next claim to a free database worker, unless a claim is under
        way or every worker holds a batch in flight."""
        self._tick_timer = None
        connection, channel = self._connection, self._channel
        if connection is None or channel is None or not channel.is_open:
            return
        if any(worker.claiming for worker in self._workers):
            # Its answer schedules the next claim; it may have looked before what this tick
            # is for (a batch recorded, a row released, a NOTIFY), so it looks again.
            self._look_again = True
            return
        worker = self._free_worker()
        if worker is None:
            return  # the next batch to be recorded schedules a claim
        if self._stop_requested or self._past_deadline():
            return  # _watch closes the connection
        if self._blocked:
            return  # on_connection_unblocked schedules the next tick
        sweep = time.monotonic() >= self._next_sweep
        if sweep:
            self._next_sweep = float("inf")  # the sweep sets when the next one is due
        worker.claiming = True
        self._look_again = False
        worker.submit(functools.partial(self._claim_job, worker, sweep))

    def _claim_job(self, worker: _DatabaseWorker, sweep: bool) -> None:
        """Database worker: claim a batch and hand it to the I/O loop."""
        try:
            if sweep:
                try:
                    self._sweep()
                finally:
                    if self._next_sweep == float("inf"):  # it failed: try again in a while
                        self._next_sweep = time.monotonic() + SWEEP_INTERVAL
            for attempt in range(1, MOVED_TRIES + 1):
                try:
                    claim = self._claim()
                    break
                except DatabaseError as exc:
                    # Another relay sent a row this claim's snapshot still saw as due: the
                    # claim rolled back, and its next snapshot will not see the row.
                    if not row_moved(exc) or attempt == MOVED_TRIES:
                        raise
                    logger.debug("relay: a row was sent by another relay meanwhile; claiming again")
            if claim.atomic is None and not claim.parked:
                claim.wait = self._idle_wait()
        except DatabaseError as exc:
            connections[self.using].close()  # a fresh connection on the next try
            claim = _Claim(rows=[], error=exc)
        except Exception as exc:  # a bug must not leave the relay waiting for this claim
            logger.exception("relay: unexpected error while claiming rows")
            claim = _Claim(rows=[], error=DatabaseError(f"unexpected error: {exc!r}"))
        worker.claimed = claim
        self._post(functools.partial(self._on_claimed, worker))

    def _on_claimed(self, worker: _DatabaseWorker) -> None:
        """I/O loop: publish what the claim found, and decide when to claim again."""
        claim, worker.claimed = worker.claimed, None
        worker.claiming = False
        connection, channel = self._connection, self._channel
        if claim is None:
            return
        if connection is None or not connection.is_open:
            if claim.atomic is not None:
                worker.submit(functools.partial(self._roll_back, claim.atomic))
            return
        if claim.error is not None:
            self.health.set_database(False, str(claim.error))
            wait = self._db_backoff.next()
            logger.warning(
                "relay: database unavailable (%s); rows stay pending, retrying in %.1fs",
                claim.error,
                wait,
            )
            self._schedule_tick(wait)
            return
        self._db_backoff.reset()
        self.health.set_database(True)
        if claim.atomic is not None:
            if channel is None or not channel.is_open or self._blocked:
                # The channel went, or the broker blocked the connection while the claim was
                # under way: the rows are due again at once. The new channel's confirm mode,
                # or the unblock, schedules a claim.
                worker.submit(functools.partial(self._roll_back, claim.atomic))
                return
            self._publish(channel, worker, claim)
        if claim.rows or claim.parked or self._look_again:
            # More may be due at once: claim the next batch while this one's confirms come
            # back (a batch being recorded schedules a claim too).
            self._schedule_tick(0)
            return
        if self._batches or self._db_busy():
            return  # a batch in flight schedules a claim when it is recorded
        if self._tick_timer is not None and self._tick_at <= time.monotonic():
            return  # a claim is due already (asked for after this one looked)
        if self.once:
            # Nothing is due now: rows waiting out a backoff after a failure are left for a
            # later run (and reported), not waited for.
            logger.info("relay: nothing left to send")
            self._close(connection)
            return
        self._schedule_tick(claim.wait)

    def _sweep(self) -> None:
        """Release parked rows nothing holds back any more (see :func:`release_parked`): a
        slice of them per claim, so that many parked rows never hold a claim up; the next
        slice a second later, and a new pass SWEEP_INTERVAL after the last one ended."""
        released, self._sweep_after = release_parked(self.using, after=self._sweep_after or 0)
        self._next_sweep = time.monotonic() + (1.0 if self._sweep_after else SWEEP_INTERVAL)
        if released:
            logger.info(
                "relay: %d parked row(s) released: the row before them is no longer unsent",
                released,
            )

    def _idle_wait(self) -> float:
        """Database worker: how long the relay may sleep before the next claim."""
        poll = self.settings.relay_poll_interval
        if self.listen and self._listener is not None:
            poll = max(poll, 5.0)  # NOTIFY wakes us; polling only catches backoffs and misses
        # The next row waiting out a backoff (or a lease), by the database's clock (the one the
        # claim compares with). Parked rows (NULL) are not due at any time: they are released
        # when the row before them is sent.
        due_in = (
            OutboxMessage.objects.using(self.using)
            .filter(status=OutboxStatus.PENDING, next_attempt_at__gt=Now())
            .order_by("next_attempt_at")
            .annotate(due_in=F("next_attempt_at") - Now())
            .values_list("due_in", flat=True)
            .first()
        )
        if due_in is not None:
            poll = min(poll, max(0.0, due_in.total_seconds()))
        return min(poll, max(0.0, self._next_sweep - time.monotonic()))

    def _select(self) -> list[tuple[Any, ...]]:
        return list(
            claimable(self.using)
            .select_for_update(skip_locked=True)
            .values_list(*CLAIMED_FIELDS, "behind")[: self.batch_size]
        )

    def _claim(self) -> _Claim:
        """Database worker: lock up to a batch of due rows in a transaction left open for the
        batch (committed when it is recorded). Rows behind an earlier unsent row of their key
        are parked first, in a transaction of their own, so the batch's transaction never
        holds a lock a relay recording its batch would wait for."""
        outbox = OutboxMessage.objects.using(self.using)
        atomic = transaction.atomic(using=self.using)
        atomic.__enter__()
        parked: list[int] = []
        try:
            found = self._select()
            behind = {values[0]: values[_BEHIND] for values in found if values[_BEHIND] is not None}
            if behind:
                # A row is parked only while its key's first unsent row (the one holding it
                # back) is locked here: whoever sends that row locks it first, so it cannot be
                # sent, and its release of the next row run, before this park is committed.
                # Rows behind a row in flight elsewhere are skipped for now.
                locked = {values[0] for values in found}
                locked |= set(
                    outbox.filter(
                        # Still unsent now (this statement's snapshot is newer than the
                        # claim's): one sent since is not holding anything back any more.
                        pk__in=set(behind.values()) - locked,
                        status__in=[OutboxStatus.PENDING, OutboxStatus.FAILED],
                    )
                    .select_for_update(skip_locked=True)
                    .values_list("pk", flat=True)
                )
                parked = [pk for pk, blocker in behind.items() if blocker in locked]
                if parked:
                    outbox.filter(pk__in=parked, status=OutboxStatus.PENDING).update(
                        next_attempt_at=None
                    )
                atomic.__exit__(None, None, None)
                atomic = transaction.atomic(using=self.using)
                atomic.__enter__()
                found = self._select()
            rows = [ClaimedRow(*values[:_BEHIND]) for values in found if values[_BEHIND] is None]
        except BaseException as exc:
            atomic.__exit__(type(exc), exc, exc.__traceback__)
            raise
        if not rows:
            atomic.__exit__(None, None, None)
            return _Claim(rows=[], parked=len(parked))
        return _Claim(rows=rows, atomic=atomic, parked=len(parked))

    def _publish(
        self, channel: pika.channel.Channel, worker: _DatabaseWorker, claim: _Claim
    ) -> None:
        """I/O loop: publish a claimed batch; its confirms settle it later."""
        rows = claim.rows
        metrics.relay_claimed(len(rows))
        now = time.monotonic()
        batch = _Batch(
            rows={},
            claimed=rows,
            pks={row.pk for row in rows},
            worker=worker,
            atomic=claim.atomic,
            lowest_unsettled=self._next_tag,
            published_at=now,
        )
        self._batches.append(batch)
        worker.batch = batch
        for row in rows:
            if not self._probe.exists(row.exchange):
                batch.unpublished.append(row)
                batch.errors[row.pk] = f"exchange {row.exchange!r} does not exist"
                continue
            try:
                channel.basic_publish(
                    exchange=row.exchange,
                    routing_key=row.routing_key,
                    body=row.body.encode("utf-8"),
                    properties=message_properties(row),
                    mandatory=True,
                )
            except (
                pika.exceptions.UnsupportedAMQPFieldException,
                pika.exceptions.ShortStringTooLong,
                struct.error,
                TypeError,
                ValueError,
            ) as exc:
                # Encoding fails before anything is written, so no delivery tag is used.
                batch.unpublished.append(row)
                batch.errors[row.pk] = f"cannot encode the message: {exc!r}"[:2000]
                continue
            batch.rows[self._next_tag] = row
            self._next_tag += 1
        # A few writes for the batch's frames instead of three a message (see write_coalescing).
        coalesce_writes(self._connection)
        if batch.unpublished:
            metrics.relay_failed("refused", len(batch.unpublished))
        if not batch.rows:
            self._finish_batch(batch)
            return
        self._start_confirm_timer(batch)

    def _start_confirm_timer(self, batch: _Batch) -> None:
        assert self._connection is not None
        batch.timer = self._connection.ioloop.call_later(
            self.settings.relay_confirm_timeout, lambda: self._on_confirm_timeout(batch)
        )

    def _on_confirm_timeout(self, batch: _Batch) -> None:
        if batch not in self._batches:
            return
        batch.timer = None
        timed_out = 0
        for row in batch.rows.values():
            if row.pk not in batch.confirmed and row.pk not in batch.errors:
                batch.errors[row.pk] = (
                    f"no confirm from the broker within {self.settings.relay_confirm_timeout}s"
                )
                timed_out += 1
        self.report.timed_out += timed_out
        metrics.relay_failed("timeout", timed_out)
        self._finish_batch(batch)
        # A channel that stopped confirming is not to be trusted: start afresh (the batches
        # still in flight are settled as far as they got, the rest due again).
        connection = self._connection
        if connection is not None and connection.is_open:
            connection.close(reply_text="confirm timeout")

    def _renew_leases(self) -> None:
        """I/O loop: a batch whose confirms take longer than HOLD_LIMIT (a slow or blocked
        broker) trades its open transaction for a lease, so that no snapshot and no row lock
        is held long (they would hold back vacuum on the outbox); a lease is renewed at half
        its length for as long as the batch is in flight."""
        now = time.monotonic()
        half = self.lease.total_seconds() / 2
        for batch in self._batches:
            if batch.leased_at == 0.0:
                due = now - batch.published_at >= HOLD_LIMIT  # still holds its transaction
            else:
                due = now - batch.leased_at >= half
            if due:
                batch.leased_at = now
                batch.worker.submit(functools.partial(self._lease, batch))

    def _lease(self, batch: _Batch) -> None:
        """Database worker: lease the batch's rows (commit its transaction if still open)."""
        try:
            if batch.atomic is None:
                atomic = transaction.atomic(using=self.using)
                atomic.__enter__()
            else:
                atomic, batch.atomic = batch.atomic, None
            try:
                OutboxMessage.objects.using(self.using).filter(
                    pk__in=any_id_of(self.using, (row.pk for row in batch.claimed)),
                    status=OutboxStatus.PENDING,
                ).update(next_attempt_at=Now() + Value(self.lease, output_field=DurationField()))
            except BaseException as exc:
                atomic.__exit__(type(exc), exc, exc.__traceback__)
                raise
            atomic.__exit__(None, None, None)
        except DatabaseError as exc:
            connections[self.using].close()
            logger.warning(
                "relay: cannot lease the rows of a batch in flight (%s); another relay may send "
                "them again, which consumers absorb",
                exc,
            )

    def _finish_all(self) -> None:
        for batch in list(self._batches):
            self._finish_batch(batch)

    def _finish_batch(self, batch: _Batch) -> None:
        """Record the batch's outcome in one short transaction."""
        if batch not in self._batches:
            return
        self._batches.remove(batch)
        if batch.timer is not None and self._connection is not None:
            self._connection.ioloop.remove_timeout(batch.timer)
            batch.timer = None
        batch.worker.submit(functools.partial(self._settle_job, batch))

    def _settle_job(self, batch: _Batch, then_claim: bool = True) -> None:
        """Database worker: record a finished batch, then let the I/O loop claim again."""
        recorded = self._settle(batch)
        if recorded:
            self.report.batches += 1
            if self.on_batch is not None:
                self.on_batch(self.report)
        if then_claim:
            self._post(functools.partial(self._after_settle, batch, recorded))

    def _after_settle(self, batch: _Batch, recorded: bool) -> None:
        if batch.worker.batch is batch:
            batch.worker.batch = None
        if recorded:
            self._schedule_tick(0)
        else:
            self._schedule_tick(self._db_backoff.next())

    def _settle(self, batch: _Batch) -> bool:
        """Mark the confirmed rows sent (or unrouted), charge the failed ones, and make the
        rest due again at once (in flight when a channel died: the broker may have them, which
        consumers absorb). Releases the next row of each key sent. Commits the claim's
        transaction, or a new one when the rows were leased. False when the database could not
        record it: the rows stay pending and go again, at once or when their lease runs out."""
        sent = [pk for pk in batch.confirmed if pk not in batch.errors and pk not in batch.unrouted]
        unrouted = [
            row
            for row in batch.rows.values()
            if row.pk in batch.unrouted and row.pk in batch.confirmed and row.pk not in batch.errors
        ]
        done = set(sent) | {row.pk for row in unrouted}
        again = [
            row.pk for row in batch.claimed if row.pk not in done and row.pk not in batch.errors
        ]
        keys = {
            row.ordering_key
            for row in batch.claimed
            if row.pk in done and row.ordering_key is not None
        }
        atomic, batch.atomic = batch.atomic, None
        leased = atomic is None
        for attempt in range(1, MOVED_TRIES + 1):
            try:
                self._record(batch, atomic, leased, sent, unrouted, again, keys)
                break
            except Exception as exc:  # noqa: BLE001 - whatever failed, the relay goes on
                if row_moved(exc) and attempt < MOVED_TRIES:
                    # A leased row that another relay sent meanwhile: rolled back, recorded
                    # again in a transaction of its own (the rows are not locked any more).
                    atomic, leased = None, True
                    continue
                # The rows were published but cannot be marked: they stay pending and go
                # again (rolled back: at once; leased: when the lease runs out), which
                # consumers absorb by message_id.
                logger.warning(
                    "relay: cannot record a batch's confirms (%s); its %d row(s) stay "
                    "pending and will be sent again",
                    exc,
                    len(batch.claimed),
                )
                self.health.set_database(False, str(exc))
                if isinstance(exc, DatabaseError):
                    connections[self.using].close()
                return False
        self.report.sent += len(sent)
        self.report.unrouted += len(unrouted)
        if unrouted:
            # One line per batch, not per row: a busy service may publish many events nobody
            # subscribes to yet, and that is normal.
            logger.info(
                "relay: %d event(s) reached no queue (nothing subscribes to their routing key "
                "yet), marked unrouted and not retried: %s",
                len(unrouted),
                ", ".join(f"message_id={r.message_id} ({r.routing_key})" for r in unrouted[:10])
                + (", ..." if len(unrouted) > 10 else ""),
            )
        metrics.relay_published(len(sent))
        if logger.isEnabledFor(logging.DEBUG):
            for pk in sent:
                logger.debug("relay: sent outbox row %s", pk)
        return True

    def _record(
        self,
        batch: _Batch,
        atomic: Any,
        leased: bool,
        sent: list[int],
        unrouted: list[ClaimedRow],
        again: list[int],
        keys: set[str],
    ) -> None:
        """Write a batch's outcome in the claim's transaction ``atomic`` (None: a new one)."""
        if atomic is None:
            atomic = transaction.atomic(using=self.using)
            atomic.__enter__()
        try:
            # Every statement names the unsent statuses, so that PostgreSQL looks for the rows
            # in the unsent partition only (partitions.py); marking a row sent moves it to the
            # sent side.
            outbox = OutboxMessage.objects.using(self.using).filter(status__in=UNSENT)
            if sent:
                outbox.filter(pk__in=any_id_of(self.using, sent)).update(
                    status=OutboxStatus.SENT, sent_at=Now(), last_error=""
                )
            if unrouted:
                outbox.filter(pk__in=any_id_of(self.using, (row.pk for row in unrouted))).update(
                    status=OutboxStatus.UNROUTED,
                    sent_at=Now(),
                    last_error="no queue was bound for its routing key when it was sent",
                )
            for row in batch.claimed:
                error = batch.errors.get(row.pk)
                if error is not None:
                    self._record_failure(row, error)
            if again and leased:
                outbox.filter(
                    pk__in=any_id_of(self.using, again), status=OutboxStatus.PENDING
                ).update(next_attempt_at=Now())
            release_next_of_keys(self.using, keys)
        except BaseException as exc:
            atomic.__exit__(type(exc), exc, exc.__traceback__)
            raise
        atomic.__exit__(None, None, None)

    def _record_failure(self, row: ClaimedRow, error: str) -> None:
        attempts = row.attempts + 1
        failed = attempts >= self.settings.outbox_max_attempts
        if failed:
            logger.error(
                "relay: message_id=%s failed %d times, marked failed: %s",
                row.message_id,
                attempts,
                error,
            )
        else:
            logger.warning(
                "relay: message_id=%s not sent (attempt %d): %s", row.message_id, attempts, error
            )
        # Still unsent: a row another relay sent meanwhile (its lease ran out) stays sent.
        OutboxMessage.objects.using(self.using).filter(pk=row.pk, status__in=UNSENT).update(
            attempts=attempts,
            last_error=error[:2000],
            # From the database's clock, which the claim compares it with.
            next_attempt_at=Now() + Value(resend_backoff(attempts), output_field=DurationField()),
            status=OutboxStatus.FAILED if failed else OutboxStatus.PENDING,
        )

    def _abort_batches(self, why: str) -> None:
        """The connection or channel died with batches in flight: what was confirmed is marked
        sent, the rest is due again (the broker may have it: consumers absorb duplicates)."""
        if not self._batches:
            return
        rows = sum(len(batch.claimed) for batch in self._batches)
        for batch in list(self._batches):
            self._batches.remove(batch)
            if batch.timer is not None and self._connection is not None:
                try:
                    self._connection.ioloop.remove_timeout(batch.timer)
                except Exception:
                    logger.debug("removing the confirm timer failed", exc_info=True)
            batch.worker.submit(functools.partial(self._settle_job, batch, then_claim=False))
        logger.warning(
            "relay: %d row(s) in flight when %s; the unconfirmed ones are due again", rows, why
        )


def run_lanes(relays: list[OutboxRelay]) -> RelayReport:
    """Run the first relay on this thread (signals arrive here) and the others on their own
    threads; rows are shared out by ``SKIP LOCKED``, per-key order by the claim rule."""
    reports: list[RelayReport] = []

    def lane(relay: OutboxRelay) -> None:
        try:
            reports.append(relay.run())
        finally:
            connections.close_all()  # this thread's connections

    threads = [threading.Thread(target=lane, args=(r,), name="relay-lane") for r in relays[1:]]
    for thread in threads:
        thread.start()
    main = relays[0].run()
    if not relays[0].once:
        # The main lane stops only when told to: the others follow. (With --once each lane
        # stops by itself when it finds nothing due.)
        for relay in relays[1:]:
            relay.request_stop()
    for thread in threads:
        thread.join()
    total = RelayReport()
    for report in [main, *reports]:
        total.sent += report.sent
        total.nacked += report.nacked
        total.returned += report.returned
        total.unrouted += report.unrouted
        total.timed_out += report.timed_out
        total.batches += report.batches
    counts = outbox_backlog(relays[0].using)
    if counts is not None:
        total.left_pending, total.left_retrying, total.left_failed = counts
    return total


class RelayProgress:
    """Logs one INFO line every ``interval`` seconds while relays run: rows sent so far, the
    rate since the last line, and rows pending in the outbox. Quiet while there is nothing to
    say (nothing sent, nothing pending), so an idle relay does not fill the log.

    Runs on a thread of its own with its own database connection (closed when it stops); the
    relays' counters are only read, never written, from here.
    """

    def __init__(self, relays: list[OutboxRelay], interval: float) -> None:
        self.relays = relays
        self.interval = interval
        self.using = relays[0].using
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rm-relay-progress", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        last_sent, last_time = 0, time.monotonic()
        try:
            while not self._stop.wait(self.interval):
                sent, now = sum(r.report.sent for r in self.relays), time.monotonic()
                pending = self._pending()
                if sent != last_sent or pending != 0:
                    announce(
                        logger,
                        "relay: %d sent so far, %.1f/s over the last %.0fs, %s pending",
                        sent,
                        (sent - last_sent) / max(now - last_time, 1e-9),
                        now - last_time,
                        "an unknown number of rows (database unavailable)"
                        if pending is None
                        else pending,
                    )
                last_sent, last_time = sent, now
        finally:
            connections.close_all()  # this thread's connections

    def _pending(self) -> int | None:
        try:
            return OutboxMessage.objects.using(self.using).pending().count()
        except DatabaseError:
            connections[self.using].close()
            return None
