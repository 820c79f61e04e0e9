"""What a dead letter of a task's consumer leaves its ``TaskRun``: FAILED, with the error that
says why. Every dead letter passes ``DeadLetter.objects.record_failure`` (the pipeline's, the
crash guard's, the ``.dead`` queue's, our own code's failure), which writes it in the dead
letter's transaction: a task never stays RUNNING after its message became a dead letter. Plain
values: the manager imports this module, so it imports no model."""

from __future__ import annotations


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
