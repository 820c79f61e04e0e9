"""``manage.py consume`` as a real subprocess runs the tasks: the app registered the consumers of
the task queues from TASKS at start, with nothing else to configure."""

from __future__ import annotations

import signal
import socket
from collections.abc import Iterator
from typing import Any

import pytest
from django.conf import settings
from django.test import override_settings

from reliable_messaging.models import DeadLetter

from . import tasks
from .conftest import until_status

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]


@pytest.fixture
def process_tasks(ns: str, rm_settings: dict[str, Any]) -> Iterator[str]:
    """TASKS as the subprocess sees them (tests/settings.py with the test's namespace)."""
    prefix = f"rmtest.{ns}.tasks."
    default = {**settings.TASKS["default"], "OPTIONS": {"QUEUE_PREFIX": prefix}}
    with override_settings(TASKS={"default": default}):
        yield prefix


def test_consume_runs_the_tasks_of_the_queues_it_is_given(consume: Any, process_tasks: str) -> None:
    proc = consume("--queue", f"{process_tasks}default").wait_consuming()
    result = tasks.add.enqueue(7, 8)
    until_status(result, "SUCCESSFUL", timeout=60)
    assert result.return_value == 15
    assert result.worker_ids == [f"{socket.gethostname()}:{proc.pid}"[:64]]
    failed = tasks.fails_before.enqueue(9)  # past the settings' MAX_ATTEMPTS (3)
    until_status(failed, "FAILED", timeout=60)
    assert failed.attempts == 3 and len(failed.errors) == 3
    assert DeadLetter.objects.filter(message_id=failed.id).exists()
    proc.send(signal.SIGTERM)
    assert proc.wait(60) == 0
