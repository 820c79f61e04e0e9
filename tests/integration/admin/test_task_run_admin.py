"""The tasks of the task backend in the admin: a read-only list filtered by status and queue and
searched by id or task path, a page with the task's arguments, result, errors and workers, and
a failed task linked to its dead letter and back."""

from __future__ import annotations

import datetime as dt
import itertools
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from reliable_messaging import publish
from reliable_messaging.choices import OutboxStatus, TaskRunStatus
from reliable_messaging.models import DeadLetter, OutboxMessage, TaskRun
from reliable_messaging.task_runs.naming import task_consumer_name

from .conftest import change_url, staff_user

CHANGELIST = reverse("admin:reliable_messaging_taskrun_changelist")
TRACEBACK = (
    "Traceback (most recent call last):\n"
    '  File "/srv/shop/tasks.py", line 12, in send_receipt\n'
    "    raise MailServerDown(host)\n"
    "shop.tasks.MailServerDown: smtp.example.com refused the connection\n"
)


def task_url(run: TaskRun) -> str:
    return reverse("admin:reliable_messaging_taskrun_change", args=[run.pk])


@pytest.fixture
def make_run(db: None) -> Callable[..., TaskRun]:
    """``make_run(**fields)``: a READY ``shop.tasks.send_receipt`` on the queue "default"."""
    numbers = itertools.count(1)

    def make(**fields: Any) -> TaskRun:
        n = next(numbers)
        values: dict[str, Any] = {
            "id": str(uuid.uuid4()),
            "backend": "default",
            "task_path": "shop.tasks.send_receipt",
            "queue_name": "default",
            "args": [n],
            "kwargs": {"to": f"customer-{n}@example.com"},
            "enqueued_at": timezone.now() - dt.timedelta(minutes=n),
        }
        return TaskRun.objects.create(**(values | fields))

    return make


@pytest.fixture
def task_queues(settings: Any) -> None:
    settings.TASKS = {
        "default": {
            "BACKEND": "reliable_messaging.contrib.task_backend.ReliableTaskBackend",
            "QUEUES": ["default", "emails"],
        }
    }


def listed(response: Any) -> list[str]:
    assert response.status_code == 200
    return [run.id for run in response.context["cl"].result_list]


def test_the_list_filters_by_status_and_queue_and_finds_by_id_or_path(
    admin: Client, make_run: Callable[..., TaskRun], task_queues: None
) -> None:
    ready = make_run()
    done = make_run(status=TaskRunStatus.SUCCESSFUL, queue_name="emails", attempts=1)
    other = make_run(task_path="shop.tasks.restock", status=TaskRunStatus.FAILED, attempts=3)

    assert listed(admin.get(CHANGELIST)) == [ready.id, done.id, other.id]  # latest first
    assert listed(admin.get(CHANGELIST, {"status__exact": "SUCCESSFUL"})) == [done.id]
    assert listed(admin.get(CHANGELIST, {"queue_name": "emails"})) == [done.id]
    assert listed(admin.get(CHANGELIST, {"q": other.id})) == [other.id]
    assert listed(admin.get(CHANGELIST, {"q": "shop.tasks.send_receipt"})) == [ready.id, done.id]
    page = admin.get(CHANGELIST).content.decode()
    # The queue filter offers the queues TASKS declares, with or without tasks.
    assert "?queue_name=emails" in page and "?queue_name=default" in page
    assert "shop.tasks.restock" in page


def test_a_tasks_page_shows_what_it_was_asked_and_what_came_of_it(
    admin: Client, make_run: Callable[..., TaskRun]
) -> None:
    run = make_run(
        args=[41, "gift"],
        kwargs={"to": "ada@example.com"},
        status=TaskRunStatus.SUCCESSFUL,
        attempts=2,
        return_value={"receipt": "R-1041"},
        errors=[{"exception_class_path": "shop.tasks.MailServerDown", "traceback": TRACEBACK}],
        worker_ids=["web-1:4242", "web-2:77"],
        started_at=timezone.now(),
        finished_at=timezone.now(),
    )
    response = admin.get(task_url(run))
    assert response.status_code == 200
    page = response.content.decode()
    for shown in ("gift", "ada@example.com", "R-1041", "web-1:4242", "web-2:77"):
        assert shown in page, shown
    assert "shop.tasks.MailServerDown" in page
    assert "smtp.example.com refused the connection" in page  # the traceback itself
    assert "rm-task-dead-letter" not in page  # not failed: no dead letter to link


