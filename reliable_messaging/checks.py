"""Django system checks: what a setting's own rule (in :mod:`.conf`) cannot tell, across
settings, and of the consumers and the databases."""

from __future__ import annotations

import difflib
import urllib.parse
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, Warning, register
from django.db import router
from django.utils.text import capfirst

from .conf import (
    DEFAULTS,
    SETTINGS,
    CheckedBy,
    Setting,
    messaging_settings,
    redact_url,
    split_broker_urls,
)
from .core.delays import delay_for
from .core.registry import ConsumerSpec, registry

SETTING = "RELIABLE_MESSAGING"


def _error(id_: int, msg: str, hint: str) -> Error:
    return Error(msg, hint=hint, id=f"reliable_messaging.E{id_:03d}")


def _warning(id_: int, msg: str, hint: str) -> Warning:
    return Warning(msg, hint=hint, id=f"reliable_messaging.W{id_:03d}")


def check_broker_urls(value: Any) -> list[CheckMessage]:
    """One URL, several joined by ``;``, or a list of URLs (the nodes of a cluster)."""
    if isinstance(value, list | tuple):
        urls: list[Any] = [url.strip() if isinstance(url, str) else url for url in value]
    elif isinstance(value, str):
        urls = split_broker_urls(value)
    else:
        urls = [value]
    if not urls:
        hint = "Give one amqp:// URL, several joined by ';', or a list of them."
        return [_error(1, f"{SETTING}['BROKER_URL'] holds no URL.", hint)]
    hint = "Use amqp://USER:PASSWORD@HOST:5672/VHOST (the default vhost is %2F)."
    problems = (_broker_url_problem(url) for url in urls)
    return [_error(1, f"{SETTING}['BROKER_URL'] {what}", hint) for what in problems if what]


def _broker_url_problem(value: Any) -> str | None:
    from .broker.topology import broker_host

    if not isinstance(value, str) or not value.startswith(("amqp://", "amqps://")):
        # Not repr() of another type: bytes or a dict may hold the password just the same.
        shown = redact_url(value) if isinstance(value, str) else f"a {type(value).__name__}"
        return f"is not an amqp:// or amqps:// URL: {shown}"
    try:
        if not broker_host(value):
            raise ValueError("no host")
    except Exception as exc:  # noqa: BLE001 - pika raises several types for bad URLs
        # Only the type: pika's messages quote pieces of the URL (a password holding a "/").
        return f"cannot be parsed ({type(exc).__name__}): {redact_url(value)}"
    if value.split("://", 1)[1].startswith("/") and "@" in value:
        # "amqp:///user:pw@mq": pika takes "user:pw@mq" for the vhost, which the broker quotes.
        return f"has no host, and its credentials would be taken for the vhost: {redact_url(value)}"
    return None


def check_cache_alias(alias: Any) -> list[CheckMessage]:
    """The duplicate fast path talks to Redis through django-redis's client: ``CACHE_ALIAS``
    must name a cache of ``CACHES`` that is one."""
    caches: dict[str, Any] = getattr(settings, "CACHES", {})
    if alias is None:
        return []
    if not isinstance(alias, str) or alias not in caches:
        message = f"{SETTING}['CACHE_ALIAS'] is {alias!r}, which names no cache in CACHES."
        hint = "Add a django-redis cache under that alias in CACHES, or set CACHE_ALIAS to None."
        return [_error(7, message, hint)]
    if not _is_django_redis(caches[alias]):
        backend = caches[alias].get("BACKEND") if isinstance(caches[alias], dict) else None
        message = (
            f"{SETTING}['CACHE_ALIAS'] is {alias!r}, whose BACKEND {backend!r} is not "
            "django-redis: the duplicate fast path talks to Redis through django-redis's client."
        )
        hint = "Use 'django_redis.cache.RedisCache' for that cache, or set CACHE_ALIAS to None."
        return [_error(13, message, hint)]
    return []


