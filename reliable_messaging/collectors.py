"""The readers of the whole system: the messaging tables and the broker's queues.

Two callers read the same figures: ``manage.py messaging_status`` (through :mod:`.status`,
which judges them) and a Prometheus scrape of the web process's ``metrics/`` view
(:mod:`.views`), through the two collectors at the end of this module. The consume and relay
processes never need this module: their counters are in :mod:`.metrics`, their own health in
:mod:`.liveness`.

**Database gauges**, read from the database at each scrape by :class:`DatabaseCollector`.
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

**Queue gauges**, read from the broker at scrape time by :class:`BrokerCollector` with AMQP
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

The broker is always read over AMQP, as the application talks to it: a passive declare per
queue gives its exact ready count and consumers, and a connection that cannot be opened is what
"unreachable" means. The RabbitMQ management HTTP API, when it answers, adds what AMQP cannot
tell: unacked deliveries and message rates. It is an optional plugin, and the application's
user may lack the ``monitoring`` tag it needs, so doing without it is normal, not an error.

No broker password ever leaves this module: URLs are shown through :func:`.conf.redact_url`,
and what the client libraries say in their errors is scrubbed of it too.
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any, Literal

import pika
import pika.exceptions
from django.db import DatabaseError, connections, router
from django.db.models import Count, DurationField, ExpressionWrapper, F, Model
from django.db.models.functions import Now
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from . import partitions
from .conf import MessagingSettings, messaging_settings, redact_url
from .leftovers import find_leftovers
from .models import DeadLetter, OutboxMessage, OutboxStatus, ProcessedMessage
from .pika_logs import expecting_not_found
from .registry import ConsumerSpec, registry
from .topology import (
    all_delays,
    connect,
    connect_to_any,
    connection_parameters,
    consumer_queues,
    delay_exchange_name,
)

logger = logging.getLogger(__name__)

NOT_FOUND = 404
UNAUTHORIZED = 401
DEFAULT_TIMEOUT = 3.0
# The management plugin listens here unless configured otherwise (TLS: 15671).
MANAGEMENT_PORT = 15672
MANAGEMENT_TLS_PORT = 15671

# The readings: what the readers below return, judged by .status and rendered by the command.

# "leftover": a queue an earlier shape of a consumer left (see reliable_messaging.leftovers).
QueueKind = Literal["consumer", "delay", "leftover"]


@dataclass(frozen=True)
class QueueStatus:
    """One queue as the broker sees it. ``None`` means "not known": unacked deliveries and
    rates come from the management API only, and a queue that does not exist (nobody ran
    ``consume`` yet) has no figures at all."""

    name: str
    kind: QueueKind
    consumer: str | None  # the handler's name (dedup scope) for a consumer queue
    exists: bool
    ready: int | None = None
    unacked: int | None = None
    consumers: int | None = None
    deliver_rate: float | None = None  # deliveries per second, redeliveries included
    redeliver_rate: float | None = None

    @property
    def redelivery_ratio(self) -> float | None:
        """The share of recent deliveries that were redeliveries (0..1), when there were any.

        A high share means deliveries keep coming back: consumers die or drop their connection
        with messages unacked, or hold deliveries back while the database is down."""
        if self.deliver_rate is None or self.redeliver_rate is None or self.deliver_rate <= 0:
            return None
        return min(1.0, self.redeliver_rate / self.deliver_rate)


@dataclass(frozen=True)
class BrokerStatus:
    url: str  # redacted
    reachable: bool
    management_api: bool = False  # whether unacked counts and rates could be read
    queues: tuple[QueueStatus, ...] = ()
    error: str = ""  # why the broker could not be reached
    note: str = ""  # why the management API was not used, when it was not


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
    outbox_failed: int = 0
    # Events the broker had no queue for (nobody subscribed yet): shown, never a problem.
    outbox_unrouted: int = 0
    # Seconds since the oldest pending outbox row was written; None when nothing is pending.
    outbox_lag: float | None = None
    dead_letters: tuple[DeadLetterCount, ...] = ()  # status "dead", awaiting a person
    inbox_rows: int = 0
    # Whether inbox_rows is PostgreSQL's estimate of a large inbox (see inbox_rows).
    inbox_estimated: bool = False

    @property
    def dead_letters_total(self) -> int:
        return sum(d.count for d in self.dead_letters)


# --------------------------------------------------------------------------- the database


def outbox_lag(using: str) -> float:
    """Seconds the oldest pending outbox row has waited; 0 when none is pending.

    "Oldest" is the lowest id, found on the relay's partial index of pending rows: ids grow
    with time, and ordering by ``created_at`` would sort the whole backlog at every call.
    """
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


# Up to this many rows by PostgreSQL's estimate, the inbox is counted instead.
COUNT_INBOX_UP_TO = 10_000


def inbox_rows(alias: str) -> tuple[float, bool]:
    """The inbox's rows, and whether that is an estimate: on PostgreSQL its statistics
    (``reltuples``, kept by autovacuum and ANALYZE; summed over the partitions) when they say
    more than ``COUNT_INBOX_UP_TO``, else a count; a count elsewhere. Counting a billion rows
    would take minutes."""
    if connections[alias].vendor == "postgresql":
        # None until the table is first vacuumed or analyzed: counted then, as is a small
        # inbox, whose count is cheap and whose statistics may lag far behind it.
        estimate = partitions.estimated_rows(alias, ProcessedMessage._meta.db_table)
        if estimate is not None and estimate > COUNT_INBOX_UP_TO:
            return estimate, True
    return float(ProcessedMessage._default_manager.using(alias).count()), False


def database_status(using: str | None = None) -> DatabaseStatus:
    """Outbox, dead-letter and inbox figures; ``reachable=False`` with the error when the
    database cannot be queried. On PostgreSQL the inbox's rows are estimated, as the scrape
    does (:func:`inbox_rows`): counting a billion rows would take minutes."""
    using = using or router.db_for_read(OutboxMessage)
    try:
        outbox = OutboxMessage.objects.using(using)
        dead = (
            DeadLetter.objects.using(using)
            .dead()
            .values("consumer", "reason")
            .annotate(count=Count("id"))
            .order_by("consumer", "reason")
        )
        pending = outbox.pending().count()
        inbox = inbox_rows(using)
        return DatabaseStatus(
            alias=using,
            reachable=True,
            outbox_pending=pending,
            outbox_failed=outbox.failed().count(),
            outbox_unrouted=outbox.filter(status=OutboxStatus.UNROUTED).count(),
            outbox_lag=outbox_lag(using) if pending else None,
            dead_letters=tuple(
                DeadLetterCount(row["consumer"], row["reason"], row["count"]) for row in dead
            ),
            inbox_rows=round(inbox[0]),
            inbox_estimated=inbox[1],
        )
    except DatabaseError as exc:
        # Closed so the next attempt (a health probe in a long-lived process) starts afresh;
        # left alone inside a caller's transaction, which is the caller's to end.
        if not connections[using].in_atomic_block:
            connections[using].close()
        return DatabaseStatus(alias=using, reachable=False, error=describe_error(exc))


# --------------------------------------------------------------------------- the broker


def monitored_queues(
    specs: Iterable[ConsumerSpec], settings: MessagingSettings = messaging_settings
) -> list[tuple[str, QueueKind, str | None]]:
    """(queue, kind, consumer name) of every queue ``consume`` declares for ``specs``: each
    handler's queue (an ordered consumer's partition queues), then the retry delay queues."""
    specs = list(specs)
    queues: list[tuple[str, QueueKind, str | None]] = [
        (queue, "consumer", spec.name)
        for spec in specs
        for queue in consumer_queues(spec, settings)
    ]
    queues += [
        (delay_exchange_name(d, settings), "delay", None) for d in all_delays(specs, settings)
    ]
    return queues


def default_management_url(broker: str | pika.URLParameters) -> str:
    """The management API's base URL on the broker's host (``broker``: a URL, or the
    parameters of the node a connection reached): http on 15672, or https on 15671 for an
    ``amqps://`` broker. Carries no credentials."""
    params = pika.URLParameters(broker) if isinstance(broker, str) else broker
    tls = params.ssl_options is not None
    scheme, port = ("https", MANAGEMENT_TLS_PORT) if tls else ("http", MANAGEMENT_PORT)
    host = f"[{params.host}]" if ":" in params.host else params.host
    return f"{scheme}://{host}:{port}"


