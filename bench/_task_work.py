"""The work ``bench/tasks.py`` measures: one row written, as a ``django.tasks`` task and as a
``@consumer`` handler. A module of its own, so the worker finds the task by its path."""

from __future__ import annotations

from typing import Any

from reliable_messaging import Message
from reliable_messaging.task_runs.framework import task
from tests.testapp.models import Effect


@task
def one_row(n: int) -> int:
    Effect.objects.create(consumer="bench.task", message_id=str(n), attempt=1, payload=n)
    return n


def one_row_handler(message: Message) -> None:
    payload: Any = message.payload
    Effect.objects.create(
        consumer="bench.handler", message_id=message.message_id, attempt=1, payload=payload["n"]
    )
