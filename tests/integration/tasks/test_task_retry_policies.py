"""A task's own retry policy: ``@task(max_attempts=..., retry_delays=...)`` where the framework's
decorator passes other keyword arguments to the backend's task class (Django 6.1, the
django-tasks backport), ``OPTIONS["TASK_RETRIES"]`` on every version; each task of a queue
retried and dead-lettered by its own policy while the others keep the backend's."""

from __future__ import annotations

import inspect
import threading
from typing import Any

import pytest
from django.test import override_settings

from reliable_messaging.checks import check_task_backends
from reliable_messaging.core.registry import ConsumerSpec, RetryPolicy
from reliable_messaging.models import DeadLetter, OutboxMessage
from reliable_messaging.task_runs.framework import InvalidTask, task
from reliable_messaging.task_runs.naming import TaskQueues
from reliable_messaging.task_runs.policies import TaskRetryPolicies
from reliable_messaging.task_runs.worker import consumer_specs

from . import tasks
from .conftest import BACKEND, until_status

pytestmark = pytest.mark.django_db(transaction=True)

# Django 6.1 and the backport pass the decorator's other keyword arguments to the task class;
# Django 6.0's decorator takes none.
DECORATOR_TAKES_OPTIONS = any(
    p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(task).parameters.values()
)
needs_decorator_options = pytest.mark.skipif(
    not DECORATOR_TAKES_OPTIONS, reason="this framework's @task takes no options of a backend"
)
PATH = "tests.integration.tasks.tasks"


class Deliveries:
    """The consumer service's ``on_outcome``: each delivery's message id."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seen: list[str | None] = []

    def __call__(self, spec: ConsumerSpec, delivery: Any, outcome: Any) -> None:
        with self.lock:
            self.seen.append(delivery.message_id)


def copy_delays(message_id: str) -> list[float]:
    """The delays of the retry copies of ``message_id`` in the order they were written: each
    copy's due time less its writing time, both the database's clock in one statement."""
    copies = OutboxMessage.objects.filter(message_id=message_id, raw_properties__isnull=False)
    return [
        (copy.deliver_at - copy.created_at).total_seconds()
        for copy in copies.order_by("created_at")
        if copy.deliver_at is not None
    ]


@pytest.fixture
def deliveries(tasks_settings: TaskQueues, service: Any) -> Deliveries:
    seen = Deliveries()
    service(consumer_specs(tasks_settings), on_outcome=seen)
    return seen


def assert_failed_after(result: Any, attempts: int) -> None:
    until_status(result, "FAILED")
    assert result.attempts == attempts
    assert [e.exception_class for e in result.errors] == [tasks.Flaky] * attempts
    dead = DeadLetter.objects.get(message_id=result.id)
    assert (dead.attempts, dead.reason) == (attempts, "retries_exhausted")


def assert_own_and_backends_policies(deliveries: Deliveries, mine: Any, backends: Any) -> None:
    """``mine`` failed after 2 attempts, its retry copy due 0.8 s after it was written;
    ``backends`` after the backend's 3, its copies due 0.2 then 0.4 s after."""
    assert_failed_after(mine, 2)
    assert_failed_after(backends, 3)
    assert copy_delays(mine.id) == [0.8]
    assert copy_delays(backends.id) == [0.2, 0.4]


