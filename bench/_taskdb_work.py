"""The work ``bench/tasks.py`` measures, as a django-tasks-db task: the same row as
``bench/_task_work.py``'s (its own module: that one imports reliable_messaging, which the
django-tasks-db environment does not have)."""

from __future__ import annotations

import time

from django_tasks import task

from tests.testapp.models import Effect


@task
def one_row(n: int) -> int:
    Effect.objects.create(consumer="bench.taskdb", message_id=str(n), attempt=1, payload=n)
    return n


@task
def stamp(n: int) -> None:
    """When the task started (for the latency from commit to start)."""
    started = time.time()
    Effect.objects.create(
        consumer="bench.taskdb-latency", message_id=str(n), attempt=1, payload=started
    )
