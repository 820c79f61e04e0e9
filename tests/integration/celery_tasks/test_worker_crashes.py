"""``@idempotent_task`` when a pool child dies mid-task, as under the OOM killer.

A real prefork ``celery worker`` runs the suite's app (``acks_late`` and ``reject_on_worker_lost``,
as the docs ask), and a task ``SIGKILL``s its own child. What is asserted is what an operator
sees: effect and inbox rows, the dead letter the admin lists, the queue left empty. The system
check that asks for those two options is run through Django's ``run_checks()``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from celery import Celery, current_app
from celery.app import default_app
from django.core.checks import run_checks

from reliable_messaging.contrib.celery import idempotent_task
from reliable_messaging.models import DeadLetter, ProcessedMessage, SuspectDelivery
from tests.support import drained, new_namespace, wait_until
from tests.testapp.models import Effect

from .tasks import email_receipt, kill_child
from .worker import CeleryWorker

pytestmark = pytest.mark.django_db(transaction=True)

KILL_CHILD = kill_child.name
RECEIPTS = email_receipt.name
CRASH_LIMIT = 3
# Celery's line for each pool child that died of a signal.
CHILD_KILLED = re.compile(r"Process 'ForkPoolWorker-\d+' pid:\d+ exited with 'signal 9")


def effects(label: str, about: str | None = None) -> int:
    rows = Effect.objects.filter(consumer=label)
    return (rows if about is None else rows.filter(message_id=about)).count()


def inbox(scope: str) -> list[str]:
    return sorted(
        ProcessedMessage.objects.filter(consumer=scope).values_list("message_id", flat=True)
    )


def children_killed(worker: CeleryWorker) -> int:
    return len(CHILD_KILLED.findall(worker.log()))


@pytest.fixture
def start_worker(ns: str, tmp_path: Path) -> Iterator[Callable[[int], CeleryWorker]]:
    """``start_worker(concurrency)``: a worker on the test's own queue (the ``ns`` fixture
    deletes it), with ``CRASH_LIMIT`` set; stopped in teardown, even when the test failed."""
    workers: list[CeleryWorker] = []

    def start(concurrency: int) -> CeleryWorker:
        worker = CeleryWorker(
            f"rmtest.{ns}.celery",
            tmp_path / f"celery-worker-{len(workers)}.log",
            concurrency=concurrency,
            env={"RM_TEST_CRASH_LIMIT": str(CRASH_LIMIT)},
        )
        workers.append(worker)
        worker.wait_ready()
        return worker

    try:
        yield start
    finally:
        for worker in workers:
            worker.stop()


@pytest.mark.slow
def test_a_task_that_kills_its_child_every_time_becomes_a_dead_letter(
    start_worker: Callable[[int], CeleryWorker],
) -> None:
    from .celery_app import app

    # One child and one unacked message at a time: without the guard, the killer would come
    # back forever and the receipts queued behind it would never run.
    worker = start_worker(1)
    app.send_task(KILL_CHILD, args=["every-time"], queue=worker.queue)
    for order_id in (201, 202, 203):
        app.send_task(RECEIPTS, args=[order_id], queue=worker.queue)

    wait_until(
        lambda: (
            DeadLetter.objects.filter(consumer=KILL_CHILD).exists() and len(inbox(RECEIPTS)) == 3
        ),
        timeout=60,
        message=lambda: f"a dead letter and three receipts; worker log:\n{worker.log()}",
    )
    wait_until(
        lambda: drained(worker.queue),
        timeout=20,
        message=lambda: f"the queue to be empty; worker log:\n{worker.log()}",
    )

    dead = DeadLetter.objects.get(consumer=KILL_CHILD)
    assert dead.message_id == "kill:every-time" and dead.reason == "worker_crashed"
    assert dead.attempts == CRASH_LIMIT and "died" in dead.exception_message
    assert dead.payload == {"args": ["every-time"], "kwargs": {}}
    assert dead.headers["celery-task"] == KILL_CHILD and dead.headers["celery-task-id"]
    # The body ran CRASH_LIMIT times and each run rolled back with its child; then no more.
    assert children_killed(worker) == CRASH_LIMIT
    assert effects("kill_child") == 0 and inbox(KILL_CHILD) == []
    assert not SuspectDelivery.objects.filter(consumer=KILL_CHILD).exists()
    # The receipts behind it took effect, each once, and the worker lives on.
    assert [effects("receipt", str(n)) for n in (201, 202, 203)] == [1, 1, 1]
    assert inbox(RECEIPTS) == ["receipt:201", "receipt:202", "receipt:203"]
    assert worker.popen.poll() is None
    assert "dead_lettered message_id=kill:every-time" in worker.log()


@pytest.mark.slow
def test_a_task_killed_once_takes_effect_once_on_its_redelivery(
    start_worker: Callable[[int], CeleryWorker],
) -> None:
    from .celery_app import app

    # Two children, as in production: the other one keeps handling tasks meanwhile.
    worker = start_worker(2)
    app.send_task(
        KILL_CHILD, args=["first-time"], kwargs={"only_first_delivery": True}, queue=worker.queue
    )
    for order_id in (301, 302):
        app.send_task(RECEIPTS, args=[order_id], queue=worker.queue)

    wait_until(
        lambda: inbox(KILL_CHILD) == ["kill:first-time"] and len(inbox(RECEIPTS)) == 2,
        timeout=60,
        message=lambda: f"the task to take effect on its redelivery; worker log:\n{worker.log()}",
    )
    wait_until(
        lambda: drained(worker.queue),
        timeout=20,
        message=lambda: f"the queue to be empty; worker log:\n{worker.log()}",
    )

    assert children_killed(worker) == 1
    assert effects("kill_child", "first-time") == 1  # the killed run's effect rolled back
    assert [effects("receipt", str(n)) for n in (301, 302)] == [1, 1]
    assert not DeadLetter.objects.exists()
    assert not SuspectDelivery.objects.filter(consumer=KILL_CHILD).exists()  # guard finished


def noop(n: int) -> None:
    """A task body for the checks' own Celery apps; never run."""


