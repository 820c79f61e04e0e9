"""A batch of tasks costs about what a batch of handlers does: its rows are marked RUNNING and
read in one go before the batch's transaction, and its SUCCESSFUL rows are written in one
statement at the end of it; when the batch is decided again (a task failed on the optimistic
path), what the rolled-back try ran is forgotten and each task keeps its own outcome."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from reliable_messaging.choices import TaskRunStatus
from reliable_messaging.consuming.processing import DeliveryProcessor, process_batch
from reliable_messaging.consuming.stage import Job
from reliable_messaging.core.envelope import Delivery, encode_payload
from reliable_messaging.core.outcomes import Acknowledge, ScheduleRetry
from reliable_messaging.models import TaskRun
from reliable_messaging.task_runs.framework import TaskResultStatus
from reliable_messaging.task_runs.naming import TaskQueues
from reliable_messaging.task_runs.worker import consumer_specs
from reliable_messaging.testing import published
from tests.markers import postgresql_only
from tests.testapp.models import Effect

from . import tasks

pytestmark = pytest.mark.django_db(transaction=True)


def run_as_one_batch(queues: TaskQueues) -> list[Any]:
    """What the outbox holds for the default task queue, decided as one batch of deliveries
    (as a worker thread of ``manage.py consume`` decides them)."""
    spec = consumer_specs(queues)[0]
    processor = DeliveryProcessor(spec)
    deliveries = [
        Delivery(
            body=encode_payload(message.payload),
            queue=spec.queue,
            exchange=message.exchange,
            routing_key=message.routing_key,
            message_id=message.message_id,
            content_type="application/json",
        )
        for message in published(spec.queue)
    ]
    return process_batch([Job(processor, delivery) for delivery in deliveries])


def taskrun_statements(queries: CaptureQueriesContext) -> list[str]:
    return [q["sql"] for q in queries.captured_queries if "reliable_messaging_taskrun" in q["sql"]]


@postgresql_only  # elsewhere the worker's id is appended row by row
def test_a_batch_of_tasks_reads_and_writes_its_rows_once_each_way(
    tasks_settings: TaskQueues,
) -> None:
    results = [tasks.add.enqueue(n, 1) for n in range(6)]
    with CaptureQueriesContext(connection) as queries:
        outcomes = run_as_one_batch(tasks_settings)
    assert outcomes == [Acknowledge("processed")] * 6
    # RUNNING: one UPDATE that also reads the rows back; SUCCESSFUL: one UPDATE. Nothing per
    # task (a statement per task made a task cost three times a handler's statements).
    statements = taskrun_statements(queries)
    assert len(statements) == 2, statements
    for n, result in enumerate(results):
        result.refresh()
        assert (result.status, result.return_value, result.attempts) == (
            TaskResultStatus.SUCCESSFUL,
            n + 1,
            1,
        )
    assert Effect.objects.filter(consumer="task.add").count() == 6


def test_a_batch_decided_again_after_a_failure_keeps_each_tasks_own_outcome(
    tasks_settings: TaskQueues,
) -> None:
    before = [tasks.add.enqueue(n, 10) for n in range(3)]
    flaky = tasks.fails_before.enqueue(2)
    after = [tasks.greet.enqueue(name=name) for name in ("ann", "bob")]
    # The flaky task fails on the optimistic path: the batch's transaction is rolled back and
    # the batch decided again, each task in a savepoint of its own.
    outcomes = run_as_one_batch(tasks_settings)
    assert [type(o) for o in outcomes] == [Acknowledge] * 3 + [ScheduleRetry] + [Acknowledge] * 2
    rows = {run.pk: run for run in TaskRun.objects.all()}
    for n, result in enumerate(before):
        assert rows[result.id].status == TaskRunStatus.SUCCESSFUL
        assert rows[result.id].return_value == n + 10
    for name, greeted in zip(("ann", "bob"), after, strict=True):
        assert rows[greeted.id].status == TaskRunStatus.SUCCESSFUL
        assert rows[greeted.id].return_value == {"greeting": f"hello {name}"}
    assert rows[flaky.id].status == TaskRunStatus.READY
    assert rows[flaky.id].return_value is None
    assert [e["exception_class_path"] for e in rows[flaky.id].errors] == [
        "tests.integration.tasks.tasks.Flaky"
    ]
    assert all(run.attempts == 1 for run in rows.values())
    # Each effect once: the rolled-back try's are gone with it.
    assert Effect.objects.filter(consumer="task.add").count() == 3
    assert Effect.objects.filter(consumer="task.greet").count() == 2
    assert Effect.objects.filter(consumer="task.fails_before").count() == 0


def synchronous_commit() -> str:
    with connection.cursor() as cursor:
        cursor.execute("SHOW synchronous_commit")
        return str(cursor.fetchone()[0])


@postgresql_only
def test_running_is_marked_without_waiting_for_the_disk_and_nothing_of_it_stays(
    tasks_settings: TaskQueues,
) -> None:
    """Outside a transaction the RUNNING mark is one statement, its own transaction, whose
    commit does not wait for the WAL flush (the batch's own commit flushes it); the setting
    is that transaction's only, and inside a caller's transaction it is never set (that
    transaction's commit must wait for the disk)."""
    from django.db import transaction

    before = synchronous_commit()
    first, second = (tasks.add.enqueue(n, 1) for n in range(2))
    with CaptureQueriesContext(connection) as queries:
        (started,) = TaskRun.objects.start_attempts([first.id], "w:1", timezone.now())
    (statement,) = taskrun_statements(queries)
    assert "set_config('synchronous_commit', 'off', true)" in statement
    assert started.status == TaskRunStatus.RUNNING
    assert synchronous_commit() == before  # nothing left on the session
    with transaction.atomic(), CaptureQueriesContext(connection) as queries:
        TaskRun.objects.start_attempts([second.id], "w:1", timezone.now())
        assert synchronous_commit() == before
    assert all("synchronous_commit" not in sql for sql in taskrun_statements(queries))
