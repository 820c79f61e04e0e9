"""The readers of the messaging tables and the broker's queues, for ``messaging_status`` and the
web process's ``metrics/`` (the consume and relay processes never import this module)."""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from django.db import DatabaseError, connections, router
from django.db.models import DurationField, ExpressionWrapper, F, Model, QuerySet
from django.db.models.functions import Now
from django.utils import timezone
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from ..broker.queues import READ_ERRORS, describe_error, queues_from_amqp
from ..choices import GroupState, OutboxStatus
from ..conf import messaging_settings
from ..core.registry import ConsumerSpec, registry
from ..managers import waiting_since
from ..models import DeadLetter, DeadLetterGroup, OutboxMessage, ProcessedMessage
from ..storage import partitions

logger = logging.getLogger(__name__)
T = TypeVar("T")

# The largest new and regressed failure groups that get a series of their own (a storm of
# distinct failures must not explode Prometheus's series).
FAILURE_GROUP_SERIES = 50
ALERTING_GROUP_STATES = (GroupState.NEW.value, GroupState.REGRESSED.value)


@dataclass(frozen=True)
class DeadLetterCount:
    consumer: str
    reason: str
    count: int


@dataclass(frozen=True)
class DatabaseStatus:
    alias: str
    reachable: bool
    error: str = ""
    outbox_pending: int = 0
    outbox_scheduled: int = 0  # waiting for their due time
    outbox_failed: int = 0
    outbox_unrouted: int = 0  # no queue was bound for them: shown, never a problem
    outbox_lag: float | None = None  # None when no row waits to be sent
    dead_letters: tuple[DeadLetterCount, ...] = ()  # status "dead", awaiting a person
    inbox_rows: int = 0
    inbox_estimated: bool = False
    # Per day-partitioned table (PostgreSQL): see partition_upkeep.
    partition_days_ahead: tuple[tuple[str, float], ...] = ()
    overdue_partitions: tuple[str, ...] = ()

    @property
    def dead_letters_total(self) -> int:
        return sum(d.count for d in self.dead_letters)


def outbox_lag(using: str) -> float:
    """Seconds the oldest row that should have been sent has waited (by the database's clock);
    0 when none. The oldest pending row is the lowest id, found on the relay's partial index
    (ordering by ``created_at`` would sort the whole backlog)."""

    def oldest(rows: QuerySet[Any], since: Any) -> dt.timedelta | None:
        age = ExpressionWrapper(Now() - since, output_field=DurationField())
        return rows.annotate(age=age).values_list("age", flat=True).first()

    outbox = OutboxMessage.objects.using(using)
    due = outbox.filter(status=OutboxStatus.SCHEDULED, next_attempt_at__lte=Now())
    ages = [
        oldest(outbox.pending().order_by("id"), waiting_since()),
        oldest(due.order_by("next_attempt_at"), F("next_attempt_at")),
    ]
    return max([0.0, *(age.total_seconds() for age in ages if age is not None)])


# Up to this many rows by PostgreSQL's estimate, the inbox and the scheduled rows are counted.
COUNT_INBOX_UP_TO = COUNT_SCHEDULED_UP_TO = 10_000


def inbox_rows(alias: str) -> tuple[float, bool]:
    """The inbox's rows, and whether that is an estimate (:func:`counted_or_estimated`)."""
    rows = ProcessedMessage._default_manager.using(alias)
    return counted_or_estimated(rows, ProcessedMessage._meta.db_table, COUNT_INBOX_UP_TO)


def scheduled_rows(alias: str) -> tuple[float, bool]:
    """The scheduled messages waiting for their due time, and whether that is an estimate."""
    rows = OutboxMessage.objects.using(alias).filter(status=OutboxStatus.SCHEDULED)
    return counted_or_estimated(rows, partitions.OUTBOX_SCHEDULED, COUNT_SCHEDULED_UP_TO)


def counted_or_estimated(rows: QuerySet[Any], table: str, up_to: int) -> tuple[float, bool]:
    """How many ``rows`` (all the rows of ``table``), and whether that is an estimate: on
    PostgreSQL the table's statistics when they say more than ``up_to``, else a count."""
    if connections[rows.db].vendor == "postgresql":
        # The count stops past ``up_to`` rows all the same: statistics that lag behind a grown
        # table must not turn a scrape into a scan.
        estimate = partitions.estimated_rows(rows.db, table)
        if estimate is not None and estimate > up_to:
            return estimate, True
        counted = rows[: up_to + 1].count()
        if counted > up_to:
            return max(float(counted), estimate or 0.0), True
        return float(counted), False
    return float(rows.count()), False


