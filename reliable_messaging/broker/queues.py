"""What the broker says about the app's queues: passive declares over AMQP and, when it answers,
the management API's figures; no broker password leaves this module."""

from __future__ import annotations

import base64
import http.client
import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Literal

import pika
import pika.exceptions

from ..conf import MessagingSettings, messaging_settings, redact_url
from ..core.registry import ConsumerSpec, registry
from .findings import OurQueue
from .leftovers import find_leftovers
from .probes import PassiveProbe
from .replies import NOT_FOUND
from .topology import (
    connect,
    connect_to_any,
    connection_parameters,
    consumer_queues,
    dead_letter_queue,
)

# What reading the broker may raise: the client's errors, the network's, and ValueError for a URL
# pika cannot use.
READ_ERRORS = (pika.exceptions.AMQPError, OSError, ValueError)

UNAUTHORIZED = 401
DEFAULT_TIMEOUT = 3.0
# The management plugin listens here unless configured otherwise.
MANAGEMENT_PORT = 15672
MANAGEMENT_TLS_PORT = 15671

# "leftover": a queue an earlier shape of a consumer left (see reliable_messaging.broker.leftovers).
QueueKind = Literal["consumer", "leftover"]


@dataclass(frozen=True)
class QueueStatus:
    """One queue as the broker sees it; ``None`` means "not known"."""

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
        """The share of recent deliveries that were redeliveries (0..1), when there were any."""
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


def our_queues(
    specs: Iterable[ConsumerSpec], settings: MessagingSettings = messaging_settings
) -> list[OurQueue]:
    """Every queue ``consume`` declares for ``specs``, named as :mod:`.topology` names them."""
    found = []
    for spec in specs:
        timeout = spec.timeout or settings.handler_timeout
        dead = dead_letter_queue(spec)
        found += [
            OurQueue(
                queue,
                "consumer",
                spec.name,
                handler_timeout=timeout,
                dead_letter_to=dead,
                priorities=spec.priorities,
            )
            for queue in consumer_queues(spec, settings)
        ]
        if settings.queue_type == "quorum":
            found.append(OurQueue(dead, "dead", spec.name, handler_timeout=timeout))
    return found


def scrub(text: str, *secrets: str) -> str:
    """``text`` with every occurrence of each secret (and its URL-quoted form) masked."""
    for secret in secrets:
        if not secret:
            continue
        for form in {secret, urllib.parse.quote(secret, safe="")}:
            text = text.replace(form, "***")
    return text


def _redacted_part(url: str) -> str:
    """What :func:`reliable_messaging.conf.redact_url` hides of ``url`` (not always what pika
    reads as the password: it may take it for the vhost, which the broker quotes)."""
    shown = redact_url(url)
    if shown == url:
        return ""
    head, _, tail = shown.partition("***")
    return url[len(head) : len(url) - len(tail)]


def describe_error(exc: BaseException) -> str:
    """A one-line account of a connection error (causes whose ``str()`` is empty by repr)."""
    if isinstance(exc, urllib.error.URLError) and isinstance(exc.reason, BaseException):
        return describe_error(exc.reason)
    if isinstance(exc, OSError):
        detail = str(exc)  # "[Errno 111] Connection refused"
    else:
        detail = "; ".join(str(arg) or repr(arg) for arg in exc.args) or str(exc)
    detail = " ".join(detail.split())  # database drivers' messages span several lines
    return f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__


def management_url_for(
    management_url: str | None, settings: MessagingSettings, params: pika.URLParameters
) -> str:
    """``management_url`` when given ("" means none), else ``MANAGEMENT_URL``, else the API on
    the node ``params`` reached (https for ``amqps://``)."""
    if management_url is None:
        management_url = settings.management_url
    if management_url is not None:
        return management_url
    tls = params.ssl_options is not None
    scheme, port = ("https", MANAGEMENT_TLS_PORT) if tls else ("http", MANAGEMENT_PORT)
    host = f"[{params.host}]" if ":" in params.host else params.host
    return f"{scheme}://{host}:{port}"


