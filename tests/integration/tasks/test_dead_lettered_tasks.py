"""A task whose delivery becomes a dead letter outside the consumer's pipeline (the crash
guard's, the ``.dead`` queue's) is FAILED with it, with an error that says why; and a delivery
put aside because another worker holds it is no attempt."""

from __future__ import annotations

import dataclasses
import signal
from pathlib import Path
from typing import Any

import psycopg
import pytest
from django.db import connection

from reliable_messaging.consuming.last_resort import ingest_delivery_limit
from reliable_messaging.consuming.processing import DeliveryProcessor, Job, process_batch
from reliable_messaging.core.advisory_locks import CLAIM_LOCK_CLASS
from reliable_messaging.core.envelope import Delivery, encode_payload
from reliable_messaging.core.outcomes import Acknowledge, ScheduleRetry
from reliable_messaging.models import DeadLetter, TaskRun
from reliable_messaging.storage import inbox as inbox_claim
from reliable_messaging.task_runs.failures import TaskDeadLettered
from reliable_messaging.task_runs.naming import TaskQueues
from reliable_messaging.task_runs.worker import consumer_specs
from tests.conftest import subprocess_env
from tests.markers import postgresql_only
from tests.support import ConsumeProcess
from tests.testapp.models import Effect

from . import tasks
from .conftest import relay_once, until_status

pytestmark = pytest.mark.django_db(transaction=True)


def delivery_of(queues: TaskQueues, result: Any, **fields: Any) -> Delivery:
    """The delivery of ``result``'s message as its consumer receives it."""
    return Delivery(
        body=encode_payload({"task_id": result.id, "task": result.task.module_path}),
        queue=queues.amqp_queue(result.task.queue_name),
        exchange="",
        routing_key=queues.amqp_queue(result.task.queue_name),
        message_id=result.id,
        content_type="application/json",
        **fields,
    )


def processor_of(queues: TaskQueues, queue_name: str = "default") -> DeliveryProcessor:
    consumer = queues.consumer_name(queue_name)
    (spec,) = [spec for spec in consumer_specs(queues) if spec.name == consumer]
    return DeliveryProcessor(spec)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_task_that_kills_its_process_is_failed_by_the_crash_guards_dead_letter(
    ns: str, tasks_settings: TaskQueues, tmp_path: Path
) -> None:
    """The task's attempt is RUNNING when its process dies; the next process's crash guard
    dead-letters the redelivered message without running it (CRASH_LIMIT=1), and the task is
    FAILED with it, the error naming the death, instead of RUNNING for ever; and
    ``task_finished`` is sent once, after the dead letter's commit."""
    env = subprocess_env(ns, RM_TEST_TASKS="1", RM_TEST_CRASH_LIMIT="1", RM_TEST_TASK_SIGNALS="1")
    queue = ["--queue", tasks_settings.amqp_queue("default")]
    # No relay beside its handlers: killed by the task before it recorded the row as sent, that
    # relay would leave it for the next process's relay to send again, and that fresh copy (not
    # a redelivery: the crash guard lets it run) would kill the next process too.
    killed = ConsumeProcess([*queue, "--no-relay"], env, tmp_path / "killed.log")
    try:
        killed.wait_consuming()  # its queues declared
        result = tasks.kills_its_process.enqueue()
        relay_once()
        assert killed.wait(60) == -signal.SIGKILL, killed.log()
    finally:
        killed.close()
    result.refresh()
    assert str(result.status) == "RUNNING" and result.attempts == 1
    failed_in_the_next_process(result, queue, env, tmp_path)
    letter = DeadLetter.objects.get(message_id=result.id)
    assert letter.reason == "worker_crashed"
    assert letter.consumer == tasks_settings.consumer_name("default")
    assert result.finished_at is not None
    assert result.attempts == 1  # the guard ran nothing more
    (error,) = result.errors
    assert error.exception_class is TaskDeadLettered
    assert "worker_crashed" in error.traceback and "died" in error.traceback
    assert signalled(result.id) == [("started", "RUNNING"), ("finished", "FAILED")]


def failed_in_the_next_process(
    result: Any, queue: list[str], env: dict[str, str], tmp_path: Path
) -> None:
    """A ``consume`` process that records the task's dead letter (FAILED), then exits idle."""
    survivor = ConsumeProcess([*queue, "--idle-timeout", "3"], env, tmp_path / "survivor.log")
    try:
        until_status(result, "FAILED", timeout=60)
        assert survivor.wait(60) == 0, survivor.log()
    finally:
        survivor.close()


