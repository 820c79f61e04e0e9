"""Task priorities on the real broker: tasks waiting in their queue, then one ``manage.py
consume`` with a prefetch of 1 runs them in the order the broker hands them out. What each
broker and queue type does is what docs/tasks.md#priorities says: classic queues (declared with
x-max-priority) and 4.3's quorum queues run the higher priorities first, strictly; 4.0's quorum
queues two levels (above 0 or not), about two of the higher for one of the other; 3.10's quorum
queues in the order the tasks were sent. Runs on 3.10, 4.0 and 4.3 (the Makefile's slices)."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pika
import pytest
from django.test import override_settings

from reliable_messaging.broker.stored_properties import decoded_properties
from reliable_messaging.broker.topology import declare_topology
from reliable_messaging.conf import messaging_settings
from reliable_messaging.core.priorities import amqp_priority
from reliable_messaging.exceptions import TopologyMismatchError
from reliable_messaging.models import OutboxMessage, TaskRun
from reliable_messaging.task_runs.naming import TaskQueues
from reliable_messaging.task_runs.worker import consumer_specs
from tests import support
from tests.conftest import subprocess_env
from tests.support import ConsumeProcess, broker_connection, wait_until

from . import tasks
from .conftest import relay_once, until_status

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]

# In the order they are sent; a task's return value is its index here.
SENT = [-100, 0, 100, -50, 50, 0, 20, 0, 100, 100, 0]


@pytest.fixture
def task_options(ns: str) -> dict[str, Any]:
    """A retry delay long enough to find the retry copy waiting in the outbox."""
    return {"QUEUE_PREFIX": f"{ns}.tasks.", "MAX_ATTEMPTS": 2, "RETRY_DELAYS": [2]}


def _declare(queues: TaskQueues, rm_settings: dict[str, Any], queue_type: str) -> None:
    """The task queues as consume declares them, before any consumer."""
    with override_settings(RELIABLE_MESSAGING={**rm_settings, "QUEUE_TYPE": queue_type}):
        connection = broker_connection()
        try:
            declare_topology(connection.channel(), consumer_specs(queues), messaging_settings)
        finally:
            connection.close()


def _waiting(queue: str) -> int:
    connection = broker_connection()
    try:
        return int(connection.channel().queue_declare(queue, passive=True).method.message_count)
    finally:
        connection.close()


def _expected_order(queue_type: str) -> list[int] | None:
    """The indexes of SENT in the order the broker under test delivers them (None: 4.0's
    quorum queues, checked apart)."""
    by_index = list(range(len(SENT)))
    strict = sorted(by_index, key=lambda i: -amqp_priority(SENT[i]))  # stable: FIFO per level
    if queue_type == "classic" or support.BROKER.name == "rabbitmq43":
        return strict
    if support.BROKER.name == "rabbitmq3":
        return by_index  # quorum queues before 4.0 ignore priorities
    return None


@pytest.mark.parametrize("queue_type", ["classic", "quorum"])
def test_waiting_tasks_run_by_priority_where_the_broker_honours_it(
    ns: str,
    rm_settings: dict[str, Any],
    tasks_settings: TaskQueues,
    transactional_db: Any,
    tmp_path: Path,
    queue_type: str,
) -> None:
    _declare(tasks_settings, rm_settings, queue_type)
    results = [tasks.add.using(priority=p).enqueue(index, 0) for index, p in enumerate(SENT)]
    queue = tasks_settings.amqp_queue("default")
    wait_until(
        lambda: relay_once() == 0 and _waiting(queue) == len(SENT),
        timeout=30,
        message="every task waiting in its queue",
    )
    env = subprocess_env(
        ns,
        RM_TEST_TASKS="1",
        RM_TEST_QUEUE_TYPE=queue_type,
        RM_TEST_PREFETCH="1",
        RM_TEST_CONSUMER_BATCH_SIZE="1",
    )
    proc = ConsumeProcess(["--queue", queue, "--concurrency", "1"], env, tmp_path / "log")
    try:
        proc.wait_consuming()
        for result in results:
            until_status(result, "SUCCESSFUL", timeout=60)
        proc.send(signal.SIGTERM)
        assert proc.wait(60) == 0, proc.log()
    finally:
        proc.close()
    runs = TaskRun.objects.filter(pk__in=[r.id for r in results]).order_by("started_at")
    ran = [run.return_value for run in runs]
    assert all(run.priority == SENT[run.return_value] for run in runs)  # the framework's value
    expected = _expected_order(queue_type)
    if expected is not None:
        assert ran == expected, [SENT[i] for i in ran]
        return
    # RabbitMQ 4.0's quorum queues: "high" (AMQP 5 to 9, our 1 to 100) and "normal" (the rest),
    # each in the order sent, about two high for one normal while both wait.
    high = [i for i in range(len(SENT)) if SENT[i] > 0]
    assert [i for i in ran if i in high] == high
    assert [i for i in ran if i not in high] == [i for i in range(len(SENT)) if i not in high]
    assert ran[:2] == high[:2], [SENT[i] for i in ran]
    assert set(ran[: len(high) + 2]) >= set(high), [SENT[i] for i in ran]


def test_a_retried_task_waits_in_the_outbox_with_its_priority(
    ns: str, rm_settings: dict[str, Any], worker: Any
) -> None:
    """The retry copy keeps the priority property: it waits in the outbox with its original's
    properties and goes back to the task queue with them, so the retried task is ordered as it
    was at first."""
    result = tasks.fails_before.using(priority=100).enqueue(2)
    relay_once()

    def copy() -> Any:
        return OutboxMessage.objects.filter(raw_properties__isnull=False).first()

    wait_until(lambda: copy() is not None, timeout=10, message="the retry copy in the outbox")
    waiting = copy()
    assert waiting is not None and waiting.routing_key.startswith(f"{ns}.tasks.")
    assert decoded_properties(waiting.raw_properties).priority == amqp_priority(100) == 9
    until_status(result, "SUCCESSFUL", timeout=30)
    assert result.attempts == 2


def test_a_classic_task_queue_declared_without_priorities_is_refused_with_the_way_out(
    ns: str, rm_settings: dict[str, Any], tasks_settings: TaskQueues
) -> None:
    """A classic task queue that exists without x-max-priority would ignore every priority, and
    no policy can give it one: consume refuses to start and says how to move it."""
    queue = tasks_settings.amqp_queue("default")
    connection = broker_connection()
    try:
        connection.channel().queue_declare(
            queue, durable=True, arguments={"x-queue-type": "classic"}
        )
    finally:
        connection.close()
    with pytest.raises(TopologyMismatchError) as refused:
        _declare(tasks_settings, rm_settings, "classic")
    assert "x-max-priority" in str(refused.value)
    assert "let the consumers empty the queue" in str(refused.value)
    assert support.queue_arguments(queue) == {"x-queue-type": "classic"}  # left as it was


def test_relay_properties_carry_the_priority_header_and_ignore_a_bad_one() -> None:
    from reliable_messaging.broker.publisher import message_properties

    assert message_properties("m", 0, {"x-rm-priority": 7}).priority == 7
    for bad in ("7", True, -1, 256, None):
        assert message_properties("m", 0, {"x-rm-priority": bad}).priority is None
    assert isinstance(message_properties("m", 0, {}), pika.BasicProperties)


@pytest.mark.parametrize("queue_type", ["classic", "quorum"])
def test_the_broker_check_names_a_task_queue_whose_priorities_are_ignored(
    rm_settings: dict[str, Any], tasks_settings: TaskQueues, queue_type: str
) -> None:
    """``messaging_status --broker`` on the broker under test: classic task queues as declared
    order strictly (nothing to say); quorum ones are named on 3.10 (ignored) and 4.0 (two
    levels), not on 4.3."""
    from reliable_messaging.broker.inspection import check_broker

    _declare(tasks_settings, rm_settings, queue_type)
    expected = {("classic", name): None for name in ("rabbitmq3", "rabbitmq4", "rabbitmq43")} | {
        ("quorum", "rabbitmq3"): ("warning", "task-priorities-ignored"),
        ("quorum", "rabbitmq4"): ("info", "task-priorities-two-levels"),
        ("quorum", "rabbitmq43"): None,
    }
    wanted = expected[queue_type, support.BROKER.name]
    queue = tasks_settings.amqp_queue("default")
    specs = consumer_specs(tasks_settings)
    found: list[tuple[str, str]] = []

    def checked() -> bool:
        with override_settings(RELIABLE_MESSAGING={**rm_settings, "QUEUE_TYPE": queue_type}):
            check = check_broker(specs)
        if any(f.code == "queue-not-sampled" for f in check.findings):
            return False  # its arguments are not published yet
        found[:] = [
            (f.severity, f.code)
            for f in check.findings
            if f.code.startswith("task-priorities") and f.subject == queue
        ]
        return True

    wait_until(checked, timeout=45, interval=0.5, message="the queues sampled")
    assert found == ([] if wanted is None else [wanted])


def test_a_replayed_task_is_sent_with_its_priority(
    rm_settings: dict[str, Any], worker: Any
) -> None:
    """The dead letter keeps the ``x-rm-priority`` header, the replay's outbox row carries it,
    and the relay sends that row with the priority property."""
    from reliable_messaging.broker.publisher import message_properties
    from reliable_messaging.dead_letters.replay import replay
    from reliable_messaging.models import DeadLetter, OutboxMessage

    result = tasks.fails_before.using(priority=100).enqueue(3)  # MAX_ATTEMPTS is 2 here
    until_status(result, "FAILED", timeout=60)
    dead = DeadLetter.objects.get(message_id=result.id)
    replay(DeadLetter.objects.filter(pk=dead.pk), replayed_by="tests")
    (row,) = OutboxMessage.objects.filter(headers__has_key="x-rm-replay")
    assert row.headers["x-rm-priority"] == 9
    assert message_properties(row.message_id, 0, dict(row.headers)).priority == 9
    until_status(result, "SUCCESSFUL", timeout=60)
