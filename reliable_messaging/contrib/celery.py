"""Celery: ``@idempotent_task``, below Celery's own decorator, runs a task's body in one
transaction with its key's inbox row (``docs/design.md#celerys-idempotent-tasks``)."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, ParamSpec, TypeVar, overload

try:
    from celery import Celery, Task, current_app, current_task
    from celery.exceptions import Reject
    from celery.signals import before_task_publish
except ImportError as exc:  # the "celery" extra is not installed
    from ..exceptions import MissingExtra

    raise MissingExtra("reliable_messaging.idempotent_task", "celery", "celery") from exc
from django.db import DatabaseError, router, transaction

from .. import metrics, tracing
from ..choices import DeadLetterReason
from ..conf import messaging_settings
from ..consuming.crash_guard import CrashGuard
from ..core.backoff import Backoff
from ..core.database_errors import (
    CONFLICT_RETRIES,
    DatabaseTrouble,
    OutageLog,
    classify,
    conflict_delay,
    describe,
)
from ..core.envelope import CELERY_TASK_HEADER, CONTENT_TYPE, Delivery, jsonable
from ..core.outcomes import OutcomeLabel
from ..dead_letters.record import record_dead_letter
from ..exceptions import DatabaseUnavailable
from ..models import ProcessedMessage
from ..storage.inbox import claimed_atomic

logger = logging.getLogger(__name__)

# One WARNING per outage for the whole worker process, not a traceback per task.
_outage = OutageLog(logger)
# The first wait before a task held by an unavailable database runs again; the waits double up
# to RECONNECT_MAX_DELAY, and past the hold bound the message goes back to its queue.
UNAVAILABLE_PAUSE = 1.0

P = ParamSpec("P")
R = TypeVar("R")

KEY_MAX_LENGTH = 255
HASHED_KEY_PREFIX = "sha256:"

# Headers of a task's dead letter: they say it was a Celery task, not an AMQP delivery of ours.
CELERY_TASK_ID_HEADER = "celery-task-id"

# The wrappers @idempotent_task returned, for the system check (weak: tests drop theirs).
_idempotent_bodies: weakref.WeakSet[Callable[..., Any]] = weakref.WeakSet()


def inbox_key(key: object) -> str:
    """The inbox ``message_id`` for an idempotency key: ``str(key)`` itself when it fits the
    column and the database can store it, else ``"sha256:<hex>"`` of its UTF-8 bytes."""
    if key is None or key == "":
        raise ValueError("the idempotency key is empty: the key function returned nothing")
    text = str(key)
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError:
        data = text.encode("utf-8", "surrogatepass")
    else:
        if len(text) <= KEY_MAX_LENGTH and "\x00" not in text:
            return text
    return HASHED_KEY_PREFIX + hashlib.sha256(data).hexdigest()


def _running_task(wrapper: Callable[..., Any]) -> Task | None:
    """The Celery task whose body is ``wrapper`` (through any ``__wrapped__`` layers), when that
    is the task running now (by a worker, ``apply()`` or a direct call)."""
    task = current_task._get_current_object() if current_task else None
    if task is None:
        return None
    return task if any(body is wrapper for body in _bodies(task)) else None


def _bodies(task: Task) -> Iterator[Any]:
    """``task.run`` and the functions it wraps, outermost first."""
    body = getattr(task, "run", None)
    while body is not None:
        body = getattr(body, "__func__", body)  # a bound method when the task has bind=True
        yield body
        body = getattr(body, "__wrapped__", None)


@before_task_publish.connect(weak=False)
def _carry_trace(sender: str | None = None, headers: Any = None, **_: Any) -> None:
    """With tracing on, an idempotent task sent inside a trace carries its context (Celery's
    own instrumentation, when installed, has put it there already)."""
    if headers is None or not tracing.active():
        return
    task = current_app.tasks.get(sender) if sender else None
    if task is not None and any(body in _idempotent_bodies for body in _bodies(task)):
        tracing.inject_into_task(headers)


@dataclass(frozen=True)
class UnsafeTask:
    """An ``@idempotent_task`` whose Celery options let a killed pool child lose its key."""

    app: str
    task: str
    problems: tuple[str, ...]


def unsafe_idempotent_tasks(apps: Sequence[Celery] | None = None) -> list[UnsafeTask]:
    """The ``@idempotent_task`` tasks of ``apps`` (by default every Celery app of this process
    but Celery's unconfigured fallback) that a ``SIGKILL``-ed pool child would lose."""
    unsafe = []
    for app in _configured_apps() if apps is None else apps:
        if not app.finalized and not app.autofinalize:
            continue  # its tasks do not exist yet, and asking for them would raise
        for task in list(app.tasks.values()):
            if not any(body in _idempotent_bodies for body in _bodies(task)):
                continue
            problems = _unsafe_options(app, task)
            if problems:
                unsafe.append(UnsafeTask(app.main or "?", task.name, problems))
    return unsafe


def _configured_apps() -> list[Celery]:
    # Every app Celery created, but the fallback it makes up when none was configured: no
    # worker runs it, and its defaults would make every task look unsafe.
    from celery import _state

    active = getattr(_state, "_get_active_apps", None)  # private: absent, check nothing
    fallback = getattr(_state, "default_app", None)
    return [
        app
        for app in (list(active()) if active is not None else [])
        if not (app is fallback and not app.set_as_current)
    ]


def _unsafe_options(app: Celery, task: Task) -> tuple[str, ...]:
    def option(name: str) -> bool:
        value = getattr(task, name, None)  # the task's own, or the app's, copied when bound
        return bool(app.conf.get(f"task_{name}") if value is None else value)

    problems = []
    if not option("acks_late"):
        problems.append("acks_late is off, so the message is acked before the body runs")
    elif not option("reject_on_worker_lost"):
        problems.append(
            "reject_on_worker_lost is off, so the task of a killed child is acked as failed"
        )
    if option("retry_on_worker_lost"):
        # Its copy is a new message, which the crash guard never sees.
        problems.append(
            "retry_on_worker_lost is on, so once max_retries copies have died the task is "
            "acked as failed, with no dead letter"
        )
    return tuple(problems)


@overload
def idempotent_task(func: Callable[P, R], /) -> Callable[P, R | None]: ...


@overload
def idempotent_task(
    *, key: Callable[..., object] | None = None, scope: str | None = None, using: str | None = None
) -> Callable[[Callable[P, R]], Callable[P, R | None]]: ...


def idempotent_task(
    func: Callable[P, R] | None = None,
    /,
    *,
    key: Callable[..., object] | None = None,
    scope: str | None = None,
    using: str | None = None,
) -> Any:
    """Make a Celery task take effect once per idempotency key; put it below ``@shared_task``
    or ``@app.task``, with ``acks_late=True`` and ``reject_on_worker_lost=True``.

    ``key`` maps the task's arguments (without ``self``) to the key (default: the Celery task
    id); ``scope`` is the deduplication scope (default: the task's name); ``using`` the
    database alias. A skipped duplicate, or a task dead-lettered past ``CRASH_LIMIT`` deaths,
    returns ``None`` (``docs/operations.md`` and ``docs/delivery-outcomes.md`` say more).
    """
    if scope is not None and not 0 < len(scope) <= KEY_MAX_LENGTH:
        raise ValueError(f"scope must be 1 to {KEY_MAX_LENGTH} characters, got {scope!r}")

    def decorate(body: Callable[P, R]) -> Callable[P, R | None]:
        if isinstance(body, Task):
            raise TypeError(
                f"@idempotent_task was applied to the Celery task {body.name!r}; put it below "
                f"@shared_task / @app.task, directly on the function"
            )

        @functools.wraps(body)
        def run_once(*args: P.args, **kwargs: P.kwargs) -> R | None:
            task = _running_task(run_once)
            name = scope or (
                task.name if task is not None else body.__module__ + "." + body.__qualname__
            )
            task_args = args[1:] if task is not None and args and args[0] is task else args

            if key is not None:
                raw_key = key(*task_args, **kwargs)
            else:
                raw_key = task.request.id if task is not None else None
                if not raw_key:
                    raise RuntimeError(
                        f"{name} has no Celery task id to deduplicate on: it was called "
                        f"directly, not through delay(), apply_async() or apply(). Give "
                        f"@idempotent_task a key=... to call it like this."
                    )
            alias = using or router.db_for_write(ProcessedMessage)
            run = _Run(task, name, inbox_key(raw_key), alias)
            while True:
                try:
                    return _run_once_traced(body, args, kwargs, task_args, run)
                except _RunAgain:
                    continue

        _idempotent_bodies.add(run_once)
        return run_once

    return decorate if func is None else decorate(func)


def _run_once_traced(
    body: Callable[..., R],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    task_args: tuple[Any, ...],
    run: _Run,
) -> R | None:
    """One run of an idempotent task's body in its inbox transaction, in its trace."""
    task, name, message_id, alias = run.task, run.name, run.message_id, run.alias
    request = task.request if task is not None else None
    with tracing.running_task(request, name, message_id) as traced:
        guard = None
        if task is not None and _delivery_info(task).get("redelivered"):
            # A pool child may have died on it: the guard's mark commits before the
            # body's transaction opens, so it outlives a SIGKILL.
            guard = CrashGuard(messaging_settings.crash_limit, using=alias)
            try:
                looping = _dead_letter_if_crash_looping(
                    guard, task, name, message_id, task_args, kwargs
                )
            except DatabaseError as exc:
                if classify(exc) is DatabaseTrouble.UNAVAILABLE:
                    run.hold(exc, traced)
                raise
            if looping:
                traced.settle(OutcomeLabel.DEAD_LETTERED, DeadLetterReason.WORKER_CRASHED)
                return None  # Celery acks it, and the queue moves on
        try:
            result = _run_retrying_conflicts(
                functools.partial(_run_in_inbox, body, args, kwargs, run, traced), run
            )
        except BaseException as exc:
            if isinstance(exc, DatabaseError) and classify(exc) is DatabaseTrouble.UNAVAILABLE:
                # Not the task's failure: nothing is charged, the message goes back.
                if guard is not None:
                    _interrupted(guard, name, message_id)
                run.hold(exc, traced)
            # An exception is an outcome; SystemExit and MemoryError end the child, and
            # the redelivery counts the death as if it were a SIGKILL.
            outcome = isinstance(exc, Exception) and not isinstance(exc, MemoryError)
            if guard is not None and outcome:
                _forget(guard, name, message_id)
            raise
        _outage.recovered()
        if guard is not None:
            _forget(guard, name, message_id)
        return result


def _run_retrying_conflicts(attempt: Callable[[], R], run: _Run) -> R:
    """``attempt`` again in a new transaction (a bounded number of times, not charged to the
    task) on a deadlock or a serialization failure; inside a caller's transaction it raises at
    once."""
    for retry in range(CONFLICT_RETRIES + 1):
        try:
            return attempt()
        except DatabaseError as exc:
            if (
                classify(exc) is not DatabaseTrouble.CONFLICT
                or retry == CONFLICT_RETRIES
                or transaction.get_connection(run.alias).in_atomic_block
            ):
                raise
            delay = conflict_delay(retry)
            logger.info(
                "database conflict (%s) on message_id=%s task=%s: running again in a new "
                "transaction in %.2fs (%d of %d), not charged",
                describe(exc),
                run.message_id,
                run.name,
                delay,
                retry + 1,
                CONFLICT_RETRIES,
            )
            time.sleep(delay)
    raise AssertionError("unreachable")  # pragma: no cover


class _RunAgain(Exception):
    """The database was unavailable and the task, still held, runs again."""


class _Run:
    """An idempotent task's run: its Celery task (None when called directly), scope, inbox key
    and database alias, and the holds of a worker's task the database cannot take."""

    def __init__(self, task: Task | None, name: str, message_id: str, alias: str) -> None:
        self.task, self.name, self.message_id, self.alias = task, name, message_id, alias
        self.since = time.monotonic()
        self.waits = Backoff(UNAVAILABLE_PAUSE, messaging_settings.reconnect_max_delay)

    def hold(self, exc: DatabaseError, traced: tracing.TaskSpan) -> NoReturn:
        """Hold the task unacked and run it again after a wait, as ``consume`` holds a delivery,
        up to ``max_hold_seconds``; outside a worker, raise :class:`DatabaseUnavailable`."""
        traced.settle("held", "the database is unavailable")
        task = self.task
        if task is None or getattr(task.request, "is_eager", False):
            raise DatabaseUnavailable(
                f"database unavailable for message_id={self.message_id} task={self.name}: {exc}"
            ) from exc
        delay = self.waits.next()
        _outage.held([self.message_id], exc, delay)
        connection = transaction.get_connection(self.alias)
        if (
            connection.in_atomic_block
            or time.monotonic() - self.since + delay > messaging_settings.max_hold_seconds
        ):
            time.sleep(UNAVAILABLE_PAUSE)
            raise Reject(f"database unavailable: {exc}", requeue=True) from exc
        time.sleep(delay)
        connection.close()  # the next run opens a new one, as after a failover
        raise _RunAgain from exc


def _interrupted(guard: CrashGuard, scope: str, message_id: str) -> None:
    """The task was given back without an outcome, and the child lives on: no death to count."""
    try:
        guard.interrupted([(scope, message_id)])
    except DatabaseError:
        logger.debug("crash guard mark of message_id=%s task=%s left running", message_id, scope)


def _run_in_inbox(
    body: Callable[..., R],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    run: _Run,
    traced: tracing.TaskSpan,
) -> R | None:
    """Run ``body`` in one transaction with the insert of its inbox row; ``None`` without
    running it when the key already took effect."""
    name, message_id, alias = run.name, run.message_id, run.alias
    started = time.perf_counter()
    with claimed_atomic(alias, name, message_id) as fresh:
        if fresh:
            result = body(*args, **kwargs)
    if not fresh:
        logger.info(
            "duplicate message_id=%s task=%s task_id=%s: this key already took "
            "effect, the body was skipped",
            message_id,
            name,
            run.task.request.id if run.task is not None else "-",
        )
        metrics.consumer_outcome(name, OutcomeLabel.DUPLICATE)
        traced.settle(OutcomeLabel.DUPLICATE)
        return None
    duration = time.perf_counter() - started
    # Counted once committed: called inside a caller's transaction (eagerly, say), the
    # effect only happens if that one commits. Outside any, this runs at once.
    transaction.on_commit(
        lambda: metrics.consumer_outcome(name, OutcomeLabel.PROCESSED, duration), using=alias
    )
    traced.settle(OutcomeLabel.PROCESSED)
    logger.info(
        "processed message_id=%s task=%s outcome=processed duration_ms=%.1f",
        message_id,
        name,
        duration * 1000,
    )
    return result


def _delivery_info(task: Task) -> dict[str, Any]:
    """How the broker handed this task message out (``redelivered``: before too); eager runs
    have none."""
    return getattr(task.request, "delivery_info", None) or {}


def _forget(guard: CrashGuard, scope: str, message_id: str) -> None:
    """The task reached an outcome: drop the guard's mark (failing to is only logged)."""
    try:
        guard.finish([(scope, message_id)])
    except DatabaseError as exc:
        logger.warning(
            "crash guard mark of message_id=%s task=%s could not be removed",
            message_id,
            scope,
            # The database's own trouble is said once by the outage log: no traceback here.
            exc_info=classify(exc) is None,
        )


def _dead_letter_if_crash_looping(
    guard: CrashGuard,
    task: Task,
    scope: str,
    message_id: str,
    args: Sequence[Any],
    kwargs: dict[str, Any],
) -> bool:
    """Count the deaths on this redelivered task; past the limit (unless its key already took
    effect), store it as a dead letter, for the admin, instead of running it (``True``)."""
    suspicion = guard.begin(scope, message_id)
    if not suspicion.exceeds(guard.limit):
        return False
    if ProcessedMessage.objects.using(guard.using).has(scope, message_id):
        return False
    delivery_info = _delivery_info(task)
    payload = jsonable({"args": list(args), "kwargs": kwargs})
    delivery = Delivery(
        body=json.dumps(payload, ensure_ascii=False).encode("utf-8"),
        # Celery does not say which queue; its routing key names it in the usual set-up.
        queue=delivery_info.get("routing_key") or "celery",
        exchange="",
        routing_key=task.name,
        redelivered=True,
        message_id=message_id,
        content_type=CONTENT_TYPE,
        headers={
            CELERY_TASK_HEADER: task.name,
            CELERY_TASK_ID_HEADER: task.request.id,
            "celery-exchange": delivery_info.get("exchange") or "",
            "celery-routing-key": delivery_info.get("routing_key") or "",
        },
    )
    record_dead_letter(
        consumer=scope,
        delivery=delivery,
        message_id=message_id,
        reason=DeadLetterReason.WORKER_CRASHED,
        attempts=suspicion.deaths,
        payload=payload,
        exception_message=suspicion.describe(),
    )
    logger.error(
        "dead_lettered message_id=%s task=%s task_id=%s reason=worker_crashed deaths=%d: %s",
        message_id,
        scope,
        task.request.id,
        suspicion.deaths,
        suspicion.describe(),
    )
    metrics.consumer_outcome(scope, OutcomeLabel.DEAD_LETTERED)
    _forget(guard, scope, message_id)
    return True
