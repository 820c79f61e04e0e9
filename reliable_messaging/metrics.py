"""Prometheus metrics and process health.

Three kinds of figures, exported from three places:

- **Process counters** (``prometheus_client``'s default ``REGISTRY``), counted by the process
  that does the work and served on ``--metrics-port`` by :mod:`.ops_http`. The names are stable:

  ====================================================  ===========================================
  ``reliable_messaging_consumer_received_total``        deliveries received {consumer}
  ``reliable_messaging_consumer_redelivered_total``     of which flagged redelivered {consumer}
  ``reliable_messaging_consumer_messages_total``        handled deliveries {consumer, outcome}:
                                                        processed, duplicate, retried,
                                                        dead_lettered, released, parked,
                                                        deferred (another consumer holds the
                                                        Redis lease)
  ``reliable_messaging_handler_duration_seconds``       histogram of handler run time {consumer}
  ``reliable_messaging_handler_timeouts_total``         handler calls interrupted at their time
                                                        limit {consumer}
  ``reliable_messaging_consumer_blocked``               1 while the broker blocks the consumer's
                                                        publishing connection (retry copies
                                                        wait; acks go on)
  ``reliable_messaging_consumer_queues_unavailable``    queues the consumer cannot consume now
                                                        (their node down); it consumes the rest
  ``reliable_messaging_dedup_cache_total``              Redis fast-path lookups {consumer, result}:
                                                        hit, miss, error, lease_busy
  ``reliable_messaging_relay_claimed_total``            outbox rows claimed by the relay
  ``reliable_messaging_relay_published_total``          rows confirmed by the broker, marked sent
  ``reliable_messaging_relay_failed_total``             failed sends {kind}: returned (unroutable),
                                                        nacked, timeout (no confirm), refused
                                                        (missing exchange, unencodable headers)
  ``reliable_messaging_relay_confirm_latency_seconds``  histogram, publish to broker confirm
  ``reliable_messaging_relay_blocked``                  relay connections the broker blocks now
                                                        (0 or 1 per relay lane)
  ``reliable_messaging_relay_blocks_total``             times the broker blocked a relay connection
  ====================================================  ===========================================

- **Health** of one process, ``reliable_messaging_healthy`` (1 or 0, :class:`HealthCollector`),
  served next to the process counters by :mod:`.ops_http`, which also answers ``/healthz``
  from what the process recorded in its :class:`.liveness.HealthState`.

- **Database gauges**, read from the database at each scrape by :class:`DatabaseCollector`.
  They describe the whole system, not one process, so exactly one place exports them: the
  ``metrics/`` view of ``reliable_messaging.urls`` in the web process (aggregate them with
  ``max``, never ``sum``, when several web instances are scraped):

  =========================================================  ======================================
  ``reliable_messaging_database_up``                         1 if the last scrape read the database
  ``reliable_messaging_outbox_pending_messages``             outbox rows not sent yet
  ``reliable_messaging_outbox_oldest_pending_age_seconds``   age of the oldest of them (0 if none)
  ``reliable_messaging_outbox_failed_messages``              rows given up on (``failed``)
  ``reliable_messaging_dead_letters``                        dead letters {status, consumer, reason}
  ``reliable_messaging_inbox_messages``                      inbox rows (an estimate on PostgreSQL)
  =========================================================  ======================================

- **Queue gauges**, read from the broker at scrape time by :class:`BrokerCollector` with AMQP
  passive declares (no plugin needed), for the queues of every registered consumer (an ordered
  consumer's partitions) and the retry delay queues. Also served by the ``metrics/`` view:

  ===========================================  ====================================================
  ``reliable_messaging_broker_up``             1 if the last read reached the broker
  ``reliable_messaging_queue_exists``          1 if declared, 0 if not {queue, consumer, kind};
                                               kind is consumer, delay or leftover (a queue an
                                               earlier shape of the consumer left behind)
  ``reliable_messaging_queue_messages_ready``  messages waiting in it {queue, consumer, kind}
  ``reliable_messaging_queue_consumers``       consumers attached to it {queue, consumer, kind}
  ===========================================  ====================================================

The helper functions below are what the consumer and the relay call; they check their label
values, because a typo'd label would silently start a new time series nobody alerts on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from django.db import DatabaseError, connections, router
from django.db.models import Count, DurationField, ExpressionWrapper, F, Model
from django.db.models.functions import Now
from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from . import partitions

# Re-exported: the process's health used to live here, and the relay and consume commands
# (and users' code) import it from here. liveness is standard library only.
from .liveness import HealthCheck as HealthCheck
from .liveness import HealthGroup as HealthGroup
from .liveness import HealthState as HealthState

if TYPE_CHECKING:
    from .registry import ConsumerSpec

logger = logging.getLogger(__name__)

CONSUMER_OUTCOMES = frozenset(
    {"processed", "duplicate", "retried", "dead_lettered", "released", "parked", "deferred"}
)
DEDUP_RESULTS = frozenset({"hit", "miss", "error", "lease_busy"})
RELAY_FAILURE_KINDS = ("returned", "nacked", "timeout", "refused")

_RECEIVED = Counter(
    "reliable_messaging_consumer_received",
    "Deliveries received by a consumer.",
    ["consumer"],
)
_REDELIVERED = Counter(
    "reliable_messaging_consumer_redelivered",
    "Deliveries received with the broker's redelivered flag set.",
    ["consumer"],
)
_MESSAGES = Counter(
    "reliable_messaging_consumer_messages",
    "Deliveries handled by a consumer, by outcome.",
    ["consumer", "outcome"],
)
_HANDLER_DURATION = Histogram(
    "reliable_messaging_handler_duration_seconds",
    "Time a consumer's handler ran (its transaction included).",
    ["consumer"],
)
_HANDLER_TIMEOUTS = Counter(
    "reliable_messaging_handler_timeouts",
    "Handler calls interrupted at their time limit (HANDLER_TIMEOUT or the consumer's timeout).",
    ["consumer"],
)
_DEDUP_CACHE = Counter(
    "reliable_messaging_dedup_cache",
    "Lookups in the Redis duplicate fast path, by result.",
    ["consumer", "result"],
)
_RELAY_CLAIMED = Counter(
    "reliable_messaging_relay_claimed",
    "Outbox rows claimed by the relay for publishing.",
)
_RELAY_PUBLISHED = Counter(
    "reliable_messaging_relay_published",
    "Outbox rows confirmed by the broker and marked sent.",
)
_RELAY_FAILED = Counter(
    "reliable_messaging_relay_failed",
    "Outbox rows whose send failed, by kind (returned, nacked, timeout, refused).",
    ["kind"],
)
_RELAY_CONFIRM_LATENCY = Histogram(
    "reliable_messaging_relay_confirm_latency_seconds",
    "Time from publishing an outbox row to the broker's confirm of it.",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)
_CONSUMER_BLOCKED = Gauge(
    "reliable_messaging_consumer_blocked",
    "1 while the broker blocks the consumer's publishing connection (resource alarm): retry "
    "copies wait, acks go on.",
)
_CONSUMER_UNAVAILABLE = Gauge(
    "reliable_messaging_consumer_queues_unavailable",
    "Queues the consumer cannot declare or consume now (their node down, say); it consumes "
    "the others and tries these again.",
)
_RELAY_BLOCKED = Gauge(
    "reliable_messaging_relay_blocked",
    "Relay connections the broker is blocking now (resource alarm); 0 or 1 per relay lane.",
)
_RELAY_BLOCKS = Counter(
    "reliable_messaging_relay_blocks",
    "Times the broker blocked a relay connection.",
)

# Series that exist from the start, so rate() and the dashboard see zeros, not gaps.
for _kind in RELAY_FAILURE_KINDS:
    _RELAY_FAILED.labels(_kind)


def _check(value: str, allowed: Iterable[str], what: str) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {what} {value!r}; expected one of {sorted(allowed)}")


# -- the consumer --------------------------------------------------------------------------------


def consumers_started(consumers: Iterable[str]) -> None:
    """Create every consumer series at zero when a consumer process starts, so ``increase()``
    and ``rate()`` see the first dead letter or redelivery instead of a series appearing."""
    for consumer in consumers:
        _RECEIVED.labels(consumer)
        _REDELIVERED.labels(consumer)
        for outcome in CONSUMER_OUTCOMES:
            _MESSAGES.labels(consumer, outcome)


def consumer_received(consumer: str, redelivered: bool = False) -> None:
    """A delivery reached ``consumer``; ``redelivered`` is the broker's flag."""
    _RECEIVED.labels(consumer).inc()
    if redelivered:
        _REDELIVERED.labels(consumer).inc()