def check_relay_listen_dsn(value: Any) -> list[CheckMessage]:
    """None, or a connection string libpq (through psycopg 3) can parse."""
    if value is None:
        return []
    hint = (
        "Give a URL (postgresql://USER@HOST:5432/DBNAME) or key=value pairs "
        '("host=HOST port=5432") that reach PostgreSQL directly, not through a '
        "transaction-pooling PgBouncer; None lets the LISTEN go where DATABASES says."
    )
    if not isinstance(value, str) or not value.strip():
        return [_error(48, f"{SETTING}['RELAY_LISTEN_DSN'] must be a non-empty string.", hint)]
    try:
        from psycopg.conninfo import conninfo_to_dict
    except ImportError:
        what = "is set, but psycopg 3 (which the relay's LISTEN needs) is not installed."
        fix = 'pip install "reliable-messaging[postgres]", or remove the setting.'
        return [_error(48, f"{SETTING}['RELAY_LISTEN_DSN'] {what}", fix)]
    try:
        conninfo_to_dict(value)
    except Exception as exc:  # noqa: BLE001 - psycopg's ProgrammingError, or a type error
        # Only the type: the parser's message quotes pieces of the string, a password perhaps.
        what = f"cannot be parsed as a libpq connection string ({type(exc).__name__})."
        return [_error(48, f"{SETTING}['RELAY_LISTEN_DSN'] {what}", hint)]
    return []


def check_management_url(value: Any) -> list[CheckMessage]:
    """None, or an http:// or https:// URL with a host."""
    if value is None:
        return []
    hint = (
        "Give the management API's address, e.g. http://rabbitmq:15672 (with a user tagged "
        "monitoring: http://monitor:PASSWORD@rabbitmq:15672), or None to use the broker's host."
    )
    shown = redact_url(value) if isinstance(value, str) else f"a {type(value).__name__}"
    try:
        parts = urllib.parse.urlsplit(value) if isinstance(value, str) else None
        fits = parts is not None and parts.scheme in ("http", "https") and bool(parts.hostname)
        if parts is not None:
            parts.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError:
        fits = False
    message = f"{SETTING}['MANAGEMENT_URL'] is not an http:// or https:// URL: {shown}"
    return [] if fits else [_error(49, message, hint)]


# The functions that a declaration's conf.CheckedBy names, by name: conf cannot import this
# module (it imports conf).
CHECKED_HERE: dict[str, Callable[[Any], list[CheckMessage]]] = {
    "check_broker_urls": check_broker_urls,
    "check_cache_alias": check_cache_alias,
    "check_relay_listen_dsn": check_relay_listen_dsn,
    "check_management_url": check_management_url,
}


def _check_setting(setting: Setting[Any], value: Any) -> list[CheckMessage]:
    """The declared rule of one setting, applied to its value (as given, or the default)."""
    rule = setting.rule
    if rule is None:
        return []
    if isinstance(rule, CheckedBy):
        return CHECKED_HERE[rule.function](value)
    problem = rule.problem(value)
    if problem is None:
        return []
    hint = rule.hint if rule.hint is not None else f"The default is {setting.default}."
    return [_error(rule.id, f"{SETTING}[{setting.key!r}] {problem}", hint)]


def _unknown_keys(raw: Mapping[str, Any]) -> list[CheckMessage]:
    found: list[CheckMessage] = []
    for key in raw:
        if key not in DEFAULTS:
            close = difflib.get_close_matches(key, DEFAULTS, n=1)
            hint = f"Did you mean {close[0]!r}?" if close else ""
            hint = hint or f"Known keys: {', '.join(sorted(DEFAULTS))}."
            found.append(_warning(1, f"{SETTING} has an unknown key {key!r}; it is ignored.", hint))
    return found


