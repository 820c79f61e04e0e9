"""The django.tasks backend end to end: enqueue in the caller's transaction, run once by the
consumer, retried, failed into a dead letter, replayed; results read through the framework."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import decimal
import json
import sys
import threading
import time
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.db import connections, transaction
from django.utils import timezone

from reliable_messaging import cancel_scheduled
from reliable_messaging.choices import OutboxStatus
from reliable_messaging.core.envelope import Delivery
from reliable_messaging.core.outcomes import FailureReason
from reliable_messaging.dead_letters.record import record_dead_letter
from reliable_messaging.dead_letters.replay import replay
from reliable_messaging.models import DeadLetter, OutboxMessage, TaskRun
from reliable_messaging.task_runs.framework import (
    InvalidTask,
    TaskResult,
    TaskResultDoesNotExist,
    TaskResultStatus,
    task,
    task_backends,
)
from reliable_messaging.task_runs.naming import TaskQueues
from reliable_messaging.task_runs.results import result_of
from tests import support
from tests.support import Publisher, wait_until
from tests.testapp.models import Effect

from . import tasks
from .conftest import Outcomes, Signals, relay_once, until_status

pytestmark = pytest.mark.django_db(transaction=True)


def effects(name: str) -> list[Any]:
    return list(Effect.objects.filter(consumer=f"task.{name}").values_list("attempt", flat=True))


class Rollback(Exception):
    """Raised to roll a test's transaction back."""


def test_a_task_enqueued_in_a_rolled_back_transaction_is_never_sent(
    worker: Any, signals: Signals
) -> None:
    with pytest.raises(Rollback), transaction.atomic():
        result = tasks.add.enqueue(1, 2)
        assert TaskRun.objects.filter(pk=result.id).exists()  # written in the transaction
        raise Rollback
    assert not TaskRun.objects.exists()
    assert not OutboxMessage.objects.exists()
    assert relay_once() == 0
    assert signals.of(result.id) == []  # never enqueued, so never signalled
    with pytest.raises(TaskResultDoesNotExist):
        task_backends["default"].get_result(result.id)


def test_a_committed_task_runs_once_and_its_result_is_read_back(
    worker: Any, signals: Signals, outcomes: Outcomes
) -> None:
    with transaction.atomic():
        result = tasks.add.enqueue(2, 3)
        assert result.status == TaskResultStatus.READY
        assert signals.of(result.id) == []  # not before the commit
    assert signals.of(result.id) == [("enqueued", "READY")]
    until_status(result, "SUCCESSFUL")
    assert result.return_value == 5
    assert result.attempts == 1 and len(result.worker_ids) == 1
    assert result.errors == []
    assert result.enqueued_at is not None and result.started_at is not None
    assert result.last_attempted_at is not None and result.finished_at is not None
    assert result.enqueued_at <= result.started_at <= result.finished_at
    assert effects("add") == [1]
    read = tasks.add.get_result(result.id)
    assert (read.status, read.return_value, read.args, read.kwargs) == (
        TaskResultStatus.SUCCESSFUL,
        5,
        [2, 3],
        {},
    )
    wait_until(lambda: len(signals.of(result.id)) == 3, timeout=10, message="three signals")
    assert signals.of(result.id) == [
        ("enqueued", "READY"),
        ("started", "RUNNING"),
        ("finished", "SUCCESSFUL"),
    ]
    # Each signal's result is the row as it stood then: finished as get_result reads it, and
    # started still RUNNING after it.
    started, finished = signals.result("started", result.id), signals.result("finished", result.id)
    for sent in (started, finished):
        assert (sent.args, sent.kwargs, sent.worker_ids, sent.errors) == (
            [2, 3],
            {},
            read.worker_ids,
            [],
        )
        assert (sent.enqueued_at, sent.started_at) == (read.enqueued_at, read.started_at)
        assert sent.last_attempted_at == read.last_attempted_at
    assert (finished.finished_at, finished.return_value) == (read.finished_at, 5)
    assert (started.status, started.finished_at) == (TaskResultStatus.RUNNING, None)
    with pytest.raises(ValueError):
        _ = started.return_value  # not finished: the framework raises
    assert outcomes.wait(1) == ["processed"]  # reported once acked, after the commit


