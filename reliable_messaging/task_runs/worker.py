"""Running tasks in the consumer: the handler of the task queues' consumers, and what the
consumer's stage of tasks (:mod:`reliable_messaging.consuming.task_runs`) writes and signals
around each attempt."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterable
from typing import Any

from django.db import DatabaseError, router
from django.utils import timezone

from ..core.envelope import Message
from ..core.registry import ConsumerSpec
from ..exceptions import DatabaseUnavailable, PermanentError
from ..models import TaskRun
from .framework import TaskContext, TaskResultStatus, task_backends, task_finished, task_started
from .naming import TaskQueues, task_id_of
from .results import NotJSON, error_of, json_value, result_of, task_of

logger = logging.getLogger(__name__)


class TaskRunMissing(PermanentError):
    """The message names a task whose row is not in the database (deleted, or another
    database): nothing to run, so a dead letter at once."""

    def __init__(self, task_id: str = "") -> None:
        super().__init__(f"no TaskRun {task_id!r}: the task's row is gone")


class ReturnValueNotJSON(PermanentError):
    """The task returned what JSON cannot hold: it would fail the same way again."""

    def __init__(self, detail: str = "the task's return value is not JSON") -> None:
        super().__init__(detail)


def worker_id() -> str:
    """This process, as the results' ``worker_ids`` name it (computed at each call: a forked
    child is another worker)."""
    return f"{socket.gethostname()}:{os.getpid()}"[:64]


def run_task(message: Message) -> None:
    """The handler of every task queue: run the task, in the delivery's transaction with its
    inbox row, and write SUCCESSFUL and its return value in that transaction."""
    task_id = task_id_of(message)
    if task_id is None:
        raise PermanentError(f"message_id={message.message_id} names no task_id")
    using = router.db_for_write(TaskRun)
    run = TaskRun.objects.using(using).filter(pk=task_id).first()
    if run is None:
        raise TaskRunMissing(task_id)
    task = task_of(run)
    if task.takes_context:
        value = task.call(TaskContext(task_result=result_of(run, task)), *run.args, **run.kwargs)
    else:
        value = task.call(*run.args, **run.kwargs)
    try:
        stored = json_value(value)
    except NotJSON as exc:
        raise ReturnValueNotJSON(str(exc)) from exc
    TaskRun.objects.using(using).succeed(task_id, stored, timezone.now())


def consumer_specs(queues: TaskQueues) -> list[ConsumerSpec]:
    """One consumer per task queue of a backend, bound by the queue's own name."""
    return [
        ConsumerSpec(
            name=queues.consumer_name(queue_name),
            queue=queues.amqp_queue(queue_name),
            handler=run_task,
            bindings=(queues.amqp_queue(queue_name),),
            max_attempts=queues.max_attempts,
            retry_delays=queues.retry_delays,
        )
        for queue_name in queues.queues
    ]


def start_attempts(using: str, task_ids: Iterable[str]) -> None:
    """Before the attempts' transaction: RUNNING, committed (so visible while the tasks run),
    then ``task_started``. A database that cannot take the write holds the deliveries."""
    try:
        runs = TaskRun.objects.using(using).start_attempts(task_ids, worker_id(), timezone.now())
    except DatabaseError as exc:
        raise DatabaseUnavailable(f"could not mark tasks RUNNING: {exc}") from exc
    _signal(task_started, runs)


def record_retry(using: str, task_id: str, error: BaseException | None) -> None:
    """In the attempt's transaction: the attempt's error, and READY for the next one. FAILED
    is written with the dead letter (``dead_letters.record.record_dead_letter``), whichever path
    records it."""
    TaskRun.objects.using(using).fail_attempt(task_id, None if error is None else error_of(error))


def take_back_attempt(using: str, task_id: str) -> None:
    """In the attempt's transaction: the delivery was put aside before the task ran (another
    worker holds it), so this worker's attempt is not one."""
    TaskRun.objects.using(using).take_back_attempt(task_id, worker_id())


def send_finished(using: str, task_ids: Iterable[str]) -> None:
    """After the commit: ``task_finished`` for the tasks of ``task_ids`` that finished."""
    if not task_finished.receivers:
        return  # nobody listens: no need to read the rows back
    finished = (TaskResultStatus.SUCCESSFUL, TaskResultStatus.FAILED)
    runs = TaskRun.objects.using(using).filter(pk__in=list(task_ids), status__in=finished)
    _signal(task_finished, list(runs))


def _signal(signal: Any, runs: Iterable[TaskRun]) -> None:
    """Send ``signal`` for each run; a receiver's failure is logged, never a delivery's."""
    if not signal.receivers:
        return  # nobody listens: no result to build
    for run in runs:
        try:
            result = result_of(run)
            replies = signal.send_robust(type(task_backends[run.backend]), task_result=result)
        except Exception:
            logger.exception("task %s: could not signal its state %s", run.id, run.status)
            continue
        for receiver, reply in replies:
            if isinstance(reply, Exception):
                logger.error(
                    "task %s: the receiver %r of its state %s failed: %r",
                    run.id,
                    receiver,
                    run.status,
                    reply,
                    exc_info=reply,
                )
