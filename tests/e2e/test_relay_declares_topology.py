"""No start order loses an event: the relay declares the registered consumers' queues and
bindings before it sends.

Real ``manage.py relay`` and ``consume`` processes on the test's namespace, which starts empty
(no exchange, no queue): the relay alone must make every event a registered consumer binds reach
its queue, with the arguments ``consume`` declares (``consume`` refuses to start over a queue
declared differently), while an event no consumer of the project binds is still ``unrouted``.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path
from typing import Any

import pytest
from django.db import transaction

from reliable_messaging import publish
from reliable_messaging.choices import OutboxStatus
from reliable_messaging.core.registry import registry
from reliable_messaging.models import OutboxMessage, ProcessedMessage
from tests.conftest import subprocess_env
from tests.support import (
    ConsumeProcess,
    ManageProcess,
    RelayProcess,
    broker_connection,
    queue_counts,
    queue_exists,
    wait_until,
)
from tests.testapp.models import Effect

DECLARED = re.compile(r"declared the queues and bindings of (\d+) registered consumer")


def declared(log: str) -> int:
    """How many registered consumers' topology the relay said it declared."""
    found = DECLARED.search(log)
    assert found, log
    return int(found.group(1))


pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]

EXTRA = "RM_TEST_EXTRA_CONSUMER"  # makes tests/testapp register tests.zeta (invoice.*)


def start(
    processes: list[ManageProcess],
    kind: type[ManageProcess],
    ns: str,
    tmp_path: Path,
    *args: str,
    **env: str,
) -> Any:
    log = tmp_path / f"{kind.command}-{len(processes) + 1}.log"
    process = kind(list(args), subprocess_env(ns, unset=(EXTRA,), **env), log)
    processes.append(process)
    return process


def relay_once(processes: list[ManageProcess], ns: str, tmp_path: Path, **env: str) -> str:
    relay = start(processes, RelayProcess, ns, tmp_path, "--once", **env)
    assert relay.wait(90) == 0, relay.log()
    return str(relay.log())


def statuses(*message_ids: str) -> dict[str, str]:
    rows = OutboxMessage.objects.filter(message_id__in=message_ids)
    return {row.message_id: row.status for row in rows}


def effects(label: str) -> dict[str, int]:
    """{message_id: how many times ``label``'s handler took effect}."""
    found: dict[str, int] = {}
    for message_id in Effect.objects.filter(consumer=label).values_list("message_id", flat=True):
        found[message_id] = found.get(message_id, 0) + 1
    return found


@pytest.mark.parametrize("queue_type", ["classic", "quorum"])
def test_relay_first_on_an_empty_broker_then_consume_handles_every_event_once(
    ns: str,
    rm_settings: dict[str, Any],
    processes: list[ManageProcess],
    tmp_path: Path,
    queue_type: str,
) -> None:
    assert not queue_exists(f"{ns}.alpha") and not queue_exists(f"{ns}.gamma.p0")
    with transaction.atomic():
        orders = [publish("order.placed", {"n": n}) for n in range(5)]
        # The ordered consumer's partitions, through its consistent-hash exchange.
        steps = [publish("seq.step", {"n": n}, ordering_key=f"k{n % 2}") for n in range(4)]
        # Nobody in this project binds payment.*: it must stay unrouted.
        nobody = publish("payment.captured", {"n": 0})

    relay = start(processes, RelayProcess, ns, tmp_path, RM_TEST_QUEUE_TYPE=queue_type)
    wanted = {**dict.fromkeys(orders + steps, OutboxStatus.SENT), nobody: OutboxStatus.UNROUTED}
    wait_until(
        lambda: statuses(*wanted) == wanted,
        timeout=60,
        message=lambda: f"every row sent (the payment unrouted): {statuses(*wanted)}",
    )
    # Nothing consumes yet: the events wait in the queues the relay declared (a quorum
    # queue's counts reach rabbitmqctl a moment later).
    wait_until(
        lambda: (
            queue_counts(f"{ns}.alpha") == (5, 0)
            and queue_counts(f"{ns}.beta") == (5, 0)
            and sum((queue_counts(f"{ns}.gamma.p{i}") or (0, 0))[0] for i in range(4)) == 4
        ),
        timeout=20,
        message="the events in the consumers' queues",
    )

    # consume declares the same queues with the same arguments (a difference would make it
    # exit with code 2 before it consumes anything).
    consume = start(processes, ConsumeProcess, ns, tmp_path, RM_TEST_QUEUE_TYPE=queue_type)
    consume.wait_consuming()
    wait_until(
        lambda: (
            effects("alpha") == dict.fromkeys(orders, 1)
            and effects("beta") == dict.fromkeys(orders, 1)
            and effects("gamma") == dict.fromkeys(steps, 1)
        ),
        timeout=60,
        message=lambda: f"each event handled once: {effects('alpha')} {effects('gamma')}",
    )
    assert ProcessedMessage.objects.filter(message_id__in=orders + steps).count() == 14
    assert not OutboxMessage.objects.filter(status=OutboxStatus.UNROUTED).exclude(message_id=nobody)
    relay.send(signal.SIGTERM)
    assert relay.wait(30) == 0, relay.log()
    # Every consumer the project registers (this process imported the same modules).
    assert declared(relay.log()) == len(registry)


