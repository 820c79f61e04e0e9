"""What a dead letter of a task's consumer leaves its ``TaskRun``: FAILED, with the error that
says why, written in the dead letter's transaction whichever path recorded it
(``docs/tasks.md``)."""

from __future__ import annotations

import functools

from django.db import transaction

from ..choices import TaskRunStatus
from ..models import DeadLetter, TaskRun
from .naming import is_task_consumer, task_consumer_name


class TaskDeadLettered(Exception):
    """The task's message became a dead letter without an exception of the task's own (its
    process died on it, its time limit, ...); the framework's ``TaskError`` needs a class."""

    def __init__(self, why: str = "the task's message became a dead letter") -> None:
        super().__init__(why)


_CLASS_PATH = f"{TaskDeadLettered.__module__}.{TaskDeadLettered.__qualname__}"


def _error_of(dead_letter: DeadLetter) -> dict[str, str]:
    """The ``TaskRun.errors`` entry (the framework's ``TaskError`` fields) of a dead letter:
    the task's own exception when it raised one, else :class:`TaskDeadLettered` with the
    dead letter's reason and detail."""
    kind, message = dead_letter.exception_type, dead_letter.exception_message
    if kind:
        return {
            "exception_class_path": kind,
            "traceback": dead_letter.traceback or f"{kind}: {message}",
        }
    detail = f": {message}" if message else ""
    return {
        "exception_class_path": _CLASS_PATH,
        "traceback": f"{_CLASS_PATH}: dead-lettered ({dead_letter.reason}){detail}\n",
    }


def fail_task_of(dead_letter: DeadLetter, using: str) -> bool:
    """Make the task of a dead letter of its own consumer FAILED (a SUCCESSFUL one stays so) in
    the caller's transaction, signalled after the commit; whether the task is FAILED now."""
    if not is_task_consumer(dead_letter.consumer) or not dead_letter.message_id:
        return False
    run = TaskRun.objects.using(using).select_for_update().filter(pk=dead_letter.message_id).first()
    if (
        run is None
        or run.status == TaskRunStatus.SUCCESSFUL
        or task_consumer_name(run.backend, run.queue_name) != dead_letter.consumer
    ):
        return False
    run.errors = [*run.errors, _error_of(dead_letter)]
    if run.status != TaskRunStatus.FAILED:
        transaction.on_commit(
            functools.partial(_send_failed, using, run.pk), using=using, robust=True
        )
    run.status = TaskRunStatus.FAILED
    run.finished_at = dead_letter.last_failed_at
    run.save(using=using, update_fields=["errors", "status", "finished_at"])
    return True


def _send_failed(using: str, task_id: str) -> None:
    # The signal needs the task framework, imported only once a task failed.
    from .worker import send_failed

    send_failed(using, task_id)