def test_keyword_arguments_and_another_queue(worker: Any, tasks_settings: TaskQueues) -> None:
    result = tasks.greet.using(queue_name="other").enqueue(name="ada")
    row = OutboxMessage.objects.get(message_id=result.id)
    assert row.routing_key == tasks_settings.amqp_queue("other")
    until_status(result, "SUCCESSFUL")
    assert result.return_value == {"greeting": "hello ada"}
    assert tasks.greet.get_result(result.id).task.queue_name == "other"


def test_running_is_visible_while_the_task_runs(worker: Any) -> None:
    tasks.GATE.clear()
    try:
        result = tasks.waits.enqueue()
        until_status(result, "RUNNING")
        assert result.attempts == 1 and result.started_at is not None
        assert result.finished_at is None
    finally:
        tasks.GATE.set()
    until_status(result, "SUCCESSFUL")
    assert result.return_value == "done"


def test_a_duplicated_delivery_runs_the_task_once(
    worker: Any, outcomes: Outcomes, tasks_settings: TaskQueues, rm_settings: dict[str, Any]
) -> None:
    result = tasks.add.enqueue(4, 4)
    publisher = Publisher()
    try:  # a second copy of its message, as a publisher retrying after a lost confirm sends
        publisher.publish(
            rm_settings["EXCHANGE"],
            tasks_settings.amqp_queue("default"),
            {"task_id": result.id, "task": "tests.integration.tasks.tasks.add"},
            message_id=result.id,
        )
    finally:
        publisher.close()
    until_status(result, "SUCCESSFUL")
    assert sorted(outcomes.wait(2)) == ["duplicate", "processed"]
    assert effects("add") == [1]
    result.refresh()
    assert result.attempts == 1 and result.return_value == 8


def orphan_of(*args: Any) -> TaskResult:
    """A task whose row commits and whose own message is never sent (its outbox row removed
    in the enqueue's transaction): a foreign message is the only one naming it."""
    with transaction.atomic():
        result = tasks.add.enqueue(*args)
        OutboxMessage.objects.filter(message_id=result.id).delete()
    return result


def publish_foreign(queues: TaskQueues, exchange: str, payload: Any, message_id: str) -> None:
    publisher = Publisher()
    try:
        publisher.publish(exchange, queues.amqp_queue("default"), payload, message_id=message_id)
    finally:
        publisher.close()


def test_a_copy_of_a_task_under_another_message_id_does_not_run_it_again(
    worker: Any, outcomes: Outcomes, tasks_settings: TaskQueues, rm_settings: dict[str, Any]
) -> None:
    # The inbox keeps a message_id once; a copy under another one ran the task once more.
    result = tasks.add.enqueue(4, 4)
    until_status(result, "SUCCESSFUL")
    payload = {"task_id": result.id, "task": "tests.integration.tasks.tasks.add"}
    publish_foreign(tasks_settings, rm_settings["EXCHANGE"], payload, "another-id")
    assert sorted(outcomes.wait(2)) == ["dead_lettered", "processed"]
    dead = DeadLetter.objects.get(message_id="another-id")
    assert dead.exception_type == "reliable_messaging.exceptions.PermanentError"
    assert f"is not the id of the task it names ({result.id})" in dead.exception_message
    assert effects("add") == [1]
    result.refresh()
    assert (result.status, result.attempts, result.errors) == ("SUCCESSFUL", 1, [])


def test_a_message_naming_another_task_than_its_rows_runs_neither(
    worker: Any, outcomes: Outcomes, tasks_settings: TaskQueues, rm_settings: dict[str, Any]
) -> None:
    result = orphan_of(4, 4)
    payload = {"task_id": result.id, "task": "tests.integration.tasks.tasks.fails_before"}
    publish_foreign(tasks_settings, rm_settings["EXCHANGE"], payload, result.id)
    until_status(result, "FAILED")  # its only message could not run it
    assert outcomes.wait(1) == ["dead_lettered"]
    dead = DeadLetter.objects.get(message_id=result.id)
    assert dead.exception_type == "reliable_messaging.exceptions.PermanentError"
    assert "names task 'tests.integration.tasks.tasks.fails_before'" in dead.exception_message
    assert "tests.integration.tasks.tasks.add" in dead.exception_message
    assert effects("add") == effects("fails_before") == []
    # Not started for it: neither RUNNING nor charged an attempt.
    assert result.attempts == 0 and result.worker_ids == []
    assert [e.exception_class_path for e in result.errors] == [dead.exception_type]