def signalled(task_id: str) -> list[tuple[str, Any]]:
    """The task signals the ``manage.py consume`` processes sent of ``task_id`` (see
    ``tests/testapp/task_signals.py``), in order."""
    rows = Effect.objects.filter(consumer__startswith="signal.", message_id=task_id).order_by("pk")
    return [(row.consumer.removeprefix("signal."), row.payload) for row in rows]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_task_past_the_brokers_delivery_limit_in_real_processes_signals_its_failure_once(
    ns: str, tasks_settings: TaskQueues, tmp_path: Path
) -> None:
    """A quorum task queue with a delivery limit of 1 and a crash limit the task never reaches:
    the task kills the process that runs it and the one its redelivery goes to, the broker then
    dead-letters the message to the ``.dead`` queue, and the next process records it: FAILED,
    and ``task_finished`` once, after that commit."""
    env = subprocess_env(
        ns,
        RM_TEST_TASKS="1",
        RM_TEST_TASK_SIGNALS="1",
        RM_TEST_CRASH_LIMIT="10",
        RM_TEST_QUEUE_TYPE="quorum",
        RM_TEST_QUORUM_DELIVERY_LIMIT="1",
    )
    queue = ["--queue", tasks_settings.amqp_queue("default")]
    result = None
    for n in range(2):  # the delivery, then its redelivery
        # No relay beside the handlers, as in the test above.
        killed = ConsumeProcess([*queue, "--no-relay"], env, tmp_path / f"killed-{n}.log")
        try:
            killed.wait_consuming()
            if result is None:
                result = tasks.kills_its_process.enqueue()
                relay_once()
            assert killed.wait(60) == -signal.SIGKILL, killed.log()
        finally:
            killed.close()
    assert result is not None
    failed_in_the_next_process(result, queue, env, tmp_path)
    assert DeadLetter.objects.get(message_id=result.id).reason == "delivery_limit"
    assert result.attempts == 2
    assert signalled(result.id) == [
        ("started", "RUNNING"),
        ("started", "RUNNING"),
        ("finished", "FAILED"),
    ]


def test_a_task_past_the_brokers_delivery_limit_is_failed_by_its_dead_letter(
    tasks_settings: TaskQueues,
) -> None:
    """The quorum queue's ``.dead`` queue hands back a message the broker gave up on; the dead
    letter its consumer records fails the task in the same transaction."""
    result = tasks.add.enqueue(1, 2)
    queues = [tasks_settings.amqp_queue("default")]
    dead = delivery_of(
        tasks_settings,
        result,
        headers={"x-death": [{"queue": queues[0], "count": 20, "reason": "delivery_limit"}]},
    )
    dead = dataclasses.replace(dead, queue=f"{queues[0]}.dead")
    outcome = ingest_delivery_limit(processor_of(tasks_settings), dead, queues)
    assert outcome == Acknowledge("dead_lettered", "delivery_limit")
    result.refresh()
    assert str(result.status) == "FAILED" and result.finished_at is not None
    (error,) = result.errors
    assert error.exception_class is TaskDeadLettered
    assert "delivery_limit" in error.traceback and "20 deliveries" in error.traceback


def test_a_dead_letter_of_another_consumer_leaves_the_task_alone(
    tasks_settings: TaskQueues,
) -> None:
    """Only the task's own consumer's dead letter fails it: the consumer of the task's other
    queue (another name) recording one of the same message_id does not."""
    result = tasks.add.enqueue(1, 2)
    queues = [tasks_settings.amqp_queue("other")]
    dead = dataclasses.replace(delivery_of(tasks_settings, result), queue=f"{queues[0]}.dead")
    ingest_delivery_limit(processor_of(tasks_settings, "other"), dead, queues)
    assert DeadLetter.objects.filter(message_id=result.id).exists()
    result.refresh()
    assert str(result.status) == "READY" and result.errors == []


@postgresql_only
def test_a_delivery_another_worker_holds_is_put_aside_without_an_attempt(
    tasks_settings: TaskQueues,
) -> None:
    """A redelivered copy whose inbox row another transaction holds (the worker running it, or
    one cut off mid-batch) is put aside: the task's attempts and worker ids are the runs that
    happened, none for the copy."""
    result = tasks.add.enqueue(4, 5)
    processor = processor_of(tasks_settings)
    params = connection.get_connection_params()
    holder = psycopg.connect(
        psycopg.conninfo.make_conninfo(
            **{k: v for k, v in params.items() if k in ("dbname", "user", "host", "port")}
        ),
        autocommit=False,
    )
    try:
        with holder.cursor() as cursor:  # the other worker's claim, not committed
            cursor.execute(
                "SELECT pg_advisory_xact_lock(%s, %s)",
                [CLAIM_LOCK_CLASS, inbox_claim._key_hash(processor.spec.name, result.id)],
            )
        job = Job(processor, delivery_of(tasks_settings, result, redelivered=True))
        (outcome,) = process_batch([job])
    finally:
        holder.rollback()
        holder.close()
    assert isinstance(outcome, ScheduleRetry) and outcome.deferred
    run = TaskRun.objects.get(pk=result.id)
    assert (run.attempts, run.worker_ids, run.errors) == (0, [], [])
    # It runs when it comes back: one attempt, one worker.
    (outcome,) = process_batch([Job(processor, delivery_of(tasks_settings, result))])
    assert outcome == Acknowledge("processed")
    result.refresh()
    assert str(result.status) == "SUCCESSFUL" and result.return_value == 9
    assert result.attempts == 1 and len(result.worker_ids) == 1