# How long an expired day partition may stay before it is overdue (the upkeep runs hourly).
OVERDUE_AFTER = dt.timedelta(seconds=2 * partitions.UPKEEP_INTERVAL)


def partition_upkeep(using: str) -> tuple[tuple[tuple[str, float], ...], tuple[str, ...]]:
    """Per day-partitioned table, the days made ahead of now; and the partitions expired more
    than ``OVERDUE_AFTER`` ago. Both empty where nothing is partitioned (SQLite)."""
    if connections[using].vendor != "postgresql":
        return (), ()
    now = timezone.now()
    ahead: list[tuple[str, float]] = []
    overdue: list[str] = []
    for spec, retention in (
        (partitions.INBOX, messaging_settings.dedup_retention),
        (partitions.OUTBOX, messaging_settings.outbox_retention),
    ):
        days = partitions.days_ahead(using, now, spec)
        if days is None:
            continue
        ahead.append((spec.label, days))  # judged as it is, rounded only when shown
        overdue += partitions.expired(using, now - retention - OVERDUE_AFTER, spec)
    return tuple(ahead), tuple(overdue)


def database_status(using: str | None = None) -> DatabaseStatus:
    """Outbox, dead-letter and inbox figures; ``reachable=False`` with the error when the
    database cannot be queried."""
    using = using or router.db_for_read(OutboxMessage)
    try:
        outbox = OutboxMessage.objects.using(using)
        # From the failure groups (tens of rows), not a count of a million dead letters.
        dead = DeadLetterGroup.objects.using(using).dead_counts()
        pending = outbox.pending().count()
        # A scheduled row past its due time waits as a pending one does (as /healthz sees).
        lag = outbox_lag(using)
        inbox = inbox_rows(using)
        days_ahead, overdue = partition_upkeep(using)
        return DatabaseStatus(
            alias=using,
            reachable=True,
            outbox_pending=pending,
            outbox_scheduled=round(scheduled_rows(using)[0]),
            outbox_failed=outbox.failed().count(),
            outbox_unrouted=outbox.filter(status=OutboxStatus.UNROUTED).count(),
            outbox_lag=lag if pending or lag > 0 else None,
            dead_letters=tuple(
                DeadLetterCount(consumer, reason, count) for consumer, reason, count in dead
            ),
            inbox_rows=round(inbox[0]),
            inbox_estimated=inbox[1],
            partition_days_ahead=days_ahead,
            overdue_partitions=overdue,
        )
    except DatabaseError as exc:
        # Closed so the next attempt (a health probe in a long-lived process) starts afresh;
        # left alone inside a caller's transaction, which is the caller's to end.
        if not connections[using].in_atomic_block:
            connections[using].close()
        return DatabaseStatus(alias=using, reachable=False, error=describe_error(exc))


class RecentValue(Generic[T]):
    """``read()``'s last answer, read again once it is ``max_age`` seconds old."""

    def __init__(self, read: Callable[[], T], max_age: float) -> None:
        self.read = read
        self.max_age = max_age
        self._lock = threading.Lock()
        self._kept: tuple[float, T] | None = None  # when it was read, and the answer

    def get(self) -> T:
        with self._lock:
            if self._kept is None or time.monotonic() - self._kept[0] >= self.max_age:
                answer = self.read()
                self._kept = (time.monotonic(), answer)
            return self._kept[1]

    def forget(self) -> None:
        with self._lock:
            self._kept = None


def _gauge(
    name: str,
    documentation: str,
    labels: Sequence[str],
    samples: Iterable[tuple[Sequence[str], float]],
) -> Metric:
    """A gauge with one sample per set of label values."""
    family = GaugeMetricFamily(name, documentation, labels=labels)
    for values, value in samples:
        family.add_metric(values, value)
    return family