@pytest.mark.parametrize(
    ("task_id", "path", "why"),
    [
        ("a\x00b", "tests.integration.tasks.tasks.add", "names no task_id a task could have"),
        ("x" * 65, "tests.integration.tasks.tasks.add", "names no task_id a task could have"),
        (None, "tests.integration.tasks.tasks.\x00add", "names task 'tests.integration"),
    ],
    ids=["nul-in-task-id", "task-id-too-long", "nul-in-task-path"],
)
def test_a_task_message_no_statement_could_carry_is_a_dead_letter_and_the_queue_flows(
    worker: Any,
    outcomes: Outcomes,
    tasks_settings: TaskQueues,
    rm_settings: dict[str, Any],
    task_id: str | None,
    path: str,
    why: str,
) -> None:
    # A foreign producer's text no statement can carry (a NUL) held the whole task queue: the
    # batch's RUNNING statement failed as if the database were down, again and again.
    named = orphan_of(1, 1) if task_id is None else None
    message_id = "foreign" if named is None else named.id
    payload = {"task_id": task_id if named is None else named.id, "task": path}
    publish_foreign(tasks_settings, rm_settings["EXCHANGE"], payload, message_id)
    behind = tasks.add.enqueue(2, 2)
    until_status(behind, "SUCCESSFUL")
    assert sorted(outcomes.wait(2)) == ["dead_lettered", "processed"]
    dead = DeadLetter.objects.get(message_id=message_id)
    assert dead.reason == "permanent" and why in dead.exception_message
    assert effects("add") == [1]  # the task behind, once


def test_the_worker_never_imports_a_module_a_message_names(
    worker: Any, outcomes: Outcomes, tasks_settings: TaskQueues, rm_settings: dict[str, Any]
) -> None:
    # Its failure looked the task's retry policy up by the message's path, importing it.
    module = "tests.integration.tasks.imported_by_a_message"
    sys.modules.pop(module, None)
    publisher = Publisher()
    try:
        publisher.publish(
            rm_settings["EXCHANGE"],
            tasks_settings.amqp_queue("default"),
            {"task_id": "no-such-task", "task": f"{module}.charge"},
            message_id="foreign",
        )
    finally:
        publisher.close()
    assert outcomes.wait(1) == ["dead_lettered"]
    assert "no-such-task" in DeadLetter.objects.get(message_id="foreign").exception_message
    assert module not in sys.modules


def test_a_task_whose_commit_is_refused_is_retried_then_failed(worker: Any) -> None:
    # Its attempt was charged outside any transaction, where the task's row cannot be locked:
    # the consumer failed on it, the task stayed RUNNING, a dead letter blamed the consumer.
    with connections["default"].cursor() as cursor:
        cursor.execute("CREATE TABLE rm_test_deferred (k int UNIQUE DEFERRABLE INITIALLY DEFERRED)")
    try:
        result = tasks.breaks_a_deferred_constraint.enqueue()
        until_status(result, "FAILED")
        assert result.attempts == 3  # MAX_ATTEMPTS
        assert [e.exception_class_path for e in result.errors] == [
            "django.db.utils.IntegrityError"
        ] * 3
        dead = DeadLetter.objects.get(message_id=result.id)
        assert (dead.reason, dead.exception_type) == (
            "retries_exhausted",
            "django.db.utils.IntegrityError",
        )
        beside = tasks.add.enqueue(1, 2)
        until_status(beside, "SUCCESSFUL")
    finally:
        with connections["default"].cursor() as cursor:
            cursor.execute("DROP TABLE rm_test_deferred")


def test_a_failing_task_is_retried_until_it_succeeds(worker: Any, outcomes: Outcomes) -> None:
    result = tasks.fails_before.enqueue(2)
    until_status(result, "SUCCESSFUL")
    assert result.return_value == "succeeded at attempt 2"
    assert result.attempts == 2
    (error,) = result.errors
    assert error.exception_class is tasks.Flaky
    assert "attempt 1 of 2" in error.traceback
    assert outcomes.wait(2) == ["retry", "processed"]
    assert effects("fails_before") == [2]  # the failed attempt's effect rolled back


