"""The work ``bench/tasks.py`` measures: one row written, as a ``django.tasks`` task and as a
``@consumer`` handler, and a task that writes when it started. A module of its own, so the
worker finds the tasks by their path."""

from __future__ import annotations

import time
from typing import Any

from reliable_messaging import Message
from reliable_messaging.task_runs.framework import task
from tests.testapp.models import Effect


@task
def one_row(n: int) -> int:
    Effect.objects.create(consumer="bench.task", message_id=str(n), attempt=1, payload=n)
    return n


@task
def stamp(n: int) -> None:
    """When the task started (for the latency from commit to start)."""
    started = time.time()
    Effect.objects.create(consumer="bench.latency", message_id=str(n), attempt=1, payload=started)


def one_row_handler(message: Message) -> None:
    payload: Any = message.payload
    Effect.objects.create(
        consumer="bench.handler", message_id=message.message_id, attempt=1, payload=payload["n"]
    )