@needs_decorator_options
def test_a_tasks_own_policy_from_its_decorator_beside_a_task_with_the_backends(
    tasks_settings: TaskQueues, deliveries: Deliveries, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Decorated under the test's TASKS (the module's import saw the suite's default backend).
    own = task(max_attempts=2, retry_delays=[0.8])(tasks.fails_with_own_policy.func)
    monkeypatch.setattr(tasks, "fails_with_own_policy", own)
    assert (own.max_attempts, own.retry_delays) == (2, (0.8,))  # type: ignore[attr-defined]

    mine = own.enqueue(1)
    backends = tasks.fails_before.enqueue(9)  # the backend's: 3 attempts after 0.2 and 0.4 s

    assert_own_and_backends_policies(deliveries, mine, backends)


@pytest.fixture
def task_options(ns: str) -> dict[str, Any]:
    # The conftest's, with a policy of its own for always_fails (fails_before and
    # fails_with_own_policy keep the backend's here).
    return {
        "QUEUE_PREFIX": f"{ns}.tasks.",
        "MAX_ATTEMPTS": 3,
        "RETRY_DELAYS": [0.2, 0.4],
        "TASK_RETRIES": {f"{PATH}.always_fails": {"MAX_ATTEMPTS": 2, "RETRY_DELAYS": [0.8]}},
    }


def test_a_tasks_own_policy_from_the_settings_beside_a_task_with_the_backends(
    deliveries: Deliveries,
) -> None:
    mine = tasks.always_fails.enqueue(1)
    backends = tasks.fails_with_own_policy.enqueue(2)  # not named: the backend's policy

    assert_own_and_backends_policies(deliveries, mine, backends)


class Failed:
    def __init__(self, path: str) -> None:
        self.payload = {"task_id": "x", "task": path}


@needs_decorator_options
def test_the_settings_policy_of_a_task_overrides_its_decorators_key_by_key(
    tasks_settings: TaskQueues, monkeypatch: pytest.MonkeyPatch
) -> None:
    own = task(max_attempts=2, retry_delays=[0.8])(tasks.fails_with_own_policy.func)
    monkeypatch.setattr(tasks, "fails_with_own_policy", own)
    path = f"{PATH}.fails_with_own_policy"
    lookup = TaskRetryPolicies(tasks_settings)
    assert lookup(Failed(path)) == RetryPolicy(2, (0.8,))  # type: ignore[arg-type]
    named = TaskQueues(
        alias="default",
        queues=("default",),
        task_retries=((path, RetryPolicy(max_attempts=5)),),
    )
    assert TaskRetryPolicies(named)(Failed(path)) == RetryPolicy(5, (0.8,))  # type: ignore[arg-type]
    assert lookup(Failed(f"{PATH}.add")) is None  # type: ignore[arg-type]
    assert lookup(Failed(f"{PATH}.gone")) is None  # type: ignore[arg-type]


@needs_decorator_options
@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"max_attempts": 0}, "max_attempts=...) of tests.integration.tasks.tasks.not_a_task must"),
        ({"max_attempts": True}, "must be an integer >= 1"),
        ({"retry_delays": [5, 1]}, "increasing order"),
        ({"retry_delays": "1"}, "increasing order"),
    ],
)
def test_a_decorators_policy_that_cannot_work_is_refused(
    tasks_settings: TaskQueues, options: dict[str, Any], says: str
) -> None:
    with pytest.raises(InvalidTask, match=says.replace("(", r"\(").replace(")", r"\)")):
        task(**options)(tasks.not_a_task)


@needs_decorator_options
def test_an_unknown_option_of_the_decorator_is_refused(tasks_settings: TaskQueues) -> None:
    with pytest.raises(TypeError, match="max_attempt"):
        task(max_attempt=2)(tasks.not_a_task)


@pytest.mark.parametrize(
    ("retries", "says"),
    [
        ([], "'TASK_RETRIES'] must be a dict of task paths"),
        ({f"{PATH}.add": {}}, "must be a dict of MAX_ATTEMPTS and/or RETRY_DELAYS"),
        ({f"{PATH}.add": {"MAX_TRIES": 2}}, "unknown key 'MAX_TRIES'"),
        ({f"{PATH}.add": {"MAX_ATTEMPTS": 0}}, "['MAX_ATTEMPTS'] must be an integer >= 1"),
        ({f"{PATH}.add": {"RETRY_DELAYS": [2, 1]}}, "increasing order"),
        ({f"{PATH}.gone": {"MAX_ATTEMPTS": 2}}, f"names '{PATH}.gone', which is not a task"),
        ({f"{PATH}.not_a_task": {"MAX_ATTEMPTS": 2}}, "which is not a task"),
    ],
)
def test_a_settings_policy_that_cannot_work_is_refused(retries: Any, says: str) -> None:
    params = {
        "BACKEND": BACKEND,
        "QUEUES": ["default"],
        "OPTIONS": {"RETRY_DELAYS": [1, 5], "TASK_RETRIES": retries},
    }
    with override_settings(TASKS={"default": params}):
        errors = check_task_backends()
    assert [e.id for e in errors] == ["reliable_messaging.E061"]
    assert says in errors[0].msg


def test_a_settings_policy_with_delays_of_its_own_passes_the_checks() -> None:
    """Any delays will do: a retry waits in the outbox, not in a delay queue of its delay."""
    params = {
        "BACKEND": BACKEND,
        "QUEUES": ["default"],
        "OPTIONS": {
            "RETRY_DELAYS": [1, 5],
            "TASK_RETRIES": {f"{PATH}.add": {"MAX_ATTEMPTS": 9, "RETRY_DELAYS": [0.7, 33]}},
        },
    }
    with override_settings(TASKS={"default": params}):
        assert check_task_backends() == []