def test_a_task_that_keeps_failing_is_failed_and_a_dead_letter_and_a_replay_runs_it_again(
    worker: Any, signals: Signals, tasks_settings: TaskQueues
) -> None:
    result = tasks.fails_before.enqueue(4)  # MAX_ATTEMPTS is 3: it fails for good
    until_status(result, "FAILED")
    assert result.attempts == 3
    assert [e.exception_class for e in result.errors] == [tasks.Flaky] * 3
    assert [f"attempt {n} of 4" in e.traceback for n, e in enumerate(result.errors, 1)] == [
        True
    ] * 3
    assert result.finished_at is not None
    with pytest.raises(ValueError, match="failed"):
        result.return_value
    dead = DeadLetter.objects.get(message_id=result.id)
    assert dead.consumer == tasks_settings.consumer_name("default")
    assert dead.payload == {
        "task_id": result.id,
        "task": "tests.integration.tasks.tasks.fails_before",
    }
    assert effects("fails_before") == []
    wait_until(lambda: ("finished", "FAILED") in signals.of(result.id), timeout=10)

    replay(DeadLetter.objects.filter(pk=dead.pk), replayed_by="tests")
    until_status(result, "SUCCESSFUL")
    assert result.return_value == "succeeded at attempt 4"
    assert result.attempts == 4 and len(result.errors) == 3
    assert effects("fails_before") == [4]
    # Once each time it finished: FAILED after its dead letter's commit, then SUCCESSFUL.
    wait_until(lambda: ("finished", "SUCCESSFUL") in signals.of(result.id), timeout=10)
    finished = [sent for sent in signals.of(result.id) if sent[0] == "finished"]
    assert finished == [("finished", "FAILED"), ("finished", "SUCCESSFUL")]

    # A copy of its message dead-lettered after it succeeded (past a quorum queue's delivery
    # limit, say): the dead letter is open again and the task stays SUCCESSFUL. A replay,
    # forced, runs it once more, started and counted as a new attempt; it ran with neither
    # before (the row stayed SUCCESSFUL, its attempts at 4, no signals).
    dead.refresh_from_db()
    record_dead_letter(
        consumer=dead.consumer,
        delivery=Delivery(bytes(dead.body), dead.queue, "", dead.queue, message_id=result.id),
        message_id=result.id,
        reason=FailureReason.DELIVERY_LIMIT,
        attempts=1,
        payload=dead.payload,
    )
    result.refresh()
    assert str(result.status) == "SUCCESSFUL"
    replay(DeadLetter.objects.filter(pk=dead.pk), replayed_by="tests", force=True)

    def ran_again() -> bool:
        relay_once()
        result.refresh()
        return result.attempts == 5 and str(result.status) == "SUCCESSFUL"

    wait_until(ran_again, timeout=30)
    assert result.return_value == "succeeded at attempt 5"
    assert effects("fails_before") == [4, 5]
    assert len(result.worker_ids) == 5
    wait_until(lambda: signals.of(result.id)[-1] == ("finished", "SUCCESSFUL"), timeout=10)
    assert [sent for sent in signals.of(result.id) if sent[0] == "started"] == [
        ("started", "RUNNING")
    ] * 5


def test_a_forced_replay_of_a_letter_naming_another_task_leaves_the_rows_result(
    worker: Any, outcomes: Outcomes, tasks_settings: TaskQueues
) -> None:
    # A forced replay makes a task that succeeded READY again only for a message that names
    # its task: this one runs nothing, and the row would have stayed READY, its result lost.
    result = tasks.add.enqueue(4, 4)
    until_status(result, "SUCCESSFUL")
    assert outcomes.wait(1) == ["processed"]
    payload = {"task_id": result.id, "task": "tests.integration.tasks.tasks.fails_before"}
    queue = tasks_settings.amqp_queue("default")
    dead = record_dead_letter(
        consumer=tasks_settings.consumer_name("default"),
        delivery=Delivery(json.dumps(payload).encode(), queue, "", queue, message_id=result.id),
        message_id=result.id,
        reason=FailureReason.DELIVERY_LIMIT,
        attempts=1,
        payload=payload,
    )
    replay(DeadLetter.objects.filter(pk=dead.pk), replayed_by="tests", force=True)
    relay_once()
    assert outcomes.wait(2) == ["processed", "dead_lettered"]
    dead.refresh_from_db()
    assert "names task 'tests.integration.tasks.tasks.fails_before'" in dead.exception_message
    result.refresh()
    assert (str(result.status), result.return_value, result.attempts) == ("SUCCESSFUL", 8, 1)
    assert effects("add") == [1]


