"""One typed settings object over ``settings.RELIABLE_MESSAGING``, read at access time; each
setting is declared once, as a :class:`Setting` (``docs/design.md#settings``)."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Generic, TypeVar, cast, overload

from django.conf import settings as django_settings

from .core.breaker import Breaker
from .exceptions import ConsumerConfigurationError

T = TypeVar("T")


def redact_url(url: str) -> str:
    """Return ``url`` with any password replaced by ``***``; never raises.

    Works on the text, not on a parse (``urlsplit`` puts a malformed URL's password in the host
    or path): everything from the first ``:`` after ``scheme://`` to the last ``@`` is hidden."""
    first_at = url.find("@")
    if first_at < 0:
        return url  # nothing can separate credentials from the host
    scheme_end = url.find("://", 0, first_at)
    start = scheme_end + 3 if scheme_end >= 0 else 0
    last_at = url.rfind("@")
    colon = url.find(":", start, last_at)
    if colon < 0:
        return url  # a user name without a password
    return f"{url[: colon + 1]}***{url[last_at:]}"


# Where one URL of a ``;``-joined BROKER_URL ends: any other ``;`` may be in a password.
_URL_SEPARATOR = re.compile(r";(?=\s*amqps?://)", re.IGNORECASE)


def split_broker_urls(value: Any) -> list[str]:
    """``BROKER_URL`` as a list of URLs (a string cut at :data:`_URL_SEPARATOR`)."""
    if isinstance(value, list | tuple):
        return [str(url).strip() for url in value if str(url).strip()]
    pieces = (url.strip().strip(";").strip() for url in _URL_SEPARATOR.split(str(value)))
    return [url for url in pieces if url]


# --------------------------------------------------------------------------- rules
# A rule's complaint follows "RELIABLE_MESSAGING['KEY'] "; check ids and hints are stable.


@dataclass(frozen=True)
class Rule:
    """A valid value and the check ``E<id>`` reporting others: ``problem`` returns the complaint
    or None, never raises; ``hint`` None means "The default is <default>."."""

    id: int
    problem: Callable[[Any], str | None]
    hint: str | None = None


@dataclass(frozen=True)
class CheckedBy:
    """A setting judged by the function ``function`` of :mod:`.checks` (it needs more than the
    value, or reports several ids)."""

    function: str


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _judged(check_id: int, hint: str | None, fits: Callable[[Any], bool], what: str) -> Rule:
    """A rule saying "must be <what>, got <value>." of a value that does not fit."""
    return Rule(
        check_id, lambda value: None if fits(value) else f"must be {what}, got {value!r}.", hint
    )


def integer(
    check_id: int,
    minimum: int,
    maximum: int | None = None,
    *,
    hint: str | None = None,
    what: str = "",
) -> Rule:
    """An int (not a bool, not a float) from ``minimum`` (to ``maximum``)."""
    top = math.inf if maximum is None else maximum
    bounds = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"

    def fits(value: Any) -> bool:
        return _is_number(value) and isinstance(value, int) and minimum <= value <= top

    return _judged(check_id, hint, fits, what or f"an integer {bounds}")


def seconds(check_id: int, *, hint: str, zero_allowed: bool = False) -> Rule:
    """A number of seconds (int or float), positive or, with ``zero_allowed``, >= 0."""
    what = "a number of seconds >= 0" if zero_allowed else "a positive number of seconds"

    def fits(value: Any) -> bool:
        return _is_number(value) and (value >= 0 if zero_allowed else value > 0)

    return _judged(check_id, hint, fits, what)


def duration(check_id: int, *, hint: str, none_allowed: bool = False) -> Rule:
    """A positive ``timedelta`` or, with ``none_allowed``, None."""

    def fits(value: Any) -> bool:
        if none_allowed and value is None:
            return True
        return isinstance(value, timedelta) and value > timedelta(0)

    what = "None or a positive timedelta" if none_allowed else "a positive timedelta"
    return _judged(check_id, hint, fits, what)


def one_of(check_id: int, choices: Sequence[object], *, hint: str) -> Rule:
    shown = [repr(choice) for choice in choices]
    what = " or ".join([", ".join(shown[:-1]), shown[-1]]) if len(shown) > 1 else shown[0]
    return _judged(check_id, hint, lambda value: value in choices, what)