def consumer_outcome(consumer: str, outcome: str, duration: float | None = None) -> None:
    """``consumer`` finished a delivery with ``outcome``; ``duration`` is the handler's run
    time in seconds, when a handler ran."""
    _check(outcome, CONSUMER_OUTCOMES, "consumer outcome")
    _MESSAGES.labels(consumer, outcome).inc()
    if duration is not None:
        _HANDLER_DURATION.labels(consumer).observe(duration)


def handler_timeout(consumer: str) -> None:
    _HANDLER_TIMEOUTS.labels(consumer).inc()


def dedup_cache(consumer: str, result: str) -> None:
    """One lookup in the duplicate fast path: hit, miss, error or lease_busy."""
    _check(result, DEDUP_RESULTS, "dedup cache result")
    _DEDUP_CACHE.labels(consumer, result).inc()


def consumer_blocked(blocked: bool) -> None:
    _CONSUMER_BLOCKED.set(1 if blocked else 0)


def consumer_queues_unavailable(count: int) -> None:
    _CONSUMER_UNAVAILABLE.set(count)


# -- the relay -----------------------------------------------------------------------------------


def relay_claimed(count: int) -> None:
    _RELAY_CLAIMED.inc(count)


def relay_published(count: int = 1) -> None:
    """``count`` rows were confirmed by the broker and their sent mark committed."""
    _RELAY_PUBLISHED.inc(count)


