"""``manage.py consume`` as a real subprocess runs the tasks: the app registered the consumers of
the task queues from TASKS at start, with nothing else to configure."""

from __future__ import annotations

import signal
import socket
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from reliable_messaging.models import DeadLetter
from reliable_messaging.task_runs.naming import TaskQueues, task_consumer_name
from tests.conftest import subprocess_env
from tests.support import ConsumeProcess

from . import tasks
from .conftest import until_status

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]


def test_consume_runs_the_tasks_of_the_queues_it_is_given(
    ns: str, tasks_settings: TaskQueues, transactional_db: Any, tmp_path: Path
) -> None:
    # The process's TASKS are tests/settings.py's, in the test's namespace as here.
    env = subprocess_env(ns, RM_TEST_TASKS="1")
    proc = ConsumeProcess(["--queue", tasks_settings.amqp_queue("default")], env, tmp_path / "log")
    try:
        proc.wait_consuming()
        result = tasks.add.enqueue(7, 8)
        until_status(result, "SUCCESSFUL", timeout=60)
        assert result.return_value == 15
        assert result.worker_ids == [f"{socket.gethostname()}:{proc.pid}"[:64]]
        failed = tasks.fails_before.enqueue(9)  # past the process's MAX_ATTEMPTS (3)
        until_status(failed, "FAILED", timeout=60)
        assert failed.attempts == 3 and len(failed.errors) == 3
        assert DeadLetter.objects.filter(message_id=failed.id).exists()
        proc.send(signal.SIGTERM)
        assert proc.wait(60) == 0, proc.log()
    finally:
        proc.close()


def test_the_time_limit_interrupts_an_async_task_and_the_next_attempt_runs(
    ns: str, tasks_settings: TaskQueues, transactional_db: Any, tmp_path: Path
) -> None:
    """An ``async def`` task awaiting past ``HANDLER_TIMEOUT`` is interrupted like a handler:
    the attempt fails as a timeout and the process stays up to run the next one (the
    framework's own ``Task.call`` blocks the thread where the interrupt cannot land, and the
    process would exit with code 3 past the grace)."""
    env = subprocess_env(ns, RM_TEST_TASKS="1", RM_TEST_HANDLER_TIMEOUT="1")
    proc = ConsumeProcess(["--queue", tasks_settings.amqp_queue("default")], env, tmp_path / "log")
    try:
        proc.wait_consuming()
        result = tasks.async_sleeps_at_first.enqueue()
        until_status(result, "SUCCESSFUL", timeout=60)
        assert result.return_value == "returned at attempt 2"
        assert result.attempts == 2 and len(result.errors) == 1
        assert "outcome=timeout" in proc.log(), proc.log()
        proc.send(signal.SIGTERM)
        assert proc.wait(60) == 0, proc.log()
    finally:
        proc.close()


# Enqueues inside a span of its own, as a traced view would: prints each task's id and trace.
TRACED_VIEW = """
from django.db import transaction
from opentelemetry import trace
from tests.integration.tasks import tasks

tracer = trace.get_tracer("tests.view")
for name, enqueue in (
    ("add", lambda: tasks.add.enqueue(2, 3)),
    ("flaky", lambda: tasks.fails_before.enqueue(2)),
):
    with tracer.start_as_current_span("POST /orders", kind=trace.SpanKind.SERVER) as span:
        with transaction.atomic():
            result = enqueue()
    print("task", name, result.id, format(span.get_span_context().trace_id, "032x"))

from reliable_messaging.publishing.wake_after_commit import sender
sender.flush(timeout=5)
"""


def test_a_tasks_runs_are_traced_from_its_enqueue_and_counted_in_the_metrics(
    ns: str, tasks_settings: TaskQueues, transactional_db: Any, tmp_path: Path
) -> None:
    """Tracing and the metrics are stages of the consumer: a task's runs have their spans in
    the trace of the transaction that enqueued it (publish, the relay's send, one process span
    per attempt) and are counted under the task queue's consumer, as a handler's messages."""
    from tests.e2e.test_tracing import (
        OUTCOME,
        manage,
        matching,
        only,
        spans_when,
        traced_env,
    )

    trace_file = tmp_path / "spans.jsonl"
    env = traced_env(ns, trace_file, RM_TEST_TASKS="1")
    queue = tasks_settings.amqp_queue("default")
    consumer = task_consumer_name("default", "default")
    proc = ConsumeProcess(["--queue", queue, "--metrics-port", "0"], env, tmp_path / "log")
    try:
        proc.wait_consuming()
        out = manage(env, "shell", "-c", TRACED_VIEW)
        enqueued = {
            fields[1]: (fields[2], fields[3])
            for fields in (line.split() for line in out.splitlines())
            if fields[:1] == ["task"]
        }
        for name, task in (("add", tasks.add), ("flaky", tasks.fails_before)):
            until_status(task.get_result(enqueued[name][0]), "SUCCESSFUL", timeout=60)
        spans = spans_when(
            trace_file,
            lambda found: (
                len(matching(found, f"process {queue}")) == 3
                and len(matching(found, f"send {queue}")) >= 2
            ),
            "three process spans (the flaky task's two attempts) and the sends",
        )
        for name, attempts in (("add", ["processed"]), ("flaky", ["retried", "processed"])):
            task_id, trace_id = enqueued[name]
            mine = [span for span in spans if span["trace_id"] == trace_id]
            view = only(matching(mine, "POST /orders"), f"{name}'s view span", spans)
            published = only(matching(mine, f"publish {queue}"), f"{name}'s publish", spans)
            assert published["parent_span_id"] == view["span_id"]
            runs = sorted(
                matching(mine, f"process {queue}", messaging__message__id=task_id),
                key=lambda span: span["start"],
            )
            assert [run["attributes"][OUTCOME] for run in runs] == attempts, runs
            assert {run["attributes"]["reliable_messaging.consumer"] for run in runs} == {consumer}
        with urllib.request.urlopen(
            f"http://127.0.0.1:{proc.ops_port()}/metrics", timeout=10
        ) as response:
            text = response.read().decode()
        counted = f'reliable_messaging_consumer_messages_total{{consumer="{consumer}",'
        assert f'{counted}outcome="processed"}} 2.0' in text, text
        assert f'{counted}outcome="retried"}} 1.0' in text, text
        proc.send(signal.SIGTERM)
        assert proc.wait(60) == 0, proc.log()
    finally:
        proc.close()
