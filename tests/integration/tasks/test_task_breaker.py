"""Tasks meet the circuit breaker: a task queue's consumer takes the ``BREAKER`` setting as any
consumer does, and a task's ``attempts`` count only the runs of its function."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import override_settings

from reliable_messaging.consuming.breaker import BreakerState
from reliable_messaging.models import DeadLetter
from reliable_messaging.task_runs.naming import TaskQueues
from reliable_messaging.task_runs.worker import consumer_specs
from tests.support import wait_until
from tests.testapp.models import Effect

from . import tasks
from .conftest import Outcomes, relay_once, until_status

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]

BREAKER = {"failure_rate": 0.5, "window": 10, "min_failures": 4, "pause": 1.0, "probes": 2}


@pytest.fixture
def task_options(ns: str) -> dict[str, Any]:
    return {"QUEUE_PREFIX": f"{ns}.tasks.", "MAX_ATTEMPTS": 50, "RETRY_DELAYS": [0.2]}


def test_failing_tasks_open_the_breaker_and_the_tasks_behind_wait_with_no_attempt_spent(
    rm_settings: dict[str, Any], tasks_settings: TaskQueues, service: Any, outcomes: Outcomes
) -> None:
    """Ten tasks while their downstream is down: the failures open the breaker and the tasks
    behind wait unstarted. Once it is up, each runs its function once more and succeeds; each
    task's ``attempts`` is its failures plus one (no attempt spent while it waited), its errors
    are its own, and none is a dead letter."""
    with override_settings(RELIABLE_MESSAGING={**rm_settings, "BREAKER": BREAKER}):
        Effect.objects.create(consumer="switch", message_id=tasks.DOWNSTREAM_DOWN, attempt=0)
        svc = service(consumer_specs(tasks_settings), on_outcome=outcomes)
        breaker = svc.breakers.get(tasks_settings.consumer_name("default"))
        assert breaker is not None, "the task queue's consumer has no breaker"
        results = [tasks.pays_while_up.enqueue(n) for n in range(10)]
        relay_once()
        wait_until(lambda: breaker.opened >= 1, timeout=30, message="failures opening it")
        for result in results:
            result.refresh()
        waiting = [result for result in results if result.attempts == 0]
        assert waiting, "no task waited for the open breaker"
        Effect.objects.filter(consumer="switch").delete()
        for result in results:
            until_status(result, "SUCCESSFUL", timeout=60)

    for result in results:
        assert result.attempts == len(result.errors) + 1, (result.id, result.attempts)
        assert all(e.exception_class is ConnectionError for e in result.errors)
    assert sum(len(r.errors) for r in results) == outcomes.words().count("retry")
    paid = Effect.objects.filter(consumer="task.pays_while_up")
    payloads: list[Any] = list(paid.values_list("payload", flat=True))
    assert sorted(payloads) == list(range(10))
    assert all(r.attempts == 1 for r in waiting)
    assert breaker.state is BreakerState.CLOSED
    assert not DeadLetter.objects.exists()