def scrub(text: str, *secrets: str) -> str:
    """``text`` with every occurrence of each secret (and its URL-quoted form) masked."""
    for secret in secrets:
        if not secret:
            continue
        for form in {secret, urllib.parse.quote(secret, safe="")}:
            text = text.replace(form, "***")
    return text


def _redacted_part(url: str) -> str:
    """What :func:`.conf.redact_url` hides of ``url``. Not always the password pika reads: in
    a malformed URL (``amqp:///user:pw@mq``) pika may take it for the vhost, which the broker
    then quotes in its refusal."""
    shown = redact_url(url)
    if shown == url:
        return ""
    head, _, tail = shown.partition("***")
    return url[len(head) : len(url) - len(tail)]


def describe_error(exc: BaseException) -> str:
    """A one-line account of a connection error. pika's connection errors carry their cause
    in ``args``, as exceptions whose ``str()`` may be empty: those are shown by their repr."""
    if isinstance(exc, urllib.error.URLError) and isinstance(exc.reason, BaseException):
        return describe_error(exc.reason)
    if isinstance(exc, OSError):
        detail = str(exc)  # "[Errno 111] Connection refused"
    else:
        detail = "; ".join(str(arg) or repr(arg) for arg in exc.args) or str(exc)
    detail = " ".join(detail.split())  # database drivers' messages span several lines
    return f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__


