"""``purge_messages`` and the results of finished tasks: SUCCESSFUL and FAILED ones go after
``TASK_RESULT_RETENTION`` once no dead letter of theirs can be replayed (resolved, or gone); one
whose dead letter an operator can still replay (dead, replayed, discarded; forced, for a
SUCCESSFUL one), and every unfinished one, stay."""

from __future__ import annotations

import datetime as dt
import io
from typing import Any

import pytest
from django.conf import settings
from django.core import checks
from django.core.checks import run_checks
from django.core.management import call_command
from django.test import override_settings
from django.utils import timezone

from reliable_messaging.choices import DeadLetterStatus, TaskRunStatus
from reliable_messaging.models import DeadLetter, TaskRun
from reliable_messaging.task_runs.naming import task_consumer_name

pytestmark = pytest.mark.django_db

DAY = dt.timedelta(days=1)


def run(task_id: str, status: str, *, enqueued: float, finished: float | None = None) -> None:
    now = timezone.now()
    TaskRun.objects.create(
        id=task_id,
        backend="default",
        task_path="shop.tasks.charge",
        queue_name="default",
        status=status,
        enqueued_at=now - enqueued * DAY,
        finished_at=None if finished is None else now - finished * DAY,
    )


def letter(task_id: str, status: str) -> None:
    DeadLetter.objects.create(
        message_id=task_id,
        consumer=task_consumer_name("default", "default"),
        queue="tasks.default",
        status=status,
        body=b"{}",
        payload={"task_id": task_id, "task": "shop.tasks.charge"},
    )


@pytest.fixture
def tasks_of_every_kind() -> None:
    run("ok-old", TaskRunStatus.SUCCESSFUL, enqueued=20, finished=20)
    run("ok-new", TaskRunStatus.SUCCESSFUL, enqueued=2, finished=2)
    # Enqueued long ago (deferred, or retried for long), finished lately: kept.
    run("ok-late", TaskRunStatus.SUCCESSFUL, enqueued=60, finished=1)
    for name, dead_letter in (
        ("failed-dead", DeadLetterStatus.DEAD),
        ("failed-replayed", DeadLetterStatus.REPLAYED),
        ("failed-discarded", DeadLetterStatus.DISCARDED),
        ("failed-resolved", DeadLetterStatus.RESOLVED),
        ("failed-gone", None),
    ):
        run(name, TaskRunStatus.FAILED, enqueued=30, finished=30)
        if dead_letter is not None:
            letter(name, dead_letter)
    # A copy of its message dead-lettered after it succeeded: a forced replay runs it again.
    run("ok-dead", TaskRunStatus.SUCCESSFUL, enqueued=20, finished=20)
    letter("ok-dead", DeadLetterStatus.DEAD)
    run("ok-resolved", TaskRunStatus.SUCCESSFUL, enqueued=20, finished=20)
    letter("ok-resolved", DeadLetterStatus.RESOLVED)
    run("ready-old", TaskRunStatus.READY, enqueued=60)
    run("running-old", TaskRunStatus.RUNNING, enqueued=60)


def purge(*args: str, retention: Any = dt.timedelta(days=14)) -> str:
    values = {**settings.RELIABLE_MESSAGING, "TASK_RESULT_RETENTION": retention}
    out = io.StringIO()
    with override_settings(RELIABLE_MESSAGING=values):
        call_command("purge_messages", *args, "--batch-size", "2", stdout=out)
    return out.getvalue()


def left() -> set[str]:
    return set(TaskRun.objects.values_list("pk", flat=True))


def test_finished_results_go_after_their_retention_and_replayable_ones_stay(
    tasks_of_every_kind: None,
) -> None:
    everything = left()
    assert "would delete 4 finished task result(s) older than 14 days" in purge("--dry-run")
    assert left() == everything

    output = purge()

    assert "deleted 4 finished task result(s) older than 14 days" in output
    assert left() == {
        "ok-new",
        "ok-late",
        "ok-dead",  # a forced replay of its dead letter runs the row again
        "failed-dead",  # its dead letter can still be replayed, which runs the row
        "failed-replayed",  # awaiting its replay's outcome
        "failed-discarded",  # a discarded dead letter can still be replayed
        "ready-old",
        "running-old",
    }
    assert everything - left() == {"ok-old", "ok-resolved", "failed-resolved", "failed-gone"}
    # The dead letters themselves follow their own retention.
    assert DeadLetter.objects.count() == 6


def test_every_result_stays_when_the_retention_is_none(tasks_of_every_kind: None) -> None:
    everything = left()
    output = purge(retention=None)
    assert "task result" not in output
    assert left() == everything


def test_a_retention_that_cannot_work_is_refused_by_the_checks() -> None:
    values = {**settings.RELIABLE_MESSAGING, "TASK_RESULT_RETENTION": "two weeks"}
    with override_settings(RELIABLE_MESSAGING=values):
        found = [m for m in run_checks() if "TASK_RESULT_RETENTION" in m.msg]
    assert [m.level >= checks.ERROR for m in found] == [True]
