"""What the app makes of TASKS: the consumers ``manage.py consume`` runs for the task queues, and
the system checks refusing a configuration that cannot work."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import override_settings

from reliable_messaging.checks import check_task_backends
from reliable_messaging.contrib.task_backend import register_task_consumers
from reliable_messaging.core.registry import ConsumerRegistry
from reliable_messaging.task_runs.naming import TaskQueues
from reliable_messaging.task_runs.worker import run_task

from .conftest import BACKEND


def test_a_consumer_per_task_queue_of_each_backend_of_ours() -> None:
    tasks = {
        "default": {"BACKEND": BACKEND, "QUEUES": ["a", "b"], "OPTIONS": {"MAX_ATTEMPTS": 7}},
        "elsewhere": {"BACKEND": BACKEND, "QUEUES": ["a"], "OPTIONS": {"QUEUE_PREFIX": "jobs."}},
        "immediate": {"BACKEND": "django_tasks.backends.immediate.ImmediateBackend"},
    }
    consumers = ConsumerRegistry()
    with override_settings(TASKS=tasks):
        register_task_consumers(consumers)
    found = [(s.name, s.queue, s.bindings, s.max_attempts) for s in consumers.all()]
    assert found == [
        ("django.tasks:elsewhere:a", "jobs.a", ("jobs.a",), None),
        ("django.tasks:default:a", "tasks.a", ("tasks.a",), 7),
        ("django.tasks:default:b", "tasks.b", ("tasks.b",), 7),
    ]
    assert all(spec.handler is run_task for spec in consumers.all())


@pytest.mark.parametrize(
    ("params", "says"),
    [
        ({"QUEUES": []}, "must list the task queues"),
        ({"QUEUES": "default"}, "must list the task queues"),
        ({"QUEUES": ["a"], "OPTIONS": {"PRIORITY": 1}}, "unknown key 'PRIORITY'"),
        ({"QUEUES": ["a.*"]}, "without '*' or '#'"),
        ({"QUEUES": ["a"], "OPTIONS": {"MAX_ATTEMPTS": 0}}, "MAX_ATTEMPTS'] must be an integer"),
        ({"QUEUES": ["a"], "OPTIONS": {"RETRY_DELAYS": [5, 1]}}, "increasing order"),
    ],
)
def test_a_tasks_configuration_that_cannot_work_is_refused(
    params: dict[str, Any], says: str
) -> None:
    consumers = ConsumerRegistry()
    with override_settings(TASKS={"default": {"BACKEND": BACKEND, **params}}):
        errors = check_task_backends()
        register_task_consumers(consumers)
    assert [e.id for e in errors] == ["reliable_messaging.E061"]
    assert says in errors[0].msg
    assert len(consumers) == 0  # left to the check, not half-registered


class TaskRunsElsewhere:
    """A router sending TaskRun, and only it, to another database."""

    def db_for_write(self, model: type[Any], **hints: Any) -> str | None:
        return "other" if model.__name__ == "TaskRun" else None

    db_for_read = db_for_write


def test_task_runs_on_another_database_than_the_inbox_and_outbox_are_refused(
    tasks_settings: TaskQueues,
) -> None:
    router = f"{__name__}.{TaskRunsElsewhere.__qualname__}"
    with override_settings(DATABASE_ROUTERS=[router]):
        errors = check_task_backends()
    assert [e.id for e in errors] == ["reliable_messaging.E062"]
    assert "TaskRun to 'other'" in errors[0].msg


def test_the_task_tests_configuration_passes_the_checks(tasks_settings: TaskQueues) -> None:
    assert check_task_backends() == []