def reported(prefix: str) -> dict[str, str]:
    """{task name: warning} of the check's warnings about tasks whose names start with prefix."""
    found = {}
    for message in run_checks():
        if message.id == "reliable_messaging.W020":
            assert message.hint and "reject_on_worker_lost" in message.hint
            name = re.search(r"@idempotent_task '([^']+)'", message.msg)
            if name and name.group(1).startswith(prefix):
                found[name.group(1)] = message.msg
    return found


def test_the_check_warns_about_tasks_a_killed_child_would_lose() -> None:
    ns = new_namespace()

    def idempotent(app: Celery, name: str, **options: object) -> None:
        # shared=False: a task of this app only, not added to every app finalized later.
        app.task(name=f"{ns}.{name}", shared=False, **options)(
            idempotent_task(key=lambda n: n)(noop)
        )

    with Celery(f"{ns}-defaults", set_as_current=False) as app:  # Celery acks early by default
        idempotent(app, "acks_early")
        idempotent(app, "no_reject", acks_late=True)
        idempotent(app, "retries", acks_late=True, reject_on_worker_lost=True, max_retries=2,
                   retry_on_worker_lost=True)  # fmt: skip
        idempotent(app, "safe", acks_late=True, reject_on_worker_lost=True)
        app.task(name=f"{ns}.not_idempotent", shared=False)(noop)
        found = reported(ns)
    assert sorted(found) == [f"{ns}.acks_early", f"{ns}.no_reject", f"{ns}.retries"]
    assert "acks_late is off" in found[f"{ns}.acks_early"]
    assert "reject_on_worker_lost is off" in found[f"{ns}.no_reject"]
    assert "retry_on_worker_lost is on" in found[f"{ns}.retries"]

    with Celery(f"{ns}-configured", set_as_current=False) as app:
        app.conf.update(task_acks_late=True, task_reject_on_worker_lost=True)
        idempotent(app, "by_app_config")
        idempotent(app, "early_by_itself", acks_late=False)
        assert sorted(reported(ns)) == [f"{ns}.early_by_itself"]

    # The suite's own app is configured as the docs say: its tasks are not reported. Nor
    # are they in the fallback app Celery makes up when no app is current, whose defaults
    # would call them unsafe: no worker runs it.
    from .celery_app import app as suite_app

    assert current_app.main  # asking for the current app makes Celery create its fallback
    fallback = default_app._get_current_object()
    assert KILL_CHILD in suite_app.tasks and KILL_CHILD in fallback.tasks
    assert not fallback.set_as_current and not fallback.conf.task_acks_late
    assert reported("tests.celery_tasks.") == {}
    assert reported(ns) == {}  # the apps above are closed: Celery forgot them