def relay_confirm_latency(seconds: float) -> None:
    _RELAY_CONFIRM_LATENCY.observe(seconds)


def relay_failed(kind: str, count: int = 1) -> None:
    """``count`` rows were not sent: returned, nacked, timeout or refused."""
    _check(kind, RELAY_FAILURE_KINDS, "relay failure kind")
    _RELAY_FAILED.labels(kind).inc(count)


def relay_blocked(blocked: bool) -> None:
    """A relay connection was blocked (True) or is no longer blocked (False). Each True must
    be followed by exactly one False (unblocked, or the connection closed)."""
    if blocked:
        _RELAY_BLOCKED.inc()
        _RELAY_BLOCKS.inc()
    else:
        _RELAY_BLOCKED.dec()


# -- the health gauge -----------------------------------------------------------------------------


class HealthCollector:
    """Exports ``reliable_messaging_healthy`` (1 or 0) for one process's health."""

    def __init__(self, health: HealthCheck) -> None:
        self.health = health

    def collect(self) -> Iterator[Metric]:
        ok, _ = self.health.check()
        yield GaugeMetricFamily(
            "reliable_messaging_healthy",
            "1 when this process's health check passes (as /healthz), else 0.",
            value=1 if ok else 0,
        )


# -- the database --------------------------------------------------------------------------------


def outbox_lag(using: str) -> float:
    """Seconds the oldest pending outbox row has waited; 0 when none is pending.

    "Oldest" is the lowest id, found on the relay's partial index of pending rows: ids grow
    with time, and ordering by ``created_at`` would sort the whole backlog at every call.
    """
    from .models import OutboxMessage

    # The age by the database's clock, which also stamped the row: a web process whose clock
    # runs ahead or behind must not report a lag that is not there.
    age = (
        OutboxMessage.objects.using(using)
        .pending()
        .order_by("id")
        .annotate(age=ExpressionWrapper(Now() - F("created_at"), output_field=DurationField()))
        .values_list("age", flat=True)
        .first()
    )
    return 0.0 if age is None else max(0.0, age.total_seconds())


