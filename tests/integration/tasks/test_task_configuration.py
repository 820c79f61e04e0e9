"""What the app makes of TASKS: the consumers ``manage.py consume`` runs for the task queues, and
the system checks refusing a configuration that cannot work."""

from __future__ import annotations

from typing import Any

import pytest
from django.conf import settings
from django.test import override_settings

from reliable_messaging.checks import check_task_backends
from reliable_messaging.contrib.task_backend import register_task_consumers
from reliable_messaging.core.registry import ConsumerRegistry, registry
from reliable_messaging.task_runs.worker import run_task

BACKEND = "reliable_messaging.contrib.task_backend.ReliableTaskBackend"


def test_the_app_registers_a_consumer_per_task_queue_for_consume() -> None:
    tasks: dict[str, Any] = settings.TASKS
    prefix = tasks["default"]["OPTIONS"]["QUEUE_PREFIX"]
    for queue_name in ("default", "other"):
        spec = registry.get(f"django.tasks:default:{queue_name}")
        assert spec.handler is run_task
        assert spec.queue == f"{prefix}{queue_name}"
        assert spec.bindings == (spec.queue,)


def test_a_backend_of_another_framework_engine_gets_no_consumer() -> None:
    tasks = {
        "default": {"BACKEND": BACKEND, "QUEUES": ["a"], "OPTIONS": {"MAX_ATTEMPTS": 7}},
        "other": {"BACKEND": "django_tasks.backends.immediate.ImmediateBackend"},
    }
    consumers = ConsumerRegistry()
    with override_settings(TASKS=tasks):
        register_task_consumers(consumers)
    (spec,) = consumers.all()
    assert (spec.name, spec.queue, spec.max_attempts) == ("django.tasks:default:a", "tasks.a", 7)


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


def test_the_suites_tasks_configuration_passes_the_checks() -> None:
    assert check_task_backends() == []