def test_an_async_task_runs_in_the_attempts_transaction(worker: Any) -> None:
    result = tasks.async_fails_before.enqueue(2)
    until_status(result, "SUCCESSFUL")
    assert result.return_value == "succeeded at attempt 2"
    assert [e.exception_class for e in result.errors] == [tasks.Flaky]
    # The first attempt's effect, written through the async ORM, rolled back with its
    # transaction: the coroutine's queries ran on the attempt's connection.
    assert effects("async_fails_before") == [2]


@pytest.mark.parametrize("kind", ["set", "nul", "surrogate"])
def test_a_return_value_json_cannot_hold_fails_the_task_at_once(worker: Any, kind: str) -> None:
    # A NUL or a lone surrogate failed the batch's SUCCESSFUL write: the task stayed RUNNING
    # and its delivery became a dead letter blaming the consumer.
    bad = tasks.unstorable_back
    result = tasks.not_json_back.enqueue() if kind == "set" else bad.enqueue(kind)
    beside = tasks.add.enqueue(1, 2)
    until_status(result, "FAILED")
    assert result.attempts == 1
    (error,) = result.errors
    assert error.exception_class_path.endswith("ReturnValueNotJSON")
    assert DeadLetter.objects.get(message_id=result.id).reason == "permanent"
    until_status(beside, "SUCCESSFUL")


def test_run_after_waits_in_the_outbox_until_due(worker: Any) -> None:
    due = timezone.now() + dt.timedelta(seconds=2)
    result = tasks.add.using(run_after=due).enqueue(1, 1)
    assert OutboxMessage.objects.get(message_id=result.id).status == OutboxStatus.SCHEDULED
    assert relay_once() == 0
    result.refresh()
    assert result.status == TaskResultStatus.READY and result.task.run_after == due
    until_status(result, "SUCCESSFUL")
    assert result.started_at is not None and result.started_at >= due


def declared_task_queues(tasks_settings: TaskQueues, service: Any) -> list[Any]:
    """The task queues' consumer specs, their exchange and queues declared as consume does (a
    service started and stopped)."""
    from reliable_messaging.task_runs.worker import consumer_specs

    specs = consumer_specs(tasks_settings)
    service(specs, relay=False).request_stop()
    wait_until(
        lambda: not any(t.name == "rm-test-service" for t in threading.enumerate()),
        timeout=30,
        message="the consumer stopped",
    )
    return specs


@pytest.mark.parametrize("deferred", [False, True], ids=["enqueued", "deferred"])
def test_a_task_whose_queue_is_gone_waits_in_the_outbox_until_the_queue_is_back(
    tasks_settings: TaskQueues, service: Any, outcomes: Outcomes, deferred: bool
) -> None:
    """A task's message is for its queue alone. With that queue gone (deleted by an operator,
    expired by a policy, on a node that is down) the broker returns it: the outbox keeps it,
    charged and sent again with backoff, until consume declares the queue again, and the task
    runs once. Sent as an event, it would be marked unrouted, its result READY for ever. So
    does a task deferred with ``run_after`` whose queue is gone when it falls due."""
    specs = declared_task_queues(tasks_settings, service)
    admin = support.broker_connection()
    try:
        admin.channel().queue_delete(tasks_settings.amqp_queue("default"))
    finally:
        admin.close()
    if deferred:
        due = timezone.now() + dt.timedelta(seconds=1)
        result = tasks.add.using(run_after=due).enqueue(5, 6)
        assert relay_once() == 0
        assert OutboxMessage.objects.get(message_id=result.id).status == OutboxStatus.SCHEDULED
        time.sleep(max(0.0, (due - timezone.now()).total_seconds()) + 0.1)
    else:
        result = tasks.add.enqueue(5, 6)
    relay_once()
    row = OutboxMessage.objects.get(message_id=result.id)
    assert (row.status, row.attempts) == (OutboxStatus.PENDING, 1), row.last_error
    assert "its queue does not exist now" in row.last_error
    result.refresh()
    assert result.status == TaskResultStatus.READY
    service(specs, on_outcome=outcomes)  # declares the queue again
    until_status(result, "SUCCESSFUL")  # sent again once its backoff (1 s) is over
    assert result.return_value == 11 and effects("add") == [1]
    assert outcomes.words() == ["processed"]


