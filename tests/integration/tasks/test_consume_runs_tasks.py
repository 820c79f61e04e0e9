"""``manage.py consume`` as a real subprocess runs the tasks: the app registered the consumers of
the task queues from TASKS at start, with nothing else to configure."""

from __future__ import annotations

import signal
import socket
from pathlib import Path
from typing import Any

import pytest

from reliable_messaging.models import DeadLetter
from reliable_messaging.task_runs.naming import TaskQueues
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