class DatabaseCollector:
    """Reads the outbox, the dead letters and the inbox at each scrape.

    Every query is cheap on a large table: pending rows are counted on the partial index the
    relay claims with, the oldest pending row is found on it too (:func:`outbox_lag`), and the
    inbox, the largest table by far, is estimated from PostgreSQL's statistics
    (``pg_class.reltuples``, kept by autovacuum) instead of counted. A database error never
    fails the scrape: it exports ``reliable_messaging_database_up 0`` and logs a warning.

    Queries run on the calling thread's Django connection. In a request Django closes it
    afterwards; elsewhere the caller owns the connection's lifetime.
    """

    def __init__(self, using: str | None = None) -> None:
        self.using = using

    def collect(self) -> Iterator[Metric]:
        try:
            families = list(self._read())
        except DatabaseError as exc:
            logger.warning("metrics: cannot read the database (%s); database_up is 0", exc)
            yield self._up(0)
            return
        yield from families
        yield self._up(1)

    @staticmethod
    def _up(value: int) -> Metric:
        return GaugeMetricFamily(
            "reliable_messaging_database_up",
            "1 when the last scrape could read the messaging tables, else 0.",
            value=value,
        )

    def _alias(self, model: type[Model]) -> str:
        return self.using or router.db_for_read(model)

    def _read(self) -> Iterator[Metric]:
        from .models import DeadLetter, OutboxMessage, ProcessedMessage

        alias = self._alias(OutboxMessage)
        outbox = OutboxMessage.objects.using(alias)
        yield GaugeMetricFamily(
            "reliable_messaging_outbox_pending_messages",
            "Outbox rows not sent yet (due, or waiting out a backoff after a failed send).",
            value=outbox.pending().count(),
        )
        yield GaugeMetricFamily(
            "reliable_messaging_outbox_oldest_pending_age_seconds",
            "Age of the oldest pending outbox row; 0 when none is pending.",
            value=outbox_lag(alias),
        )
        yield GaugeMetricFamily(
            "reliable_messaging_outbox_failed_messages",
            "Outbox rows marked failed after OUTBOX_MAX_ATTEMPTS; they wait for the admin.",
            value=outbox.failed().count(),
        )

        dead = GaugeMetricFamily(
            "reliable_messaging_dead_letters",
            "Dead letters by status, consumer and reason.",
            labels=["status", "consumer", "reason"],
        )
        groups = (
            DeadLetter.objects.using(self._alias(DeadLetter))
            .order_by()
            .values_list("status", "consumer", "reason")
            .annotate(rows=Count("id"))
        )
        for status, consumer, reason, rows in groups:
            dead.add_metric([status, consumer, reason], rows)
        yield dead

        yield GaugeMetricFamily(
            "reliable_messaging_inbox_messages",
            "Inbox rows (processed messages kept for deduplication); estimated on PostgreSQL.",
            value=inbox_rows(self._alias(ProcessedMessage))[0],
        )


# Up to this many rows by PostgreSQL's estimate, the inbox is counted instead.
COUNT_INBOX_UP_TO = 10_000


def inbox_rows(alias: str) -> tuple[float, bool]:
    """The inbox's rows, and whether that is an estimate: on PostgreSQL its statistics
    (``reltuples``, kept by autovacuum and ANALYZE; summed over the partitions) when they say
    more than ``COUNT_INBOX_UP_TO``, else a count; a count elsewhere. Counting a billion rows
    would take minutes."""
    from .models import ProcessedMessage

    if connections[alias].vendor == "postgresql":
        # None until the table is first vacuumed or analyzed: counted then, as is a small
        # inbox, whose count is cheap and whose statistics may lag far behind it.
        estimate = partitions.estimated_rows(alias, ProcessedMessage._meta.db_table)
        if estimate is not None and estimate > COUNT_INBOX_UP_TO:
            return estimate, True
    return float(ProcessedMessage._default_manager.using(alias).count()), False


