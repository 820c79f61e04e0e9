"""The task signals a ``manage.py consume`` subprocess sends, made visible to its test: in a
process with ``RM_TEST_TASK_SIGNALS=1`` each ``task_started`` and ``task_finished`` becomes an
:class:`Effect` row of consumer ``signal.started`` / ``signal.finished``, its message_id the
task's id and its payload the status the result carried."""

from __future__ import annotations

from typing import Any

from .models import Effect


def _recorder(name: str) -> Any:
    def receive(sender: Any, task_result: Any, **kwargs: Any) -> None:
        Effect.objects.create(
            consumer=f"signal.{name}",
            message_id=task_result.id,
            attempt=task_result.attempts,
            payload=str(task_result.status),
        )

    return receive


def record_task_signals() -> None:
    from reliable_messaging.task_runs.framework import task_finished, task_started

    task_started.connect(_recorder("started"), weak=False)
    task_finished.connect(_recorder("finished"), weak=False)
