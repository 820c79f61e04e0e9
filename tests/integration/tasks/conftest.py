"""The task backend against the real broker and database: the consumers of the task queues run
as ``manage.py consume`` runs them (a ConsumerService in a thread of the test), and the relay
sends the outbox once per call."""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest
from django.conf import settings
from django.test import override_settings

from reliable_messaging.core.outcomes import Acknowledge, Outcome, ScheduleRetry
from reliable_messaging.core.registry import ConsumerSpec
from reliable_messaging.publishing.relay import build_relay
from reliable_messaging.task_runs.naming import TaskQueues
from tests.support import wait_until

if TYPE_CHECKING:
    from reliable_messaging.task_runs.framework import TaskResult

BACKEND = "reliable_messaging.contrib.task_backend.ReliableTaskBackend"

# Without the task framework (Django 5.2 without the tasks extra) there is nothing to test here;
# what needs it is imported where it is used.
if (
    "django_tasks" not in settings.INSTALLED_APPS
    and importlib.util.find_spec("django.tasks") is None
):
    collect_ignore_glob = ["test_*.py", "tasks.py"]


class Outcomes:
    """The consumer service's ``on_outcome``: what became of each delivery, by consumer."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seen: list[tuple[str, Outcome]] = []

    def __call__(self, spec: ConsumerSpec, delivery: Any, outcome: Outcome) -> None:
        with self.lock:
            self.seen.append((spec.name, outcome))

    def words(self) -> list[str]:
        with self.lock:
            outcomes = [outcome for _, outcome in self.seen]
        return [
            str(o.result)
            if isinstance(o, Acknowledge)
            else "retry"
            if isinstance(o, ScheduleRetry)
            else "release"
            for o in outcomes
        ]

    def wait(self, count: int, timeout: float = 30) -> list[str]:
        wait_until(lambda: len(self.seen) >= count, timeout=timeout, message=f"{count} outcomes")
        return self.words()


class Signals:
    """The statuses each task signal carried, in order, and the results themselves."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sent: list[tuple[str, str, str]] = []
        self.results: list[tuple[str, TaskResult]] = []

    def receiver(self, name: str) -> Callable[..., None]:
        def receive(sender: Any, task_result: TaskResult, **kwargs: Any) -> None:
            with self.lock:
                self.sent.append((name, task_result.id, str(task_result.status)))
                self.results.append((name, task_result))

        return receive

    def of(self, task_id: str) -> list[tuple[str, str]]:
        with self.lock:
            return [(name, status) for name, tid, status in self.sent if tid == task_id]

    def result(self, name: str, task_id: str) -> TaskResult:
        """The result the signal ``name`` carried for ``task_id`` (the only one)."""
        with self.lock:
            (found,) = [r for n, r in self.results if n == name and r.id == task_id]
        return found


@pytest.fixture
def task_options(ns: str) -> dict[str, Any]:
    return {"QUEUE_PREFIX": f"{ns}.tasks.", "MAX_ATTEMPTS": 3, "RETRY_DELAYS": [0.2, 0.4]}


@pytest.fixture
def tasks_settings(rm_settings: dict[str, Any], task_options: dict[str, Any]) -> Iterator[Any]:
    """TASKS naming our backend, its task queues in the test's namespace."""
    tasks = {
        "default": {"BACKEND": BACKEND, "QUEUES": ["default", "other"], "OPTIONS": task_options}
    }
    with override_settings(TASKS=tasks):
        yield TaskQueues.of("default", tasks["default"])


@pytest.fixture
def outcomes() -> Outcomes:
    return Outcomes()


@pytest.fixture
def worker(tasks_settings: TaskQueues, service: Any, outcomes: Outcomes) -> Any:
    """The consumers of the task queues, running (their queues declared)."""
    from reliable_messaging.task_runs.worker import consumer_specs

    return service(consumer_specs(tasks_settings), on_outcome=outcomes)


@pytest.fixture
def signals() -> Iterator[Signals]:
    from reliable_messaging.task_runs.framework import task_enqueued, task_finished, task_started

    record = Signals()
    receivers = {
        signal: record.receiver(name)
        for name, signal in (
            ("enqueued", task_enqueued),
            ("started", task_started),
            ("finished", task_finished),
        )
    }
    for signal, receive in receivers.items():
        signal.connect(receive, weak=False)
    yield record
    for signal, receive in receivers.items():
        signal.disconnect(receive)


def relay_once() -> int:
    """Send what the outbox holds due; how many messages were sent."""
    return build_relay(once=True).run().sent


def until_status(result: TaskResult, *statuses: str, timeout: float = 30) -> TaskResult:
    """Relay and refresh ``result`` until its status is one of ``statuses``."""

    def reached() -> bool:
        relay_once()
        result.refresh()
        return str(result.status) in statuses

    wait_until(reached, timeout=timeout, interval=0.1, message=f"task {result.id} {statuses}")
    return result