def test_a_ready_task_whose_message_the_broker_lost_is_sent_again_from_the_admin(
    tasks_settings: TaskQueues, service: Any, outcomes: Outcomes
) -> None:
    """A task whose message was sent and then lost (an operator purged its queue) stays READY
    for ever. The task admin's action sends a copy under its id, and consume runs the task
    once; a task whose message has not left the outbox, or that is no longer ready, is left
    alone and said so."""
    from django.contrib.auth.models import User
    from django.test import Client
    from django.urls import reverse

    specs = declared_task_queues(tasks_settings, service)
    lost = tasks.add.enqueue(1, 2)
    assert relay_once() == 1
    admin = support.broker_connection()
    try:
        assert admin.channel().queue_purge(tasks_settings.amqp_queue("default")).method
    finally:
        admin.close()
    waiting = tasks.add.enqueue(3, 4)
    client = Client()
    client.force_login(User.objects.create_superuser("ops", "ops@example.com", "x"))
    changelist = reverse("admin:reliable_messaging_taskrun_changelist")

    def send_again(*ids: str) -> str:
        form = {"action": "send_again", "_selected_action": list(ids)}
        response = client.post(changelist, form, follow=True)
        assert response.status_code == 200
        return response.content.decode()

    page = send_again(lost.id, waiting.id)
    assert "1 task&#x27;s message sent again" in page, page
    assert "1 selected task&#x27;s message has not left the outbox" in page
    copies = OutboxMessage.objects.filter(message_id=lost.id).order_by("pk")
    assert [row.status for row in copies] == [OutboxStatus.SENT, OutboxStatus.PENDING]
    assert copies[1].routing_key == tasks_settings.amqp_queue("default")
    assert OutboxMessage.objects.filter(message_id=waiting.id).count() == 1
    assert relay_once() == 2
    service(specs, on_outcome=outcomes)
    until_status(lost, "SUCCESSFUL")
    until_status(waiting, "SUCCESSFUL")
    assert (lost.return_value, waiting.return_value) == (3, 7)
    assert effects("add") == [1, 1] and outcomes.wait(2) == ["processed", "processed"]
    page = send_again(lost.id)
    assert "0 tasks&#x27; messages sent again" in page
    assert "1 selected task is not ready (running or finished)" in page
    assert OutboxMessage.objects.filter(message_id=lost.id).count() == 2


def test_cancel_scheduled_cancels_a_deferred_task_as_if_never_enqueued(
    tasks_settings: TaskQueues,
) -> None:
    due = timezone.now() + dt.timedelta(hours=1)
    result = tasks.add.using(run_after=due).enqueue(2, 2)
    with transaction.atomic():
        assert cancel_scheduled(result.id) is True
        transaction.set_rollback(True)
    result.refresh()  # the rollback undid the cancel
    assert result.status == TaskResultStatus.READY
    assert cancel_scheduled(result.id) is True
    with pytest.raises(TaskResultDoesNotExist):
        result.refresh()
    assert not OutboxMessage.objects.filter(message_id=result.id).exists()
    assert relay_once() == 0


async def _closing(call: Any) -> Any:
    """Await ``call`` and close the connection of the thread the framework ran it on."""
    try:
        return await call
    finally:
        await sync_to_async(connections.close_all)()


def test_aenqueue_outside_a_transaction_commits_at_once(worker: Any) -> None:
    result = asyncio.run(_closing(tasks.add.aenqueue(20, 22)))
    assert TaskRun.objects.filter(pk=result.id).exists()
    until_status(result, "SUCCESSFUL")
    again = asyncio.run(_closing(tasks.add.aget_result(result.id)))
    assert again.return_value == 42