@register(Tags.compatibility)
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Unknown keys, then each declared setting against its rule, then the checks across
    settings (and the registered consumers)."""
    raw = getattr(settings, SETTING, None)
    if raw is None:
        return []
    if not isinstance(raw, dict):
        hint = "Write RELIABLE_MESSAGING = {'BROKER_URL': ..., ...} in your settings."
        return [_error(0, f"{SETTING} must be a dict, got {type(raw).__name__}.", hint)]
    errors = _unknown_keys(raw)
    for setting in SETTINGS:
        errors += _check_setting(setting, messaging_settings.get(setting.key))
    # The cross-setting warnings need valid values (a mere warning does not hide them).
    if not any(message.is_serious() for message in errors):
        errors += _check_retention_horizon() + _check_consumer_timeout() + _check_crash_limit()
    return errors


def _check_crash_limit() -> list[CheckMessage]:
    """On quorum queues each death of a consumer counts toward the delivery limit of every
    message it held: the crash guard must dead-letter a killer before the broker does."""
    settings = messaging_settings
    if settings.queue_type != "quorum" or settings.crash_limit < settings.quorum_delivery_limit:
        return []
    return [
        _warning(
            16,
            f"{SETTING}['CRASH_LIMIT'] ({settings.crash_limit}) is not below "
            f"QUORUM_DELIVERY_LIMIT ({settings.quorum_delivery_limit}): a message that kills its "
            f"consumer reaches the broker's delivery limit first, and so may the messages an "
            f"ordered partition held with it.",
            f"Keep CRASH_LIMIT well below QUORUM_DELIVERY_LIMIT (defaults: "
            f"{DEFAULTS['CRASH_LIMIT']} and {DEFAULTS['QUORUM_DELIVERY_LIMIT']}).",
        )
    ]


def _check_consumer_timeout() -> list[CheckMessage]:
    """What may hold a delivery unacked must stay below the broker's consumer_timeout, or the
    broker closes the channel under the consumer (and redelivers the whole prefetch window)."""
    limit = messaging_settings.broker_consumer_timeout
    found: list[CheckMessage] = []
    timeouts = [("HANDLER_TIMEOUT", messaging_settings.handler_timeout)]
    timeouts += [(f"the timeout of {s.name!r}", s.timeout) for s in registry if s.timeout]
    for what, seconds in timeouts:
        if seconds + messaging_settings.handler_timeout_grace >= limit:
            found.append(
                _warning(
                    14,
                    f"{what} ({seconds:g}s, plus HANDLER_TIMEOUT_GRACE) reaches the broker's "
                    f"consumer_timeout ({limit:g}s, BROKER_CONSUMER_TIMEOUT): the broker would "
                    f"close the channel before the handler is stopped.",
                    "Lower the handler timeout, or raise consumer_timeout in rabbitmq.conf and "
                    "set BROKER_CONSUMER_TIMEOUT to match.",
                )
            )
    for spec in registry:
        if not spec.ordered:
            continue
        # An ordered consumer retries in place: the delivery stays unacked for every delay.
        horizon = _horizon(spec)
        if horizon >= messaging_settings.max_hold_seconds:
            found.append(
                _warning(
                    15,
                    f"Ordered consumer {spec.name!r} retries in place for up to {horizon:g}s, "
                    f"which reaches half of the broker's consumer_timeout ({limit:g}s): its "
                    f"delivery would be given back before its retries are through, and start "
                    f"over at attempt 1.",
                    "Shorten its retry_delays / max_attempts, or raise consumer_timeout in "
                    "rabbitmq.conf and BROKER_CONSUMER_TIMEOUT with it.",
                )
            )
    return found


def _is_django_redis(cache: Any) -> bool:
    backend = cache.get("BACKEND", "") if isinstance(cache, dict) else ""
    if backend == "django_redis.cache.RedisCache":
        return True
    try:
        from django.utils.module_loading import import_string
        from django_redis.cache import RedisCache

        return issubclass(import_string(backend), RedisCache)
    except Exception:  # noqa: BLE001 - not importable: not django-redis either
        return False


def _check_retention_horizon() -> list[CheckMessage]:
    """The inbox must remember a message at least as long as its copies can still arrive."""
    horizon = timedelta(seconds=max([_horizon(None), *map(_horizon, registry)]))
    if messaging_settings.dedup_retention < horizon:
        message = (
            f"{SETTING}['DEDUP_RETENTION'] ({messaging_settings.dedup_retention}) is shorter "
            f"than the retry horizon ({horizon}): a late redelivery could run a handler twice."
        )
        return [
            _warning(2, message, "Keep DEDUP_RETENTION well above the sum of the retry delays.")
        ]
    return []


def _horizon(spec: ConsumerSpec | None) -> float:
    """Seconds from a consumer's first attempt to its last (the settings' for None)."""
    delays = (spec and spec.retry_delays) or messaging_settings.retry_delays
    attempts = (spec and spec.max_attempts) or messaging_settings.max_attempts
    return sum(delay_for(attempt, delays) for attempt in range(1, attempts)) if delays else 0.0


@register(Tags.compatibility)
def check_consumers(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    return [
        _warning(
            3,
            f"Consumer {spec.name!r} on queue {spec.queue!r} has no bindings: it only receives "
            f"messages sent to the queue directly.",
            "Pass bindings=['some.routing.key'] to @consumer(...).",
        )
        for spec in registry
        if not spec.bindings
    ]


@register(Tags.compatibility)
def check_idempotent_tasks(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """``@idempotent_task`` tasks whose Celery options lose the key of a killed pool child."""
    import sys

    # Without contrib.celery imported no @idempotent_task exists: Celery is not imported here.
    if f"{__package__}.contrib.celery" not in sys.modules:
        return []
    from .contrib.celery import unsafe_idempotent_tasks

    return [
        _warning(
            20,
            f"@idempotent_task {unsafe.task!r} (Celery app {unsafe.app!r}) can lose its key "
            f"when a pool child is killed (OOM killer, SIGKILL): {'; '.join(unsafe.problems)}.",
            "Set task_acks_late=True and task_reject_on_worker_lost=True in the Celery app's "
            "config (CELERY_TASK_ACKS_LATE / CELERY_TASK_REJECT_ON_WORKER_LOST under the "
            "CELERY settings namespace), or acks_late=True, reject_on_worker_lost=True on the "
            "task, and leave retry_on_worker_lost off. A task that kills its child CRASH_LIMIT "
            "times then becomes a dead letter instead of coming back forever.",
        )
        for unsafe in unsafe_idempotent_tasks()
    ]


def _app_aliases() -> dict[str, str]:
    """The alias the database routers give for writing each of the app's models."""
    from .models import DeadLetter, OutboxMessage, ProcessedMessage

    return {
        model.__name__: router.db_for_write(model)
        for model in (ProcessedMessage, OutboxMessage, DeadLetter)
    }


