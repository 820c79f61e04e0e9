"""A consumer's queue the broker cannot serve when the relay declares the consumers' topology
(404: a classic queue that crashed, or whose node is down) is declared again, and bound, on the
connection the relay has: an event for it does not wait for the relay's next connection."""

from __future__ import annotations

import dataclasses
import logging
import urllib.parse

import pytest
from django.db import transaction

from reliable_messaging import publish
from reliable_messaging.broker.topology import declare_topology
from reliable_messaging.choices import OutboxStatus
from reliable_messaging.core.registry import ConsumerSpec
from reliable_messaging.models import OutboxMessage
from tests import support
from tests.faults.broker_api import queue_crashed
from tests.support import wait_until

from .conftest import OutboxEnv

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]


def bound_keys(queue: str) -> set[str]:
    """The routing keys ``queue`` is bound with (the default exchange's binding left out)."""
    found = support.management("GET", f"/queues/%2F/{urllib.parse.quote(queue, safe='')}/bindings")
    return {binding["routing_key"] for binding in found if binding["source"]}


def test_a_queue_the_broker_cannot_serve_is_declared_and_bound_later_on_the_same_connection(
    ob: OutboxEnv, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="reliable_messaging.relay")
    spec = ConsumerSpec(
        name=f"tests.outbox.redeclared.{ob.ns}",
        queue=f"rmtest.{ob.ns}.redeclared",
        handler=lambda message: None,
        bindings=("redeclared.#",),
    )
    # The queue exists, not bound yet, with the arguments the relay declares it with.
    connection = support.broker_connection()
    try:
        declare_topology(connection.channel(), [dataclasses.replace(spec, bindings=())])
    finally:
        connection.close()

    with queue_crashed("/", spec.queue):
        runner = ob.relay_thread(consumers=[spec])
        wait_until(
            lambda: "declared the queues and bindings of 1 registered consumer" in caplog.text,
            timeout=30,
            message="the relay's declaration",
        )
        assert bound_keys(spec.queue) == set()
        wait_until(
            lambda: any(spec.queue in note for note in runner.relay.health.notes()),
            timeout=10,
            message="the relay's health naming the queue it could not declare",
        )

    # The queue serves again: the relay binds it within its backoff, on the same connection.
    wait_until(
        lambda: bound_keys(spec.queue) == {"redeclared.#"},
        timeout=30,
        message="the relay declaring and binding the queue again",
    )
    # The bindings show on the broker a moment before the relay's loop hears the declaration
    # finished and clears its note.
    wait_until(
        lambda: not any(spec.queue in note for note in runner.relay.health.notes()),
        timeout=5,
        message="the relay's health note cleared once the queue is declared",
    )
    with transaction.atomic():
        message_id = publish("redeclared.one", {"n": 1})
    wait_until(
        lambda: OutboxMessage.objects.get(message_id=message_id).status == OutboxStatus.SENT,
        timeout=30,
        message="the event sent",
    )
    assert [m.message_id for m in ob.broker.drain(spec.queue, expected=1)] == [message_id]
    assert caplog.text.count("relay: publishing the outbox to") == 1  # one connection
    ob.stop_relay(runner)