def test_an_unknown_result_does_not_exist(tasks_settings: TaskQueues) -> None:
    with pytest.raises(TaskResultDoesNotExist):
        task_backends["default"].get_result("no-such-task")
    # Ids no row could have (from a URL, say) too, asked for before any query: not a database
    # error (a NUL), nor a connection opened on the async call's thread.
    for unknown in ("a\x00b", "x" * 65, "é"):
        with pytest.raises(TaskResultDoesNotExist):
            task_backends["default"].get_result(unknown)
        with pytest.raises(TaskResultDoesNotExist):
            asyncio.run(task_backends["default"].aget_result(unknown))


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [((1, 2.5, "x", None, True), {"k": "v"}), (([1, [2]], {"a": {"b": 1}}), {"k": [1]})],
    ids=["flat", "nested"],
)
def test_a_result_read_back_is_what_the_frameworks_constructor_builds(
    tasks_settings: TaskQueues, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    enqueued = tasks.always_fails.enqueue(*args, **kwargs)
    run = TaskRun.objects.get(pk=enqueued.id)
    at = timezone.now()
    for succeeded in (None, ({"returned": [1]}, at)):
        read = result_of(run, succeeded=succeeded)
        built: TaskResult[Any] = TaskResult(
            task=read.task,
            id=run.id,
            status=TaskResultStatus.SUCCESSFUL if succeeded else TaskResultStatus.READY,
            enqueued_at=run.enqueued_at,
            started_at=None,
            finished_at=at if succeeded else None,
            last_attempted_at=None,
            args=json.loads(json.dumps(args)),
            kwargs=kwargs,
            backend="default",
            errors=[],
            worker_ids=[],
        )
        if succeeded:
            object.__setattr__(built, "_return_value", {"returned": [1]})
        assert type(read) is TaskResult
        assert type(read.status) is TaskResultStatus
        for name in (field.name for field in dataclasses.fields(TaskResult)):
            assert getattr(read, name) == getattr(built, name), name
        # The result shares nothing with the row it was read from.
        run.args.append("more")
        run.kwargs["k2"] = 2
        if isinstance(run.args[0], list):
            run.args[0].append(3)
        assert read.args == built.args
        assert read.kwargs == built.kwargs
        run = TaskRun.objects.get(pk=enqueued.id)


@pytest.mark.parametrize(
    "args",
    [
        (decimal.Decimal("1.5"), 1),
        (dt.datetime(2030, 1, 1, tzinfo=dt.UTC), 1),
        ({1, 2}, 1),
        ({1: "a non-string key"}, 1),
        (float("nan"), 1),
        (object(), 1),
        # JSON, but text no JSON column stores: the row's write failed in the caller's
        # transaction, which could then only roll back.
        ("a\x00b", 1),
        ({"key": ["\udcff"]}, 1),
        ({"\x00": 1}, 1),
    ],
    ids=["decimal", "datetime", "set", "int-key", "nan", "object", "nul", "surrogate", "nul-key"],
)
def test_an_argument_json_cannot_carry_is_refused(
    args: tuple[Any, ...], tasks_settings: TaskQueues
) -> None:
    with transaction.atomic():
        with pytest.raises(InvalidTask, match="must be JSON"):
            tasks.add.enqueue(*args)
        # Refused before anything is written: the caller's transaction goes on.
        assert not TaskRun.objects.exists() and not OutboxMessage.objects.exists()


def test_what_the_backend_cannot_run_is_refused(tasks_settings: TaskQueues) -> None:
    with pytest.raises(InvalidTask):
        tasks.add.using(queue_name="not-in-queues")
    for priority in (-101, 101):  # the framework's range is -100 to 100
        with pytest.raises(InvalidTask):
            tasks.add.using(priority=priority)
    with pytest.raises(InvalidTask):
        task(lambda: None)
    hidden = task(tasks.plain_function)  # its path leads the worker to the plain function
    with pytest.raises(InvalidTask, match="cannot be imported by the worker"):
        hidden.enqueue()
    assert not TaskRun.objects.exists() and not OutboxMessage.objects.exists()