class DatabaseCollector:
    """Reads the outbox, the dead letters and the inbox at each scrape, with queries that stay
    cheap on a large table (partial indexes, failure groups, statistics). A database error
    exports ``reliable_messaging_database_up 0`` instead of failing the scrape."""

    def __init__(self, using: str | None = None) -> None:
        self.using = using

    def collect(self) -> Iterator[Metric]:
        up = 1
        try:
            # Read whole before yielding: a failure midway exports database_up 0 and nothing else.
            yield from list(self._read())
        except DatabaseError as exc:
            logger.warning("metrics: cannot read the database (%s); database_up is 0", exc)
            up = 0
        what = "1 when the last scrape could read the messaging tables, else 0."
        yield GaugeMetricFamily("reliable_messaging_database_up", what, value=up)

    def _alias(self, model: type[Model]) -> str:
        return self.using or router.db_for_read(model)

    def _read(self) -> Iterator[Metric]:
        alias = self._alias(OutboxMessage)
        outbox = OutboxMessage.objects.using(alias)
        yield GaugeMetricFamily(
            "reliable_messaging_outbox_pending_messages",
            "Outbox rows not sent yet (due, or waiting out a backoff after a failed send).",
            value=outbox.pending().count(),
        )
        yield GaugeMetricFamily(
            "reliable_messaging_outbox_oldest_pending_age_seconds",
            "How long the oldest outbox row that should have been sent has waited (a scheduled "
            "one: since it fell due); 0 when none.",
            value=outbox_lag(alias),
        )
        yield GaugeMetricFamily(
            "reliable_messaging_outbox_scheduled_messages",
            "Scheduled messages waiting for their due time (publish(deliver_at=...)); "
            "estimated on PostgreSQL past ten thousand.",
            value=scheduled_rows(alias)[0],
        )
        yield GaugeMetricFamily(
            "reliable_messaging_outbox_failed_messages",
            "Outbox rows marked failed after OUTBOX_MAX_ATTEMPTS; they wait for the admin.",
            value=outbox.failed().count(),
        )
        groups = DeadLetterGroup.objects.using(self._alias(DeadLetter)).counts()
        yield _gauge(
            "reliable_messaging_dead_letters",
            "Dead letters by status, consumer and reason.",
            ["status", "consumer", "reason"],
            (([status, consumer, reason], rows) for status, consumer, reason, rows in groups),
        )
        yield from self._failure_groups(self._alias(DeadLetter))
        yield GaugeMetricFamily(
            "reliable_messaging_inbox_messages",
            "Inbox rows (processed messages kept for deduplication); estimated on PostgreSQL.",
            value=inbox_rows(self._alias(ProcessedMessage))[0],
        )
        days_ahead, overdue = partition_upkeep(self._alias(ProcessedMessage))
        yield _gauge(
            "reliable_messaging_partition_days_ahead",
            "Days of day partitions made ahead of now (PostgreSQL), by table; the upkeep keeps "
            f"it above {partitions.AHEAD_DAYS}, each day it fails takes one away.",
            ["table"],
            (([table], days) for table, days in days_ahead),
        )
        yield GaugeMetricFamily(
            "reliable_messaging_partitions_overdue",
            "Day partitions kept past their retention and the upkeep's next run (PostgreSQL).",
            value=len(overdue),
        )

    @staticmethod
    def _failure_groups(alias: str) -> Iterator[Metric]:
        """Open failure groups per state, and the dead letters of the largest alerting ones."""
        groups = DeadLetterGroup.objects.using(alias).with_states()
        counts = dict.fromkeys(GroupState.values, 0)
        alerting: list[tuple[list[str], int]] = []
        for group in groups.values("consumer", "reason", "fingerprint", "state", "dead"):
            counts[group["state"]] += 1
            if group["state"] in ALERTING_GROUP_STATES and len(alerting) < FAILURE_GROUP_SERIES:
                labels = [group["consumer"], group["reason"], group["fingerprint"], group["state"]]
                alerting.append((labels, group["dead"]))
        yield _gauge(
            "reliable_messaging_failure_groups",
            "Failure groups with dead letters still dead, by state (new, acknowledged, "
            "resolved, regressed); the alerts fire on new and regressed.",
            ["state"],
            (([state], count) for state, count in counts.items()),
        )
        yield _gauge(
            "reliable_messaging_failure_group_dead_letters",
            "Dead letters still dead in each new or regressed failure group (the "
            f"{FAILURE_GROUP_SERIES} largest), by consumer, reason, fingerprint and state.",
            ["consumer", "reason", "fingerprint", "state"],
            alerting,
        )


class BrokerCollector:
    """Reads the depth and the consumer count of every consumer queue (passive declares on one
    AMQP connection), kept 5 s. A broker that cannot be reached exports
    ``reliable_messaging_broker_up 0`` and logs one warning."""

    def __init__(self, specs: Iterable[ConsumerSpec] | None = None) -> None:
        self.specs = None if specs is None else list(specs)
        self._reachable = True
        self._kept = RecentValue(self._read, max_age=5.0)

    def forget(self) -> None:
        """Drop the kept read: the next scrape asks the broker."""
        self._kept.forget()

    def collect(self) -> Iterator[Metric]:
        yield from self._kept.get()

    def _read(self) -> list[Metric]:
        specs = registry.all() if self.specs is None else self.specs
        try:
            queues = queues_from_amqp(specs, timeout=2.0)
        except READ_ERRORS as exc:
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
        what = "1 when the last read of the queue gauges reached the broker, else 0."
        return GaugeMetricFamily("reliable_messaging_broker_up", what, value=value)