def test_a_ready_tasks_page_says_where_its_message_is(
    admin: Client, make_run: Callable[..., TaskRun]
) -> None:
    """A task stays READY while its message waits: in the outbox (not sent: its queue gone,
    say), or in its queue for a worker. Its page says which, linked to the outbox row."""
    unsent, sent = make_run(), make_run()
    for run in (unsent, sent):
        publish("tasks.default", {"task_id": run.id}, exchange="", message_id=run.id)
    gone = "unroutable: 312 NO_ROUTE: its queue does not exist now (deleted, or its node down)"
    OutboxMessage.objects.filter(message_id=unsent.id).update(
        status=OutboxStatus.FAILED, attempts=10, last_error=gone
    )
    row = OutboxMessage.objects.get(message_id=unsent.id)
    page = admin.get(task_url(unsent)).content.decode()
    link = reverse("admin:reliable_messaging_outboxmessage_change", args=[row.pk])
    assert f'href="{link}" id="rm-task-message"' in page
    assert "its queue does not exist now" in page
    assert "the outbox&#x27;s retry action sends it again" in page
    OutboxMessage.objects.filter(message_id=sent.id).update(
        status=OutboxStatus.SENT, sent_at=timezone.now()
    )
    assert "in its queue until a worker takes it" in admin.get(task_url(sent)).content.decode()
    done = make_run(status=TaskRunStatus.SUCCESSFUL)
    assert "rm-task-message" not in admin.get(task_url(done)).content.decode()


def test_a_failed_task_links_to_its_dead_letter_and_back(
    admin: Client, make_run: Callable[..., TaskRun], make_dead_letter: Callable[..., DeadLetter]
) -> None:
    run = make_run(status=TaskRunStatus.FAILED, attempts=3)
    consumer = task_consumer_name(run.backend, run.queue_name)
    # Another consumer's dead letter of the same message_id is not the task's.
    make_dead_letter(message_id=run.id, consumer="tests.alpha")
    letter = make_dead_letter(message_id=run.id, consumer=consumer)

    page = admin.get(task_url(run)).content.decode()
    assert f'href="{change_url(letter)}" id="rm-task-dead-letter"' in page

    page = admin.get(change_url(letter)).content.decode()
    assert f'href="{task_url(run)}" id="rm-dead-letter-task"' in page
    assert "shop.tasks.send_receipt" in page


def test_an_ordinary_dead_letters_page_names_no_task(
    admin: Client, make_dead_letter: Callable[..., DeadLetter]
) -> None:
    page = admin.get(change_url(make_dead_letter())).content.decode()
    assert "rm-dead-letter-task" not in page


def test_tasks_are_read_only_in_the_admin(admin: Client, make_run: Callable[..., TaskRun]) -> None:
    run = make_run()
    page = admin.get(task_url(run)).content.decode()
    assert 'name="_save"' not in page
    assert admin.get(reverse("admin:reliable_messaging_taskrun_add")).status_code == 403
    assert admin.post(task_url(run), {"status": "SUCCESSFUL"}).status_code == 403
    delete = reverse("admin:reliable_messaging_taskrun_delete", args=[run.pk])
    assert admin.post(delete, {"post": "yes"}).status_code == 403
    assert TaskRun.objects.get(pk=run.pk).status == TaskRunStatus.READY


def test_only_who_may_change_tasks_may_send_a_tasks_message_again(
    make_run: Callable[..., TaskRun], task_queues: None
) -> None:
    """The list's action that sends a READY task's message again is offered to (and taken
    from) those with the task's change permission, never to those who may only look."""
    run = make_run()
    looker, sender = Client(), Client()
    looker.force_login(staff_user("looker", "view_taskrun"))
    sender.force_login(staff_user("sender", "view_taskrun", "change_taskrun"))
    assert 'value="send_again"' not in looker.get(CHANGELIST).content.decode()
    assert 'value="send_again"' in sender.get(CHANGELIST).content.decode()
    form = {"action": "send_again", "_selected_action": [run.pk]}
    looker.post(CHANGELIST, form, follow=True)
    assert not OutboxMessage.objects.filter(message_id=run.pk).exists()
    page = sender.post(CHANGELIST, form, follow=True).content.decode()
    assert "1 task&#x27;s message sent again" in page, page
    assert OutboxMessage.objects.filter(message_id=run.pk).count() == 1
