"""What a dead letter of a task's consumer leaves its ``TaskRun``: FAILED, with the error that
says why. Every dead letter passes :func:`reliable_messaging.dead_letters.record.record_dead_letter`
(the pipeline's, the crash guard's, the ``.dead`` queue's, our own code's failure), which calls
:func:`fail_task_of` in the dead letter's transaction: a task never stays RUNNING after its
message became a dead letter. ``task_finished`` follows once that transaction commits, whichever
path it was, once for each time the task became FAILED."""

from __future__ import annotations

import functools

from django.db import transaction

from ..choices import TaskRunStatus
from ..models import DeadLetter, TaskRun
from .naming import is_task_consumer, task_consumer_name


class TaskDeadLettered(Exception):
    """The task's message became a dead letter without an exception of the task's own: its
    process died on it, it ran past its time limit, the broker's delivery limit, ... The
    error's traceback says which (the framework's ``TaskError`` needs a class it can import)."""

    def __init__(self, why: str = "the task's message became a dead letter") -> None:
        super().__init__(why)


_CLASS_PATH = f"{TaskDeadLettered.__module__}.{TaskDeadLettered.__qualname__}"


def dead_letter_error(
    *, reason: str, exception_type: str, exception_message: str, traceback: str
) -> dict[str, str]:
    """The ``TaskRun.errors`` entry (the framework's ``TaskError`` fields) of a dead letter:
    the task's own exception when it raised one, else :class:`TaskDeadLettered` with the
    dead letter's reason and detail."""
    if exception_type:
        return {
            "exception_class_path": exception_type,
            "traceback": traceback or f"{exception_type}: {exception_message}",
        }
    detail = f": {exception_message}" if exception_message else ""
    return {
        "exception_class_path": _CLASS_PATH,
        "traceback": f"{_CLASS_PATH}: dead-lettered ({reason}){detail}\n",
    }


def fail_task_of(dead_letter: DeadLetter, using: str) -> bool:
    """A dead letter of a task's consumer: its task FAILED with :func:`dead_letter_error`, in
    the caller's transaction. Only the task's own consumer's dead letter counts (another
    consumer bound to the task queue fails on its own), and a SUCCESSFUL task stays so.
    Returns whether the task is FAILED now. A task that became FAILED here is signalled
    ``task_finished`` after the commit (one FAILED already was signalled when it became so)."""
    if not is_task_consumer(dead_letter.consumer) or not dead_letter.message_id:
        return False
    run = TaskRun.objects.using(using).select_for_update().filter(pk=dead_letter.message_id).first()
    if (
        run is None
        or run.status == TaskRunStatus.SUCCESSFUL
        or task_consumer_name(run.backend, run.queue_name) != dead_letter.consumer
    ):
        return False
    error = dead_letter_error(
        reason=dead_letter.reason,
        exception_type=dead_letter.exception_type,
        exception_message=dead_letter.exception_message,
        traceback=dead_letter.traceback,
    )
    run.errors = [*run.errors, error]
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
