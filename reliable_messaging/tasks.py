"""Celery: the ``relay_outbox`` task, and ``@idempotent_task`` for tasks that must take effect once.

``relay_outbox`` is for teams that schedule work with Celery beat instead of running processes.
Add it to the beat schedule::

    CELERY_BEAT_SCHEDULE = {
        "relay-outbox": {"task": "reliable_messaging.relay_outbox", "schedule": 5.0},
    }

Each run drains the outbox for at most ``max_seconds`` and returns a summary. Runs may overlap:
rows are claimed with ``SELECT ... FOR UPDATE SKIP LOCKED``, so no row is sent twice by two runs.

``@idempotent_task`` goes *below* Celery's own decorator, so every Celery option (``bind``,
``acks_late``, ``autoretry_for``, ``queue``...) works as usual::

    from celery import shared_task
    from reliable_messaging import idempotent_task

    @shared_task(acks_late=True)
    @idempotent_task(key=lambda order_id: f"receipt:{order_id}")
    def email_receipt(order_id: int) -> int:
        receipt = Receipt.objects.create(order_id=order_id)
        ...
        return receipt.pk

The body runs inside ``transaction.atomic()`` together with the insert of an inbox row
(``ProcessedMessage``), exactly like a consumer's handler: ``consumer`` is the scope (the
task's name unless ``scope=`` is given) and ``message_id`` the idempotency key. The insert comes
first, so a key that already took effect fails on the unique index before the body runs, and
a concurrent twin waits on that index until the first commits or rolls back. A body that raises
rolls back its effects and the inbox row together, so a retry runs it again.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar, overload

from celery import Task, current_task, shared_task
from django.db import IntegrityError, router, transaction

from . import metrics
from .models import ProcessedMessage
from .relay import OutboxRelay

logger = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")

# Longer keys, or keys the database cannot store as text (NUL, lone surrogates), are kept as
# HASHED_KEY_PREFIX + the SHA-256 of their UTF-8 bytes, which fits the column.
KEY_MAX_LENGTH = 255
HASHED_KEY_PREFIX = "sha256:"


@shared_task(name="reliable_messaging.relay_outbox", ignore_result=False)
def relay_outbox(max_seconds: float = 50.0, batch_size: int | None = None) -> dict[str, Any]:
    """Publish pending outbox rows until none is left or ``max_seconds`` have passed."""
    report = OutboxRelay(
        once=True, max_seconds=max_seconds, batch_size=batch_size, listen=False
    ).run()
    return {
        "sent": report.sent,
        "nacked": report.nacked,
        "unroutable": report.returned,
        "pending": report.left_pending,
        "failed": report.left_failed,
    }


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
    """The Celery task whose body is ``wrapper``, when that is the task running now.

    Celery pushes a task on its stack both when a worker (or ``apply()``) runs it and when it
    is called directly. Its ``run`` leads to our wrapper through ``__wrapped__`` layers when
    something wraps it (another decorator, Celery's own ``autoretry_for``)."""
    task = current_task._get_current_object() if current_task else None
    if task is None:
        return None
    body = getattr(task, "run", None)
    while body is not None:
        body = getattr(body, "__func__", body)  # a bound method when the task has bind=True
        if body is wrapper:
            return task
        body = getattr(body, "__wrapped__", None)
    return None


@overload
def idempotent_task(func: Callable[P, R], /) -> Callable[P, R | None]: ...


@overload
def idempotent_task(
    *,
    key: Callable[..., object] | None = None,
    scope: str | None = None,
    using: str | None = None,
) -> Callable[[Callable[P, R]], Callable[P, R | None]]: ...


def idempotent_task(
    func: Callable[P, R] | None = None,
    /,
    *,
    key: Callable[..., object] | None = None,
    scope: str | None = None,
    using: str | None = None,
) -> Any:
    """Make a Celery task take effect once per idempotency key. Put it below ``@shared_task``
    or ``@app.task``.

    ``key`` receives the task's arguments (without ``self`` for ``bind=True`` tasks) and
    returns the key, e.g. ``key=lambda order_id: f"receipt:{order_id}"``; without it the key is
    the Celery task id, which protects against redelivery of one task message (use
    ``acks_late=True``) but not against two ``delay()`` calls. Keys over 255 characters are
    stored hashed (see :func:`inbox_key`). ``scope`` is the deduplication scope, by default the
    task's name: keep it when renaming the task, or every key takes effect once more.
    ``using`` is the database alias of the inbox and the body's transaction.

    Returns the body's result; a skipped duplicate returns ``None`` (and is logged and
    counted as outcome ``duplicate``), so a caller that must tell them apart should have the
    body return something. Keys are remembered for ``DEDUP_RETENTION`` (``purge_messages``).
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
            if key is not None:
                bound_self = task is not None and bool(args) and args[0] is task
                raw_key = key(*(args[1:] if bound_self else args), **kwargs)
            else:
                raw_key = task.request.id if task is not None else None
                if not raw_key:
                    raise RuntimeError(
                        f"{name} has no Celery task id to deduplicate on: it was called "
                        f"directly, not through delay(), apply_async() or apply(). Give "
                        f"@idempotent_task a key=... to call it like this."
                    )
            message_id = inbox_key(raw_key)
            alias = using or router.db_for_write(ProcessedMessage)
            started = time.perf_counter()
            inserted = False
            try:
                with transaction.atomic(using=alias):
                    ProcessedMessage.objects.using(alias).create(
                        consumer=name, message_id=message_id
                    )
                    inserted = True
                    result = body(*args, **kwargs)
            except IntegrityError:
                if inserted:
                    raise  # the body's own IntegrityError: a failure like any other
                logger.info(
                    "duplicate message_id=%s task=%s task_id=%s: this key already took "
                    "effect, the body was skipped",
                    message_id,
                    name,
                    task.request.id if task is not None else "-",
                )
                metrics.consumer_outcome(name, "duplicate")
                return None
            duration = time.perf_counter() - started
            # Counted once committed: called inside a caller's transaction (eagerly, say), the
            # effect only happens if that one commits. Outside any, this runs at once.
            transaction.on_commit(
                lambda: metrics.consumer_outcome(name, "processed", duration), using=alias
            )
            logger.info(
                "processed message_id=%s task=%s outcome=processed duration_ms=%.1f",
                message_id,
                name,
                duration * 1000,
            )
            return result

        return run_once

    return decorate if func is None else decorate(func)
