"""RUNNING before the attempts: one commit for the rows of a batch that nobody holds, and a row
another transaction holds (a twin's attempt writing its outcome) waited for alone, without
holding the others meanwhile."""

from __future__ import annotations

import threading

import psycopg
import pytest
from django.db import connection
from django.utils import timezone

from reliable_messaging.choices import TaskRunStatus
from reliable_messaging.models import TaskRun
from tests.markers import postgresql_only
from tests.support import wait_until

pytestmark = [pytest.mark.django_db(transaction=True), postgresql_only]


def _holder() -> psycopg.Connection:
    params = connection.get_connection_params()
    keys = ("dbname", "user", "host", "port")
    return psycopg.connect(
        psycopg.conninfo.make_conninfo(**{k: v for k, v in params.items() if k in keys}),
        autocommit=False,
    )


def test_a_held_row_is_waited_for_alone_and_the_others_are_running_at_once() -> None:
    free, held, done = (
        TaskRun.objects.create(
            id=f"start-{name}", backend="default", task_path="m.t", queue_name="q"
        )
        for name in ("free", "held", "done")
    )
    TaskRun.objects.filter(pk=done.pk).update(status=TaskRunStatus.SUCCESSFUL, attempts=1)
    holder = _holder()
    started: list[str] = []
    try:
        holder.execute(
            "SELECT id FROM reliable_messaging_taskrun WHERE id = %s FOR UPDATE", [held.pk]
        )

        def start() -> None:
            try:
                runs = TaskRun.objects.start_attempts(
                    [held.pk, free.pk, done.pk], "host:1", timezone.now()
                )
                started.extend(run.pk for run in runs)
            finally:
                connection.close()

        thread = threading.Thread(target=start, daemon=True)
        thread.start()
        # The free row is RUNNING, committed, while the held one is still waited for.
        wait_until(
            lambda: TaskRun.objects.get(pk=free.pk).status == TaskRunStatus.RUNNING,
            timeout=10,
            message="the free row RUNNING while the other is held",
        )
        assert thread.is_alive()
        assert TaskRun.objects.get(pk=held.pk).status == TaskRunStatus.READY
        holder.rollback()
        thread.join(10)
        assert not thread.is_alive()
    finally:
        holder.close()
    assert sorted(started) == sorted([free.pk, held.pk])
    rows = {run.pk: run for run in TaskRun.objects.all()}
    for pk in (free.pk, held.pk):
        assert rows[pk].status == TaskRunStatus.RUNNING
        assert (rows[pk].attempts, rows[pk].worker_ids) == (1, ["host:1"])
        assert rows[pk].started_at is not None and rows[pk].finished_at is None
    assert (rows[done.pk].status, rows[done.pk].attempts) == (TaskRunStatus.SUCCESSFUL, 1)