def boolean(check_id: int, *, hint: str) -> Rule:
    """True or False, not merely truthy: ``"no"`` would read as True."""
    return _judged(check_id, hint, lambda value: isinstance(value, bool), "True or False")


def non_empty_string(check_id: int, *, hint: str) -> Rule:
    def problem(value: Any) -> str | None:
        fits = isinstance(value, str) and bool(value.strip())
        return None if fits else "must be a non-empty string."

    return Rule(check_id, problem, hint)


def increasing_seconds(check_id: int, *, hint: str) -> Rule:
    """A non-empty sequence (not a string) of positive numbers in increasing order."""

    def problem(value: Any) -> str | None:
        if isinstance(value, str | bytes) or not isinstance(value, Sequence) or not value:
            return f"must be a non-empty list of seconds, got {value!r}."
        if not all(_is_number(d) and d > 0 for d in value):
            return f"must hold only positive numbers, got {list(value)!r}."
        if list(value) != sorted(value):
            return f"must be in increasing order, got {list(value)!r}."
        return None

    return Rule(check_id, problem, hint)


def _topic_patterns_problem(value: Any) -> str | None:
    # A list (not one string) of non-empty patterns with no empty word between the dots.
    if isinstance(value, list | tuple) and all(
        isinstance(p, str) and p and "" not in p.split(".") for p in value
    ):
        return None
    return (
        "must be a list of topic patterns (words separated by '.', '*' for one word, '#' for "
        f"any), got {value!r}."
    )


def _token_problem(value: Any) -> str | None:
    # Not the value in the message: it is a password.
    if value is None or (isinstance(value, str) and len(value) >= 16):
        return None
    return (
        "must be a string of at least 16 characters or None (it is a password for the "
        "metrics/ and healthz/ views)."
    )