def _management_get(base_url: str, path: str, params: pika.URLParameters, timeout: float) -> Any:
    if urllib.parse.urlsplit(base_url).scheme not in ("http", "https"):
        raise ValueError(f"the management URL must be http(s)://, not {base_url!r}")
    credentials = params.credentials
    username = getattr(credentials, "username", "")
    password = getattr(credentials, "password", "")
    token = base64.b64encode(f"{username}:{password}".encode()).decode()
    request = urllib.request.Request(  # noqa: S310 - the scheme is checked above
        f"{base_url.rstrip('/')}{path}", headers={"Authorization": f"Basic {token}"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 - as above
        return json.load(response)


_MANAGEMENT_COLUMNS = ",".join(
    (
        "messages_unacknowledged",
        "message_stats.deliver_get_details.rate",
        "message_stats.redeliver_details.rate",
    )
)


def _rate(stats: Any, key: str) -> float:
    # A queue nothing was delivered from yet has no message_stats (or not this key): rate 0.
    details = stats.get(key) if isinstance(stats, dict) else None
    return float(details.get("rate", 0.0)) if isinstance(details, dict) else 0.0


def with_management_figures(
    queues: Iterable[QueueStatus],
    params: pika.URLParameters,
    base_url: str,
    timeout: float = DEFAULT_TIMEOUT,
) -> tuple[QueueStatus, ...]:
    """``queues`` with unacked counts and rates from the management API. Raises
    ``urllib.error.URLError`` (an ``OSError``), ``http.client.HTTPException`` or ``ValueError``
    when the API cannot be used. Its figures are samples, refreshed every few seconds."""
    vhost = urllib.parse.quote(params.virtual_host, safe="")
    found = []
    for queue in queues:
        if not queue.exists:
            found.append(queue)
            continue
        quoted = urllib.parse.quote(queue.name, safe="")
        path = f"/api/queues/{vhost}/{quoted}?columns={_MANAGEMENT_COLUMNS}"
        try:
            data = _management_get(base_url, path, params, timeout)
        except urllib.error.HTTPError as exc:
            if exc.code != NOT_FOUND:
                raise
            found.append(queue)  # deleted since the passive declare: nothing more to add
            continue
        if not isinstance(data, dict):
            # A queue declared moments ago has no sampled figures yet, and the plugin answers
            # an empty list for the columns asked: nothing was delivered from it yet.
            data = {}
        stats = data.get("message_stats")
        found.append(
            replace(
                queue,
                unacked=int(data.get("messages_unacknowledged") or 0),
                deliver_rate=_rate(stats, "deliver_get_details"),
                redeliver_rate=_rate(stats, "redeliver_details"),
            )
        )
    return tuple(found)


def queues_from_amqp(
    queues: Iterable[tuple[str, QueueKind, str | None]],
    settings: MessagingSettings = messaging_settings,
    timeout: float = DEFAULT_TIMEOUT,
    *,
    leftovers_of: Iterable[ConsumerSpec] = (),
) -> tuple[QueueStatus, ...]:
    """Read exact ready counts and consumers with passive declares, then the queues that
    earlier shapes of ``leftovers_of`` left behind (kind ``leftover``). Raises
    ``pika.exceptions.AMQPConnectionError`` when no broker URL can be reached."""
    connection = connect(settings, "messaging_status", timeout=timeout)
    try:
        return _queues_on(connection, queues, settings, leftovers_of)
    finally:
        if connection.is_open:
            connection.close()


def _queues_on(
    connection: pika.BlockingConnection,
    queues: Iterable[tuple[str, QueueKind, str | None]],
    settings: MessagingSettings,
    leftovers_of: Iterable[ConsumerSpec],
) -> tuple[QueueStatus, ...]:
    found = []
    channel = connection.channel()
    for name, kind, consumer in queues:
        try:
            with expecting_not_found():
                method = channel.queue_declare(name, passive=True).method
        except pika.exceptions.ChannelClosedByBroker as exc:
            if exc.reply_code != NOT_FOUND:
                raise
            # The broker closes the channel on a failed passive declare. (A classic queue
            # whose node is down answers 404 too: it cannot be read now.)
            channel = connection.channel()
            found.append(QueueStatus(name, kind, consumer, exists=False))
            continue
        found.append(
            QueueStatus(
                name,
                kind,
                consumer,
                exists=True,
                ready=int(method.message_count or 0),
                consumers=int(method.consumer_count or 0),
            )
        )
    found += [
        QueueStatus(
            leftover.queue,
            "leftover",
            leftover.spec.name,
            exists=True,
            ready=leftover.messages,
            consumers=leftover.consumers,
        )
        for leftover in find_leftovers(connection, leftovers_of, settings)
    ]
    return tuple(found)


def _secrets(settings: MessagingSettings, candidates: Iterable[pika.URLParameters]) -> list[str]:
    """Every password of the broker URLs, as pika reads it and as redact_url hides it."""
    found = [str(getattr(params.credentials, "password", "") or "") for params in candidates]
    return found + [_redacted_part(url) for url in settings.broker_urls]


def broker_status(
    specs: Iterable[ConsumerSpec] | None = None,
    *,
    settings: MessagingSettings = messaging_settings,
    management_url: str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> BrokerStatus:
    """The queues of ``specs`` (default: every registered consumer) and their delay queues.
    ``management_url`` overrides the management API's address; "" skips the API."""
    shown = settings.broker_shown
    try:
        candidates = connection_parameters(settings, name="messaging_status")
    except Exception as exc:  # noqa: BLE001 - pika raises several types for a bad URL
        # The type only: pika's messages quote pieces of the URL, a password's among them.
        error = f"the URL cannot be parsed ({type(exc).__name__})"
        return BrokerStatus(shown, reachable=False, error=error)
    secrets = _secrets(settings, candidates)
    specs = list(registry.all() if specs is None else specs)
    queues = monitored_queues(specs, settings)
    try:
        connection, params = connect_to_any(candidates, timeout=timeout)
        try:
            found = _queues_on(connection, queues, settings, specs)
        finally:
            if connection.is_open:
                connection.close()
    except (pika.exceptions.AMQPError, OSError) as exc:
        detail = scrub(describe_error(exc), *secrets)
        error = f"cannot connect to {shown}: {detail}"
        return BrokerStatus(shown, reachable=False, error=error)
    if management_url is None:
        # The management API of the node that answered.
        management_url = default_management_url(params)
    if not management_url:
        note = "the management API was skipped (no URL given)"
    else:
        # A --management-url given by hand may carry credentials of its own.
        api = redact_url(management_url)
        try:
            found = with_management_figures(found, params, management_url, timeout)
        except urllib.error.HTTPError as exc:
            note = f"the management API at {api} answered HTTP {exc.code}"
            if exc.code == UNAUTHORIZED:
                note += " (its user needs the monitoring tag: rabbitmqctl set_user_tags)"
        except (OSError, ValueError, http.client.HTTPException) as exc:
            # URLError and timeouts are OSErrors; a port that does not speak HTTP raises an
            # HTTPException; a body that is not JSON a ValueError.
            detail = scrub(describe_error(exc), *secrets, _redacted_part(management_url))
            note = f"the management API at {api} is unreachable ({detail})"
        else:
            return BrokerStatus(shown, reachable=True, management_api=True, queues=found)
    return BrokerStatus(shown, reachable=True, queues=found, note=note)


def broker_connection_error(
    settings: MessagingSettings = messaging_settings, timeout: float = DEFAULT_TIMEOUT
) -> str:
    """Open and close one AMQP connection; "" when that worked, else why not. The text names
    neither the host nor the user, and never the password: health endpoints may be public."""
    try:
        candidates = connection_parameters(settings, name="messaging_status")
    except Exception as exc:  # noqa: BLE001 - pika raises several types for a bad URL
        return f"the broker URL cannot be parsed ({type(exc).__name__})"
    try:
        connection, _ = connect_to_any(candidates, timeout=timeout)
    except (pika.exceptions.AMQPError, OSError) as exc:
        return scrub(describe_error(exc), *_secrets(settings, candidates))
    if connection.is_open:
        connection.close()
    return ""


# --------------------------------------------------------------------------- the scrape


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