def test_a_handler_added_by_a_deploy_receives_its_first_events(
    ns: str, rm_settings: dict[str, Any], processes: list[ManageProcess], tmp_path: Path
) -> None:
    # The first deploy has no invoice handler: its invoice event reaches nobody.
    with transaction.atomic():
        before = publish("invoice.created", {"n": 0})
    earlier = declared(relay_once(processes, ns, tmp_path))
    assert statuses(before) == {before: OutboxStatus.UNROUTED}

    # The next deploy adds tests.zeta; its relay runs before its consume starts.
    with transaction.atomic():
        first = [publish("invoice.created", {"n": n}) for n in range(1, 4)]
    log = relay_once(processes, ns, tmp_path, **{EXTRA: "1"})
    assert declared(log) == earlier + 1, log
    assert statuses(*first) == dict.fromkeys(first, OutboxStatus.SENT)

    consume = start(processes, ConsumeProcess, ns, tmp_path, **{EXTRA: "1"})
    consume.wait_consuming()
    wait_until(
        lambda: effects("zeta") == dict.fromkeys(first, 1),
        timeout=60,
        message=lambda: f"the new handler's first events, once each: {effects('zeta')}",
    )
    # What was unrouted before the handler existed stays so: it was nobody's then.
    assert statuses(before) == {before: OutboxStatus.UNROUTED}
    consume.send(signal.SIGTERM)
    assert consume.wait(30) == 0, consume.log()
    assert before not in effects("zeta")


def test_a_queue_declared_with_other_arguments_is_reported_and_the_relay_still_sends(
    ns: str, rm_settings: dict[str, Any], processes: list[ManageProcess], tmp_path: Path
) -> None:
    # As another version (or other settings) of consume would have left it.
    connection = broker_connection()
    try:
        connection.channel().queue_declare(
            f"{ns}.alpha", durable=True, arguments={"x-queue-type": "classic", "x-max-length": 999}
        )
    finally:
        connection.close()
    with transaction.atomic():
        orders = [publish("order.placed", {"n": n}) for n in range(2)]

    log = relay_once(processes, ns, tmp_path)

    assert statuses(*orders) == dict.fromkeys(orders, OutboxStatus.SENT), log
    mismatch = [line for line in log.splitlines() if f"queue '{ns}.alpha'" in line]
    assert mismatch and " ERROR " in mismatch[0] and "x-max-length" in mismatch[0], log
    # The drifted queue is bound all the same, and the other consumers' queues are declared.
    assert queue_counts(f"{ns}.alpha") == (2, 0)
    assert queue_counts(f"{ns}.beta") == (2, 0)


def test_relay_declares_topology_false_leaves_the_declaring_to_consume(
    ns: str, rm_settings: dict[str, Any]
) -> None:
    from django.test import override_settings

    from reliable_messaging.core.registry import ConsumerSpec
    from reliable_messaging.publishing.relay import build_relay

    solo = ConsumerSpec(
        name="tests.solo", queue=f"{ns}.solo", handler=lambda message: None, bindings=("solo.*",)
    )
    # A relay whose broker user may not configure the vhost: it declares nothing.
    with override_settings(RELIABLE_MESSAGING={**rm_settings, "RELAY_DECLARES_TOPOLOGY": False}):
        with transaction.atomic():
            early = publish("solo.done", {"n": 1})
        connection = broker_connection()
        try:  # the exchange exists (another process declared it), no queue is bound
            connection.channel().exchange_declare(
                rm_settings["EXCHANGE"], exchange_type="topic", durable=True
            )
        finally:
            connection.close()
        build_relay(once=True, consumers=[solo]).run()
    assert statuses(early) == {early: OutboxStatus.UNROUTED}
    assert not queue_exists(solo.queue)

    with transaction.atomic():
        later = publish("solo.done", {"n": 2})
    relay = build_relay(once=True, consumers=[solo])
    assert relay.run().sent == 1
    assert statuses(later) == {later: OutboxStatus.SENT}
    assert queue_counts(solo.queue) == (1, 0)
    assert relay.health.notes() == []


def test_a_relay_declares_again_after_a_reconnect(ns: str, rm_settings: dict[str, Any]) -> None:
    """A broker restart or a new node can lose what was declared: each connection declares."""
    import threading

    from django.db import connections

    from reliable_messaging.core.registry import ConsumerSpec
    from reliable_messaging.publishing.relay import build_relay

    solo = ConsumerSpec(
        name="tests.solo", queue=f"{ns}.solo", handler=lambda message: None, bindings=("solo.*",)
    )
    relay = build_relay(consumers=[solo])

    def run() -> None:
        try:
            relay.run()
        finally:
            connections.close_all()

    thread = threading.Thread(target=run, name="rm-test-relay", daemon=True)
    thread.start()
    try:
        wait_until(lambda: queue_exists(solo.queue), timeout=30, message="the queue declared")
        connection = broker_connection()
        try:  # as a node that lost it would be
            connection.channel().queue_delete(solo.queue)
        finally:
            connection.close()
        # The relay's connection ends (the broker went away), and the relay connects again.
        relay.publisher.post(lambda: relay.publisher.close("test: the broker went away"))
        wait_until(lambda: queue_exists(solo.queue), timeout=30, message="the queue again")
        with transaction.atomic():
            after = publish("solo.done", {"n": 1})
        wait_until(
            lambda: statuses(after) == {after: OutboxStatus.SENT},
            timeout=30,
            message=lambda: f"the event sent to the queue: {statuses(after)}",
        )
        assert queue_counts(solo.queue) == (1, 0)
    finally:
        relay.request_stop()
        thread.join(30)
    assert not thread.is_alive()