def _app_databases() -> list[tuple[str, str, dict[str, Any]]]:
    """The alias, engine and ``OPTIONS`` of each database the app's models are written to."""
    # Read from settings, not ``connections``: a check must not open a connection, and the
    # engine's module path says the vendor (custom backends usually keep it in their path).
    databases: dict[str, Any] = getattr(settings, "DATABASES", {})
    found = []
    for alias in sorted(set(_app_aliases().values())):
        database = databases.get(alias, {})
        found.append((alias, str(database.get("ENGINE", "")), database.get("OPTIONS") or {}))
    return found


@register(Tags.compatibility)
def check_database_routing(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """The inbox row, a handler's effects, what it publishes and its dead letters commit in one
    transaction only when they share one database."""
    aliases = _app_aliases()
    found: list[CheckMessage] = []
    if len(set(aliases.values())) > 1:
        where = ", ".join(f"{model} to {alias!r}" for model, alias in aliases.items())
        found.append(
            _warning(
                30,
                f"The database routers send {where}: the inbox, the outbox and the dead "
                f"letters no longer commit in one transaction, so a rolled-back batch can leave "
                f"outbox rows or dead letters behind on one database while the inbox row, which "
                f"stops a redelivery from running the handler again, is gone from the other.",
                "Route ProcessedMessage, OutboxMessage and DeadLetter to the same alias: the one "
                "your handlers write to.",
            )
        )
    inbox = aliases["ProcessedMessage"]
    if inbox != "default" and len(getattr(settings, "DATABASES", {})) > 1:
        found.append(
            _warning(
                31,
                f"The database routers send the inbox (ProcessedMessage) to {inbox!r} while "
                f"DATABASES has several aliases: a handler's transaction is the inbox's, on "
                f"{inbox!r}. What a handler writes on another alias commits apart from it, so a "
                f"batch that is rolled back and redone (a failed handler, a lost connection) "
                f"applies those effects again.",
                f"The inbox must live in the database the handlers write to: route "
                f"reliable_messaging's models to it, or make sure every handler writes only to "
                f"{inbox!r} (effects elsewhere must be idempotent on their own). Silence this "
                f"warning with SILENCED_SYSTEM_CHECKS once that holds.",
            )
        )
    return found


_ABOVE_READ_COMMITTED = {"REPEATABLE_READ", "SERIALIZABLE"}


def _isolation_name(engine: str, value: Any) -> str:
    """The isolation level an ``OPTIONS['isolation_level']`` asks for, as an upper-case name."""
    if isinstance(value, str):  # MySQL's form: "repeatable read"
        return value.strip().upper().replace(" ", "_").replace("-", "_")
    if "postgresql" in engine or "postgis" in engine:
        try:
            from django.db.backends.postgresql.psycopg_any import IsolationLevel

            # The enum of whichever psycopg Django uses, so psycopg 2's numbering works too.
            return str(IsolationLevel(value).name)
        except (ImportError, ValueError):
            pass
    return str(getattr(value, "name", value)).upper()


@register(Tags.compatibility)
def check_isolation_level(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """The inbox claim and ``publish(idempotency_key=...)`` rely on READ COMMITTED's handling of
    a concurrent insert of the same key: wait for it, then see it."""
    found: list[CheckMessage] = []
    for alias, engine, options in _app_databases():
        if "isolation_level" not in options:
            continue
        level = _isolation_name(engine, options["isolation_level"])
        if level == "REPEATABLE_READ" and ("postgresql" in engine or "postgis" in engine):
            found.append(
                _error(
                    34,
                    f"DATABASES[{alias!r}]['OPTIONS']['isolation_level'] is REPEATABLE READ: the "
                    f"inbox is partitioned by day on PostgreSQL, and a copy of a message claimed "
                    f"while another copy, in the previous day's partition, has not committed "
                    f"yet waits for it but then reads a snapshot taken before it committed: "
                    f"both copies would take effect.",
                    "Use READ COMMITTED (PostgreSQL's default) on the alias the app's models use, "
                    "or SERIALIZABLE, which detects the conflict.",
                )
            )
            continue
        if level in _ABOVE_READ_COMMITTED:
            found.append(
                _warning(
                    32,
                    f"DATABASES[{alias!r}]['OPTIONS']['isolation_level'] is {level}: when two "
                    f"copies of a message are handled at once, the second one's inbox insert "
                    f"fails with a serialization failure (not a quiet 'duplicate'), which the "
                    f"consumer reports as the database being unavailable and retries; and "
                    f"publish(idempotency_key=...) racing another publish of the same key raises "
                    f"IntegrityError into the caller's transaction.",
                    "Use READ COMMITTED (PostgreSQL's default) on the alias the app's models use; "
                    "take stricter isolation in your own code with a separate alias or an "
                    "explicit SET TRANSACTION where you need it.",
                )
            )
    return found


# RETURNING (the inbox claim, the relay's batch claim) came in SQLite 3.35; Django 5.2 runs on
# 3.31, so the version Python links against must be checked here.
SQLITE_RETURNING = (3, 35, 0)


@register(Tags.compatibility)
def check_sqlite(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """SQLite is a development mode: it needs RETURNING, and IMMEDIATE transactions so that
    several processes wait for the write lock instead of failing with ``database is locked``."""
    import sqlite3

    found: list[CheckMessage] = []
    for alias, engine, options in _app_databases():
        if "sqlite3" not in engine:
            continue
        if sqlite3.sqlite_version_info < SQLITE_RETURNING:
            found.append(
                _error(
                    30,
                    f"DATABASES[{alias!r}] is SQLite {sqlite3.sqlite_version}, older than 3.35: "
                    f"the inbox and the relay need INSERT/UPDATE ... RETURNING.",
                    "Use a Python linked against SQLite 3.35 or newer (e.g. a current Python "
                    "build or the pysqlite3-binary package), or PostgreSQL.",
                )
            )
        if str(options.get("transaction_mode", "")).upper() != "IMMEDIATE":
            found.append(
                _warning(
                    33,
                    f"DATABASES[{alias!r}] is SQLite without OPTIONS['transaction_mode'] = "
                    f"'IMMEDIATE': when consume, relay and web processes share the file, a "
                    f"transaction that reads and then writes fails with 'database is locked' "
                    f"instead of waiting, and its deliveries come back as duplicates and retries.",
                    "Set DATABASES[alias]['OPTIONS'] = {'transaction_mode': 'IMMEDIATE', "
                    "'timeout': 20}. SQLite is for development: it ignores SKIP LOCKED, so "
                    "overlapping relays may send a row twice (consumers deduplicate it).",
                )
            )
    return found


@register(Tags.compatibility, deploy=True)
def check_broker_max_message_size(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """``check --deploy``: the broker takes a body of ``MAX_BODY_BYTES`` (RabbitMQ 4 refuses
    more than 16 MiB by default), so that ``publish()`` never accepts what it would refuse."""
    from .broker.findings import body_limit_under_setting
    from .broker.limits import ask_broker

    limit = messaging_settings.max_body_bytes
    refused, unreachable = ask_broker(limit)
    if unreachable is not None:
        message = (
            f"The broker's max_message_size could not be compared with {SETTING}"
            f"['MAX_BODY_BYTES'] ({limit}): the broker did not answer ({unreachable})."
        )
        hint = "Run the check where the broker is reachable, or run "
        return [_warning(50, message, hint + "`manage.py messaging_status --broker`.")]
    if refused is None:
        return []
    message, fix = body_limit_under_setting(refused, limit)
    return [_error(50, f"{capfirst(message)}.", f"{capfirst(fix)}.")]


@register(Tags.compatibility)
def check_task_backends(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """The ``TASKS`` entries of our ``django.tasks`` backend that cannot work."""
    tasks = getattr(settings, "TASKS", None) or {}
    if not isinstance(tasks, Mapping):
        return []  # the framework's own to report
    try:
        from .contrib.task_backend import reliable_backends
    except ImportError as exc:
        ours = sorted(
            alias
            for alias, params in tasks.items()
            if isinstance(params, Mapping)
            and str(params.get("BACKEND", "")).startswith(f"{__package__}.")
        )
        if not ours:
            return []
        return [
            _error(
                60,
                f"TASKS {ours!r} name reliable_messaging's task backend, but the task framework "
                f"cannot be imported ({exc}).",
                "On Django 5.2 install the django-tasks backport: pip install "
                "'reliable-messaging[tasks]'. Django 6.0 and later have django.tasks built in.",
            )
        ]
    from .models import TaskRun
    from .task_runs.naming import TaskQueues, problems
    from .task_runs.policies import named_task_problems

    found: list[CheckMessage] = []
    for alias, params in reliable_backends().items():
        # The tasks TASK_RETRIES names are imported only for a configuration otherwise valid.
        said = problems(alias, params) or named_task_problems(alias, TaskQueues.of(alias, params))
        found.extend(
            _error(61, problem, "See docs/tasks.md for the backend's QUEUES and OPTIONS.")
            for problem in said
        )
    if reliable_backends():
        aliases = _app_aliases()
        runs = router.db_for_write(TaskRun)
        if {aliases["ProcessedMessage"], aliases["OutboxMessage"]} != {runs}:
            found.append(
                _error(
                    62,
                    f"The database routers send TaskRun to {runs!r}, the inbox to "
                    f"{aliases['ProcessedMessage']!r} and the outbox to "
                    f"{aliases['OutboxMessage']!r}: a task is enqueued with its outbox row and "
                    f"runs with its inbox row, each in one transaction, only when all three "
                    f"share one database.",
                    "Route TaskRun, ProcessedMessage and OutboxMessage to the same alias, the "
                    "one your tasks and the code that enqueues them write to.",
                )
            )
    return found
