"""A ``django.tasks`` backend whose enqueue is a ``publish()`` (sent if and only if the
transaction commits) and whose worker is ``manage.py consume`` (``docs/tasks.md``)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar, cast

from django.conf import settings
from django.db import router, transaction
from django.db.models import OuterRef, QuerySet, Subquery
from django.utils import timezone
from django.utils.module_loading import import_string

from ..choices import OutboxStatus, TaskRunStatus
from ..core.envelope import PRIORITY_HEADER
from ..core.priorities import amqp_priority
from ..core.registry import ConsumerRegistry, registry
from ..core.uuid7 import new_message_id
from ..models import OutboxMessage, TaskRun
from ..publishing.publish import publish
from ..task_runs.framework import (
    BaseTaskBackend,
    InvalidTask,
    Task,
    TaskResult,
    TaskResultDoesNotExist,
    task_backends,
    task_enqueued,
)
from ..task_runs.naming import TaskQueues, is_task_id, problems
from ..task_runs.policies import ReliableTask, task_policy_problems
from ..task_runs.results import NotJSON, json_value, result_of, task_at
from ..task_runs.worker import consumer_specs

T = TypeVar("T")
P = ParamSpec("P")


class ReliableTaskBackend(BaseTaskBackend):
    """Tasks as messages of the outbox, run once each by ``manage.py consume``."""

    supports_defer = True  # run_after is the outbox's scheduled delivery
    supports_get_result = True  # every attempt is written to TaskRun rows any process reads
    # A task's priority is its message's AMQP priority, which the task queues are declared to
    # honour where the broker can (docs/tasks.md#priorities).
    supports_priority = True
    # An async def task runs on the delivery's worker thread as an async def handler does
    # (core/coroutines.py): its ORM calls (the async ORM, sync_to_async's thread-sensitive
    # default) come back to that thread, so to its connection and transaction.
    supports_async_task = True
    # @task(max_attempts=..., retry_delays=...) where the decorator passes them (Django 6.1,
    # the backport); OPTIONS["TASK_RETRIES"] everywhere (task_runs/policies.py).
    task_class = ReliableTask

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        self.task_queues = TaskQueues.of(alias, params)

    def validate_task(self, task: Task[Any, Any]) -> None:
        """The framework's checks, and the task's own retry policy (``InvalidTask``)."""
        super().validate_task(task)
        found = task_policy_problems(task)
        if found:
            raise InvalidTask(" ".join(found))

    def enqueue(
        self,
        task: Task[P, T],
        args: P.args,  # type: ignore[valid-type]
        kwargs: P.kwargs,  # type: ignore[valid-type]
    ) -> TaskResult[T]:
        """Write the result row and publish its message in the current transaction of the
        database ``TaskRun`` is routed to (a transaction of its own outside one)."""
        self.validate_task(task)
        _check_importable(task)
        try:
            stored_args, stored_kwargs = json_value(list(args)), json_value(dict(kwargs))
        except NotJSON as exc:
            raise InvalidTask(f"the arguments of {task.module_path} must be JSON: {exc}") from exc
        using = router.db_for_write(TaskRun)
        task_id = new_message_id()
        run_after = _aware(task.run_after)
        # No savepoint inside the caller's transaction (two round trips of its own): if a
        # write fails, the caller's transaction can only roll back, so never commits half.
        with transaction.atomic(using=using, savepoint=False):
            run = TaskRun.objects.using(using).create(
                id=task_id,
                backend=self.alias,
                task_path=task.module_path,
                queue_name=task.queue_name,
                priority=task.priority,
                args=stored_args,
                kwargs=stored_kwargs,
                run_after=run_after,
                enqueued_at=timezone.now(),
            )
            self._publish(run, run_after)
        result: TaskResult[T] = result_of(run, task)
        # Enqueued means committed: a rolled-back task was never enqueued, nor signalled.
        transaction.on_commit(
            lambda: task_enqueued.send(type(self), task_result=result), using=using, robust=True
        )
        return result

    def _publish(self, run: TaskRun, deliver_at: dt.datetime | None) -> None:
        """The task's message, in the current transaction of the run's database."""
        publish(
            self.task_queues.amqp_queue(run.queue_name),
            {"task_id": run.id, "task": run.task_path},
            # To its queue alone: a queue gone (deleted, expired) returns it, and the outbox
            # keeps it until the queue is back, where an event would be unrouted.
            exchange="",
            message_id=run.id,
            # The relay sends it as the message's priority property.
            headers={PRIORITY_HEADER: amqp_priority(run.priority)},
            deliver_at=deliver_at,
            using=run._state.db,
        )

    def send_again(self, run: TaskRun) -> None:
        """Publish ``run``'s message once more, due now, under its id: the inbox of its queue's
        consumer runs the task at most once however many copies arrive."""
        self._publish(run, None)

    def get_result(self, result_id: str) -> TaskResult:
        """The stored result of ``result_id`` (raises ``TaskResultDoesNotExist``)."""
        if not is_task_id(result_id):  # an id from a URL, say, that no statement could carry
            raise TaskResultDoesNotExist(result_id)
        run = TaskRun.objects.using(router.db_for_read(TaskRun)).filter(pk=result_id).first()
        if run is None:
            raise TaskResultDoesNotExist(result_id)
        return result_of(run)


@dataclass
class SentAgain:
    """What :func:`send_ready_again` did with the tasks it was given."""

    sent: int = 0
    not_ready: int = 0  # running or finished: nothing to send
    in_outbox: int = 0  # its message has not left the outbox (waiting, scheduled, failed)
    no_backend: int = 0  # TASKS no longer names its backend as one of ours


def send_ready_again(runs: QuerySet[TaskRun]) -> SentAgain:
    """Publish again, in one transaction, the message of each READY task whose message left
    the outbox (sent, or purged since): a message the broker lost (a queue an operator
    purged, a node's disk) leaves its task READY for ever. The others are counted."""
    using = runs.db
    done = SentAgain()
    ours = reliable_backends()
    newest = OutboxMessage.objects.using(using).filter(message_id=OuterRef("pk")).order_by("-pk")
    with transaction.atomic(using=using):
        for run in runs.annotate(message_status=Subquery(newest.values("status")[:1])):
            if run.status != TaskRunStatus.READY:
                done.not_ready += 1
            elif run.message_status not in (None, OutboxStatus.SENT, OutboxStatus.UNROUTED):
                done.in_outbox += 1
            elif run.backend not in ours:
                done.no_backend += 1
            else:
                cast(ReliableTaskBackend, task_backends[run.backend]).send_again(run)
                done.sent += 1
    return done


def _check_importable(task: Task[Any, Any]) -> None:
    """The worker finds the task by its module path: refuse one it could not find."""
    path = task.module_path
    if task.func.__module__ == "__main__":
        raise InvalidTask(f"{path}: a task of __main__ cannot be imported by the worker")
    try:
        found = task_at(path)
    except (ImportError, InvalidTask) as exc:
        raise InvalidTask(f"{path} cannot be imported by the worker: {exc}") from exc
    if found.func is not task.func:
        raise InvalidTask(f"{path} names another function than this task's in its module")


def _aware(when: dt.datetime | None) -> dt.datetime | None:
    if when is None or timezone.is_aware(when):
        return when
    return timezone.make_aware(when)  # USE_TZ=False: the framework allows a naive time


def reliable_backends() -> dict[str, Mapping[str, Any]]:
    """The ``TASKS`` entries whose backend is (a subclass of) :class:`ReliableTaskBackend`."""
    found: dict[str, Mapping[str, Any]] = {}
    for alias, params in (getattr(settings, "TASKS", None) or {}).items():
        try:
            backend = import_string(params["BACKEND"])
        except (ImportError, KeyError, TypeError):
            continue  # the framework reports a backend it cannot find
        if isinstance(backend, type) and issubclass(backend, ReliableTaskBackend):
            found[alias] = params
    return found


def register_task_consumers(consumers: ConsumerRegistry = registry) -> None:
    """Register the consumers of the task queues of every backend of ours in ``TASKS`` (the
    app does at start), for ``manage.py consume``; a ``TASKS`` entry the system checks refuse
    is left for them to report."""
    for alias, params in reliable_backends().items():
        if not problems(alias, params):
            for spec in consumer_specs(TaskQueues.of(alias, params)):
                consumers.register(spec)