def management_get(base_url: str, path: str, params: pika.URLParameters, timeout: float) -> Any:
    """GET ``path`` of the management API at ``base_url`` and decode its JSON, as the URL's
    user, else the broker connection's."""
    parts = urllib.parse.urlsplit(base_url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"the management URL must be http(s)://, not {redact_url(base_url)!r}")
    if parts.username is not None:
        username = urllib.parse.unquote(parts.username)
        password = urllib.parse.unquote(parts.password or "")
        base_url = urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
    else:
        username = getattr(params.credentials, "username", "")
        password = getattr(params.credentials, "password", "")
    token = base64.b64encode(f"{username}:{password}".encode()).decode()
    request = urllib.request.Request(  # noqa: S310 - the scheme is checked above
        f"{base_url.rstrip('/')}{path}", headers={"Authorization": f"Basic {token}"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 - as above
        return json.load(response)


def management_failure(exc: BaseException, management_url: str, secrets: Iterable[str]) -> str:
    """Why the management API could not be used (``exc``), without a password."""
    api = redact_url(management_url)
    if isinstance(exc, urllib.error.HTTPError):
        note = f"the management API at {api} answered HTTP {exc.code}"
        if exc.code == UNAUTHORIZED:
            note += " (its user needs the monitoring tag: rabbitmqctl set_user_tags)"
        return note
    detail = scrub(describe_error(exc), *secrets, _redacted_part(management_url))
    return f"the management API at {api} is unreachable ({detail})"


# What management_get raises when the API cannot be used (URLError and timeouts are OSErrors).
MANAGEMENT_ERRORS = (OSError, ValueError, http.client.HTTPException)


_MANAGEMENT_COLUMNS = (
    "messages_unacknowledged,message_stats.deliver_get_details.rate,"
    "message_stats.redeliver_details.rate"
)


def _rate(stats: Any, key: str) -> float:
    # A queue nothing was delivered from yet has no message_stats (or not this key): rate 0.
    details = stats.get(key) if isinstance(stats, dict) else None
    return float(details.get("rate", 0.0)) if isinstance(details, dict) else 0.0


def management_queue(
    get: Callable[[str], Any], params: pika.URLParameters, name: str, columns: str
) -> dict[str, Any] | None:
    """The ``columns`` of queue ``name`` in the connection's vhost, read by ``get`` from the
    management API ({} for a queue not sampled yet), or None when it does not exist."""
    vhost = urllib.parse.quote(params.virtual_host, safe="")
    try:
        data = get(f"/api/queues/{vhost}/{urllib.parse.quote(name, safe='')}?columns={columns}")
    except urllib.error.HTTPError as exc:
        if exc.code != NOT_FOUND:
            raise
        return None
    return data if isinstance(data, dict) else {}


def with_management_figures(
    queues: Iterable[QueueStatus],
    params: pika.URLParameters,
    base_url: str,
    timeout: float = DEFAULT_TIMEOUT,
) -> tuple[QueueStatus, ...]:
    """``queues`` with unacked counts and rates from the management API; raises one of
    :data:`MANAGEMENT_ERRORS` when the API cannot be used."""
    get = partial(management_get, base_url, params=params, timeout=timeout)
    found = []
    for queue in queues:
        data = (
            management_queue(get, params, queue.name, _MANAGEMENT_COLUMNS) if queue.exists else None
        )
        if data is not None:  # else not declared, or deleted since the passive declare
            stats = data.get("message_stats")
            queue = replace(
                queue,
                unacked=int(data.get("messages_unacknowledged") or 0),
                deliver_rate=_rate(stats, "deliver_get_details"),
                redeliver_rate=_rate(stats, "redeliver_details"),
            )
        found.append(queue)
    return tuple(found)


def queues_from_amqp(
    specs: Iterable[ConsumerSpec],
    settings: MessagingSettings = messaging_settings,
    timeout: float = DEFAULT_TIMEOUT,
) -> tuple[QueueStatus, ...]:
    """Ready counts and consumers of the consumer queues of ``specs`` by passive declares, then
    the queues their earlier shapes left behind; raises when no broker URL can be reached."""
    with connect(settings, "messaging_status", timeout=timeout) as connection:
        return _queues_on(connection, list(specs), settings)


def _queues_on(
    connection: pika.BlockingConnection, specs: list[ConsumerSpec], settings: MessagingSettings
) -> tuple[QueueStatus, ...]:
    found = []
    probe = PassiveProbe(connection)
    for queue in our_queues(specs, settings):
        if queue.kind == "dead":
            continue
        # (A classic queue whose node is down answers 404 too: it cannot be read now.)
        figures = probe.queue(queue.name)
        ready, consumers = figures or (None, None)
        found.append(
            QueueStatus(
                queue.name,
                queue.kind,
                queue.consumer,
                exists=figures is not None,
                ready=ready,
                consumers=consumers,
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
        for leftover in find_leftovers(connection, specs, settings)
    ]
    return tuple(found)


def secrets_of(settings: MessagingSettings, candidates: Iterable[pika.URLParameters]) -> list[str]:
    """Every password of the broker URLs, as pika reads it and as redact_url hides it."""
    found = [str(getattr(params.credentials, "password", "") or "") for params in candidates]
    return found + [_redacted_part(url) for url in settings.broker_urls]


def scrub_broker_secrets(text: str, settings: MessagingSettings = messaging_settings) -> str:
    """``text`` (a client library's error) scrubbed of the broker passwords, also when pika
    cannot parse a URL: a refusal may quote a vhost that holds one."""
    try:
        candidates = connection_parameters(settings)
    except Exception:  # noqa: BLE001 - pika raises several types for a bad URL
        candidates = []
    return scrub(text, *secrets_of(settings, candidates))


def describe_broker_error(
    exc: BaseException, settings: MessagingSettings = messaging_settings
) -> str:
    """:func:`describe_error` scrubbed of the broker passwords."""
    return scrub_broker_secrets(describe_error(exc), settings)


class BadBrokerURL(Exception):
    """A broker URL pika cannot parse (its text: the type of pika's error)."""


class BrokerUnreachable(Exception):
    """No broker URL answers (its text: why, scrubbed of the broker passwords)."""


def open_connection(
    settings: MessagingSettings, name: str, timeout: float
) -> tuple[pika.BlockingConnection, pika.URLParameters, list[str]]:
    """A connection to the first broker URL that answers, its parameters and the broker
    passwords; raises :class:`BadBrokerURL` or :class:`BrokerUnreachable`."""
    try:
        candidates = connection_parameters(settings, name=name)
    except Exception as exc:  # noqa: BLE001 - pika raises several types for a bad URL
        # The type only: pika's messages quote pieces of the URL, a password's among them.
        raise BadBrokerURL(type(exc).__name__) from None
    secrets = secrets_of(settings, candidates)
    try:
        connection, params = connect_to_any(candidates, timeout=timeout)
    except READ_ERRORS as exc:
        raise BrokerUnreachable(scrub(describe_error(exc), *secrets)) from exc
    return connection, params, secrets


def broker_status(
    specs: Iterable[ConsumerSpec] | None = None,
    *,
    settings: MessagingSettings = messaging_settings,
    management_url: str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> BrokerStatus:
    """The queues of ``specs`` (default: every registered consumer); ``management_url`` ""
    skips the management API."""
    shown = settings.broker_shown
    specs = list(registry.all() if specs is None else specs)
    try:
        connection, params, secrets = open_connection(settings, "messaging_status", timeout)
    except BadBrokerURL as exc:
        return BrokerStatus(shown, reachable=False, error=f"the URL cannot be parsed ({exc})")
    except BrokerUnreachable as exc:
        return BrokerStatus(shown, reachable=False, error=f"cannot connect to {shown}: {exc}")
    try:
        with connection:
            found = _queues_on(connection, specs, settings)
    except (pika.exceptions.AMQPError, OSError) as exc:
        error = f"cannot connect to {shown}: {scrub(describe_error(exc), *secrets)}"
        return BrokerStatus(shown, reachable=False, error=error)
    management_url = management_url_for(management_url, settings, params)
    if not management_url:
        note = "the management API was skipped (no URL given)"
    else:
        try:
            found = with_management_figures(found, params, management_url, timeout)
        except MANAGEMENT_ERRORS as exc:
            note = management_failure(exc, management_url, secrets)
        else:
            return BrokerStatus(shown, reachable=True, management_api=True, queues=found)
    return BrokerStatus(shown, reachable=True, queues=found, note=note)


def broker_connection_error(
    settings: MessagingSettings = messaging_settings, timeout: float = DEFAULT_TIMEOUT
) -> str:
    """Open and close one AMQP connection; "" when that worked, else why not, naming neither
    host, user nor password: health endpoints may be public."""
    try:
        connection, _, _ = open_connection(settings, "messaging_status", timeout)
    except BadBrokerURL as exc:
        return f"the broker URL cannot be parsed ({exc})"
    except BrokerUnreachable as exc:
        return str(exc)
    with connection:
        return ""