# -- the broker ----------------------------------------------------------------------------------


class BrokerCollector:
    """Reads the depth and the consumer count of every consumer and delay queue at scrape time.

    One AMQP connection per read, with one passive declare per queue (exact figures, no
    management plugin needed). A read is kept for ``max_age`` seconds, so several scrapers or a
    dashboard refresh storm open at most one connection per ``max_age``. A broker that cannot be
    reached never fails the scrape: it exports ``reliable_messaging_broker_up 0`` and logs one
    warning until it answers again. ``specs`` defaults to every registered consumer, read at
    each scrape.
    """

    def __init__(
        self,
        specs: Iterable[ConsumerSpec] | None = None,
        *,
        timeout: float = 2.0,
        max_age: float = 5.0,
    ) -> None:
        self.specs = None if specs is None else list(specs)
        self.timeout = timeout
        self.max_age = max_age
        self._lock = threading.Lock()
        self._read_at: float | None = None
        self._families: list[Metric] = []
        self._reachable = True

    def forget(self) -> None:
        """Drop the kept read: the next scrape asks the broker."""
        with self._lock:
            self._read_at = None

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            now = time.monotonic()
            if self._read_at is None or now - self._read_at >= self.max_age:
                self._families = self._read()
                self._read_at = time.monotonic()
            families = list(self._families)
        yield from families

    def _read(self) -> list[Metric]:
        import pika.exceptions

        from .registry import registry
        from .status import describe_error, monitored_queues, queues_from_amqp

        specs = registry.all() if self.specs is None else self.specs
        try:
            specs = list(specs)
            queues = queues_from_amqp(
                monitored_queues(specs), timeout=self.timeout, leftovers_of=specs
            )
        except (pika.exceptions.AMQPError, OSError, ValueError) as exc:
            if self._reachable:
                # describe_error names the error, never the URL or its password; pika's
                # ValueError for a URL it cannot use may quote pieces of it: its type only.
                what = (
                    f"{type(exc).__name__}: the broker URL cannot be used (see manage.py check)"
                    if isinstance(exc, ValueError)
                    else describe_error(exc)
                )
                logger.warning(
                    "metrics: cannot read the queues from the broker (%s); broker_up is 0", what
                )
            self._reachable = False
            return [self._up(0)]
        if not self._reachable:
            logger.info("metrics: the broker answers again; queue gauges are back")
        self._reachable = True
        labels = ["queue", "consumer", "kind"]
        exists = GaugeMetricFamily(
            "reliable_messaging_queue_exists",
            "1 when the queue is declared on the broker; 0 when no consume process declared it "
            "yet (messages routed to it are returned to the relay as unroutable).",
            labels=labels,
        )
        ready = GaugeMetricFamily(
            "reliable_messaging_queue_messages_ready",
            "Messages waiting in the queue for a consumer (unacked deliveries not included).",
            labels=labels,
        )
        consumers = GaugeMetricFamily(
            "reliable_messaging_queue_consumers",
            "Consumers attached to the queue (standbys of a single-active-consumer queue too).",
            labels=labels,
        )
        for queue in queues:
            values = [queue.name, queue.consumer or "", queue.kind]
            exists.add_metric(values, 1 if queue.exists else 0)
            if queue.exists:
                ready.add_metric(values, queue.ready or 0)
                consumers.add_metric(values, queue.consumers or 0)
        return [exists, ready, consumers, self._up(1)]

    @staticmethod
    def _up(value: int) -> Metric:
        return GaugeMetricFamily(
            "reliable_messaging_broker_up",
            "1 when the last read of the queue gauges reached the broker, else 0.",
            value=value,
        )