def _trace_url_problem(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.startswith(("http://", "https://")):
        return "must be None or an http:// or https:// URL template."
    if "{trace_id}" not in value:
        return "must hold {trace_id}, where the trace's id goes."
    try:
        value.format(trace_id="0" * 32, span_id="0" * 16)
    except (KeyError, IndexError, ValueError) as exc:
        return f"is not a template of {{trace_id}} and {{span_id}} only ({exc!r})."
    return None


def _breaker_problem(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        return f"must be None or a dict of the Breaker's fields, got {value!r}."
    try:
        Breaker.from_mapping(value)
    except (ConsumerConfigurationError, TypeError) as exc:
        return f"is not a valid breaker: {exc}"
    return None


def _only_true(value: Any) -> bool:
    """On for the boolean ``True`` only, never for a truthy string such as ``"False"``."""
    return value is True


def _optional(convert: Callable[[Any], T]) -> Callable[[Any], T | None]:
    """``convert``, but None stays None."""
    return lambda value: None if value is None else convert(value)


def _token(value: Any) -> str | None:
    return str(value) if value else None


def _timedelta(value: Any) -> timedelta:
    return cast(timedelta, value)


@dataclass(frozen=True)
class Setting(Generic[T]):
    """One key of ``RELIABLE_MESSAGING``, declared once: read at access time as
    ``convert(value)``; ``doc`` is its reference paragraph, ``rule`` what the checks hold it to.
    ``key`` is the attribute's name in capitals unless given."""

    default: Any
    convert: Callable[[Any], T]
    doc: str
    rule: Rule | CheckedBy | None = None
    key: str = ""

    def __set_name__(self, owner: type[Any], name: str) -> None:
        if not self.key:
            object.__setattr__(self, "key", name.upper())

    @overload
    def __get__(self, instance: None, owner: type[Any]) -> Setting[T]: ...

    @overload
    def __get__(self, instance: MessagingSettings, owner: type[Any]) -> T: ...

    def __get__(self, instance: MessagingSettings | None, owner: type[Any]) -> Setting[T] | T:
        if instance is None:
            return self
        return self.convert(instance.get(self.key))

    def __set__(self, instance: MessagingSettings, value: Any) -> None:
        raise AttributeError(f"{self.key} is read from settings.RELIABLE_MESSAGING")


class MessagingSettings:
    """Typed, lazily-read view of ``settings.RELIABLE_MESSAGING``; the :class:`Setting`
    attributes are the declarations, in the reference's order."""

    broker_urls = Setting(
        "amqp://guest:guest@localhost:5672/%2F",
        split_broker_urls,
        "one URL, several joined by `;`, or a list of URLs (the nodes of a cluster), tried in a "
        "new random order on every connect; never logged with a password. A string is cut only "
        "at a `;` followed by `amqp://` or `amqps://`, so a password may hold `;` (and `@`, `:`); "
        "percent-encode `/`, `?`, `#` and `%` in it (`urllib.parse.quote(password, safe='')`)",
        CheckedBy("check_broker_urls"),
        key="BROKER_URL",
    )
    management_url = Setting(
        None,
        _optional(str),
        "the RabbitMQ management API (`http://rabbitmq:15672`), read by `messaging_status` and "
        "the broker check (`messaging_status --broker`, `consume` start); may carry a user "
        "tagged `monitoring` (`http://monitor:secret@rabbitmq:15672`), never logged with its "
        "password (None: the broker's host on 15672, or https on 15671 for `amqps://`, with "
        "the broker URL's credentials)",
        CheckedBy("check_management_url"),
    )
    exchange = Setting(
        "reliable_messaging",
        str,
        "the topic exchange `publish()` uses and consumers bind to",
        non_empty_string(2, hint="Name the topic exchange publish() uses, e.g. 'events'."),
    )
    prefetch = Setting(
        100,
        int,
        "unacked deliveries per consumer process (at least `--concurrency`); also the window "
        "of each ordered partition",
        integer(3, 1, 65535, hint="A value near 2-4x --concurrency is usual."),
    )
    retry_delays = Setting(
        (1, 5, 30, 120, 600),
        lambda value: tuple(map(float, value)),
        "seconds before attempt 2, 3, …; the last repeats. A retry waits that long as a "
        "scheduled outbox row",
        increasing_seconds(4, hint="Give increasing positive seconds, e.g. [1, 5, 30, 120, 600]."),
    )
    max_attempts = Setting(
        6,
        int,
        "attempts before a message becomes a dead letter (per handler: `max_attempts=`)",
        integer(5, 1, hint="1 means no retry; the default is 6."),
    )
    dedup_retention = Setting(
        timedelta(days=14),
        _timedelta,
        "how long the inbox remembers a processed message_id",
        duration(6, hint="e.g. timedelta(days=14)"),
    )
    outbox_retention = Setting(
        timedelta(days=7),
        _timedelta,
        "how long sent outbox rows are kept",
        duration(6, hint="e.g. timedelta(days=14)"),
    )
    dead_letter_retention = Setting(
        timedelta(days=30),
        _optional(_timedelta),
        "how long `purge_messages` keeps resolved and discarded dead letters after their last "
        "change; `None` keeps them for good (dead and replayed ones are never purged)",
        duration(6, hint="e.g. timedelta(days=90), or None to keep them", none_allowed=True),
    )
    task_result_retention = Setting(
        timedelta(days=14),
        _optional(_timedelta),
        "how long `purge_messages` keeps the result of a finished `django.tasks` task after it "
        "finished (one whose dead letter can still be replayed only once that letter is resolved "
        "or gone); `None` keeps them for good",
        duration(6, hint="e.g. timedelta(days=30), or None to keep them", none_allowed=True),
    )
    cache_alias = Setting(
        None,
        _optional(str),
        "a django-redis cache for the duplicate fast path (see [The Redis fast path]"
        "(../concepts.md#the-redis-fast-path)); give it short socket timeouts",
        CheckedBy("check_cache_alias"),
    )
    queue_type = Setting(
        "classic",
        str,
        "`classic` or `quorum` for the consumer queues, always declared with this type whatever "
        "the vhost's default (quorum queues get `x-delivery-limit`)",
        one_of(8, ("classic", "quorum"), hint="Use 'quorum' for replicated queues."),
    )
    consumer_batch_size = Setting(
        50,
        int,
        "deliveries a handler thread commits in one transaction; `1` gives one transaction per "
        "delivery",
        integer(12, 1),
    )
    ordered_partitions = Setting(
        4,
        int,
        "partition queues of each ordered consumer; changing it remaps keys (order holds again "
        "once the backlog is handled); `consume` moves the messages of removed partitions",
        integer(12, 1),
    )
    quorum_delivery_limit = Setting(
        50,
        int,
        "quorum queues: past this many deliveries the broker moves a message to `<queue>.dead`, "
        "which `consume` stores as a `delivery_limit` dead letter (`<queue>.dead` has the same "
        "limit and moves what passes it to the classic `<queue>.dead.kept`, also consumed)",
        integer(12, 1),
    )
    handler_timeout = Setting(
        600.0,
        float,
        "seconds a handler may run (per handler: `timeout=`); past it the handler is "
        "interrupted, its transaction rolls back, and the attempt counts as failed (a dead "
        "letter `timeout` once attempts run out)",
        seconds(10, hint="e.g. 30"),
    )
    handler_timeout_grace = Setting(
        10.0,
        float,
        "seconds past the time limit after which a handler that cannot be interrupted (blocked "
        "in C) makes `consume` exit with code 3",
        seconds(10, hint="e.g. 10", zero_allowed=True),
    )
    crash_limit = Setting(
        3,
        int,
        "deaths of a consume process during one delivery before it becomes a dead letter "
        "(`worker_crashed`, or `timeout` after exits past the time limit); also for "
        "`@idempotent_task`",
        integer(12, 1),
    )
    # RabbitMQ's default consumer_timeout is 30 minutes.
    broker_consumer_timeout = Setting(
        1800.0,
        float,
        "the broker's `consumer_timeout` in seconds; nothing is held unacked longer than half "
        "of it, and the checks compare time limits and ordered retry horizons with it",
        seconds(10, hint="e.g. 30"),
    )
    ops_views_token = Setting(
        None,
        _token,
        "a secret (16 characters or more) that lets a request with `Authorization: Bearer "
        "<token>` read the web process's `messaging/metrics/` and `messaging/healthz/` (a "
        "Prometheus scrape config's `authorization`, a probe's headers); staff users logged in "
        "to the admin may read them always",
        Rule(
            46,
            _token_problem,
            'e.g. os.environ["MESSAGING_OPS_TOKEN"], made with '
            "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`",
        ),
    )
    ops_views_public = Setting(
        False,
        _only_true,
        "`True` lets anyone read those two views (when a proxy in front already restricts "
        'them); otherwise anyone else gets 403, also for any other value (`"False"` read '
        "from an environment variable, `1`): web servers run no system checks",
        boolean(47, hint="False (the default) keeps metrics/ and healthz/ to staff and the token."),
    )
    max_body_bytes = Setting(
        1024 * 1024,
        int,
        "larger deliveries are dead-lettered (`body_too_large`) without being decoded",
        integer(9, 1, hint="The default is 1048576 (1 MiB).", what="a positive integer"),
    )
    derive_message_id = Setting(
        False,
        _only_true,
        "`True` gives a message without message_id the id `sha256:<body hash>` instead of "
        "dead-lettering it; only when equal bodies always mean the same event. Any other value "
        '(`"False"` read from an environment variable, `1`) leaves it off',
        boolean(51, hint="True or False; False (the default) dead-letters a message without id."),
    )
    shutdown_timeout = Setting(
        30.0,
        float,
        "seconds a graceful stop waits for handlers in flight",
        seconds(10, hint="e.g. 30"),
    )
    reconnect_max_delay = Setting(
        30.0,
        float,
        "cap of the backoff between broker reconnects and database probes",
        seconds(10, hint="e.g. 30"),
    )
    heartbeat = Setting(
        60,
        int,
        "AMQP heartbeat, seconds",
        integer(11, 0, hint="0 disables heartbeats; 60 is usual."),
    )
    relay_poll_interval = Setting(
        1.0,
        float,
        "polling period of the relay when no NOTIFY wakes it (the only mode off PostgreSQL)",
        seconds(10, hint="e.g. 30"),
    )
    relay_listen_dsn = Setting(
        None,
        _optional(str),
        "a libpq connection string (`postgresql://db-primary:5432/shop` or "
        '`"host=db-primary port=5432"`) for the relay\'s LISTEN only; the parameters it gives '
        "replace those of `DATABASES`. Set it when the relay reaches PostgreSQL through a "
        "transaction-pooling PgBouncer, where LISTEN hears nothing: a direct session wakes the "
        "relay within milliseconds of a commit (None: LISTEN goes where `DATABASES` says, and "
        "the relay polls every `RELAY_POLL_INTERVAL` when a probe finds it deaf)",
        CheckedBy("check_relay_listen_dsn"),
    )
    relay_confirm_timeout = Setting(
        30.0,
        float,
        "seconds to wait for a batch's confirms before trying the rows again",
        seconds(10, hint="e.g. 30"),
    )
    relay_declares_topology = Setting(
        True,
        lambda value: value is not False,  # off for False only (its check reports the rest)
        "the relay declares the queues and bindings of every registered consumer before it "
        "sends (see [What the relay declares](../deploy.md#what-the-relay-declares)), so an "
        "event is never `unrouted` because `consume` started later. `False` for a relay whose "
        "broker user may not configure the vhost: then start `consume` first",
        boolean(54, hint="True (the default) or False."),
    )
    outbox_max_attempts = Setting(
        10,
        int,
        "failed sends (nack, unroutable command, missing exchange, refused by the broker) "
        "before a row is marked `failed`",
        integer(12, 1),
    )
    require_route = Setting(
        (),
        tuple,
        'topic patterns (`"billing.command.#"`) of routing keys that are commands and must '
        "reach a queue: unroutable, they are retried, then `failed`. Any other row is an event: "
        "unroutable (nobody subscribes yet) it is marked `unrouted` and not retried",
        Rule(
            45,
            _topic_patterns_problem,
            'e.g. ["billing.command.#", "*.charge"]; [] (the default) treats every '
            "unroutable row as an event nobody subscribes to yet.",
        ),
    )

    breaker = Setting(
        None,
        _optional(Breaker.from_mapping),
        "the circuit breaker of every consumer without its own `breaker=`: a dict of "
        "`failure_rate`, `window`, `min_failures`, `pause` (seconds), `probes` and "
        "`max_pause` (`{}` for the defaults 0.5, 100, 20, 30, 3, ten times the pause), or "
        "None for no breaker; see "
        "[The circuit breaker](../circuit-breaker.md)",
        Rule(
            53,
            _breaker_problem,
            'e.g. {"failure_rate": 0.5, "window": 100, "min_failures": 20, "pause": 30, '
            '"probes": 3}; None (the default) runs no breaker.',
        ),
    )

    trace_url_template = Setting(
        None,
        _optional(str),
        "a link to a trace in your tracing UI, with `{trace_id}` (and optionally `{span_id}`) "
        "where the ids go, e.g. `https://tempo.example.com/explore?traceId={trace_id}`: the "
        "dead letter admin links each failure's trace with it (None: the ids are shown "
        "without a link)",
        Rule(
            52,
            _trace_url_problem,
            'e.g. "https://jaeger.example.com/trace/{trace_id}"; None (the default) shows the '
            "ids without a link.",
        ),
    )

    def get(self, key: str) -> Any:
        """The value of ``key`` as given (not converted), or its declared default."""
        raw = getattr(django_settings, "RELIABLE_MESSAGING", None) or {}
        return raw.get(key, DEFAULTS[key]) if isinstance(raw, Mapping) else DEFAULTS[key]

    @property
    def broker_url(self) -> str:
        """The URLs as one ``;``-separated string (:func:`split_broker_urls` splits it)."""
        return ";".join(self.broker_urls)

    @property
    def broker_shown(self) -> str:
        """The URLs for a log line or a page: each with its password hidden."""
        return ", ".join(redact_url(url) for url in self.broker_urls)

    @property
    def max_hold_seconds(self) -> float:
        """How long a delivery may be held unacked: half the broker's consumer_timeout."""
        return self.broker_consumer_timeout / 2

    def __repr__(self) -> str:
        return f"<MessagingSettings broker={self.broker_shown} exchange={self.exchange}>"


SETTINGS: tuple[Setting[Any], ...] = tuple(
    value for value in vars(MessagingSettings).values() if isinstance(value, Setting)
)
"""Every declared setting, in the settings reference's order."""

DEFAULTS: dict[str, Any] = {setting.key: setting.default for setting in SETTINGS}
"""Each key's default, derived from the declarations."""

messaging_settings = MessagingSettings()
