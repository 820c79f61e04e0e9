"""What RabbitMQ 4 changed under our queues, proven on both broker lines: 3.10.8 (the system
node) and 4.0.5 (tests/rabbitmq4.py).

4.0 gives every quorum queue a delivery limit of 20 and drops past it when the queue has no
dead-letter target, and a vhost can make quorum its default queue type: every queue we declare
states its type, and ``<queue>.dead`` states its limit and where what passes it goes.
"""

from __future__ import annotations

import json
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

import pika
import pytest
from django.test import override_settings

from reliable_messaging.broker.topology import all_delays, declare_topology, delay_exchange_name
from reliable_messaging.choices import DeadLetterReason
from reliable_messaging.core.registry import ConsumerSpec
from reliable_messaging.models import DeadLetter
from tests.support import wait_until

SYSTEM_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"
SYSTEM_MANAGEMENT_URL = "http://127.0.0.1:15672"


class Node:
    """One broker node: its AMQP URL and management API."""

    def __init__(self, url: str, management_url: str) -> None:
        self.url = url
        self.management_url = management_url

    def connection(self, vhost: str = "/") -> pika.BlockingConnection:
        base = self.url.rsplit("/", 1)[0]
        params = pika.URLParameters(f"{base}/{urllib.parse.quote(vhost, safe='')}")
        params.connection_attempts = 3
        params.retry_delay = 1
        return pika.BlockingConnection(params)

    def api(self, path: str, method: str = "GET") -> Any:
        request = urllib.request.Request(f"{self.management_url}/api/{path}", method=method)
        request.add_header("Authorization", "Basic Z3Vlc3Q6Z3Vlc3Q=")  # guest:guest
        with urllib.request.urlopen(request, timeout=10) as response:
            body = response.read()
        return json.loads(body) if body else None

    def queues(self, fragment: str, vhost: str = "/") -> dict[str, dict[str, Any]]:
        found = self.api(f"queues/{urllib.parse.quote(vhost, safe='')}?columns=name,type")
        return {q["name"]: q for q in found if fragment in q["name"]}

    def delete_matching(self, fragment: str, vhost: str = "/") -> None:
        quoted = urllib.parse.quote(vhost, safe="")
        for queue in self.queues(fragment, vhost):
            self.api(f"queues/{quoted}/{urllib.parse.quote(queue, safe='')}", "DELETE")
        for exchange in self.api(f"exchanges/{quoted}?columns=name"):
            if fragment in exchange["name"]:
                name = urllib.parse.quote(exchange["name"], safe="")
                self.api(f"exchanges/{quoted}/{name}", "DELETE")


@pytest.fixture(params=["rabbitmq-3.10", "rabbitmq-4.0"])
def node(request: pytest.FixtureRequest, ns: str) -> Iterator[Node]:
    if request.param == "rabbitmq-4.0":
        rabbitmq4 = request.getfixturevalue("rabbitmq4")
        found = Node(rabbitmq4.URL, rabbitmq4.MANAGEMENT_URL)
    else:
        found = Node(SYSTEM_URL, SYSTEM_MANAGEMENT_URL)
    yield found
    found.delete_matching(ns)


def payments(ns: str) -> ConsumerSpec:
    return ConsumerSpec(
        name=f"{ns}.payments",
        queue=f"{ns}.payments",
        handler=lambda message: None,
        bindings=("payment.*",),
    )


def bounce(channel: Any, queue: str, times: int) -> int:
    """Take the message off ``queue`` and give it back, up to ``times`` times or until the queue
    stays empty for a second (the broker moved it on); returns how many times it came."""
    came = 0
    empty_since: float | None = None
    while came < times:
        method, _, _ = channel.basic_get(queue)
        if method is None:
            empty_since = empty_since or time.monotonic()
            if time.monotonic() - empty_since > 1.0:
                break
            time.sleep(0.02)
            continue
        empty_since = None
        came += 1
        channel.basic_nack(method.delivery_tag, requeue=True)
    return came


def test_a_message_past_the_dead_queues_limit_is_kept_and_becomes_a_dead_letter(
    node: Node, ns: str, rm_settings: dict[str, Any], service: Any
) -> None:
    """RabbitMQ 4 gives ``.dead`` a limit of 20 when it states none, and drops past it: a
    message that came back more often than that (a consumer losing its connection again and
    again while the database is down) vanished without a trace."""
    spec = payments(ns)
    quorum = {
        **rm_settings,
        "BROKER_URL": node.url,
        "QUEUE_TYPE": "quorum",
        "QUORUM_DELIVERY_LIMIT": 3,
    }
    with override_settings(RELIABLE_MESSAGING=quorum):
        connection = node.connection()
        try:
            declare_topology(connection.channel(), [spec])
            channel = connection.channel()
            channel.basic_publish(
                rm_settings["EXCHANGE"],
                "payment.captured",
                b'{"order": 7}',
                pika.BasicProperties(
                    message_id="limit-1", content_type="application/json", delivery_mode=2
                ),
            )
            # Past the consumer queue's limit, then past the .dead queue's own (more than the
            # 20 that RabbitMQ 4 gives a quorum queue that states none).
            assert bounce(channel, spec.queue, 10) >= 3
            assert bounce(channel, f"{spec.queue}.dead", 25) >= 3
        finally:
            connection.close()
        service([spec])
        wait_until(
            lambda: DeadLetter.objects.filter(message_id="limit-1").exists(),
            timeout=30,
            message="the message that passed both limits stored as a dead letter",
        )
    dead = DeadLetter.objects.get(message_id="limit-1")
    assert dead.reason == DeadLetterReason.DELIVERY_LIMIT
    # Its origin is the consumer's queue, not the .dead queue it passed through last.
    assert (dead.consumer, dead.queue, dead.routing_key) == (
        spec.name,
        spec.queue,
        "payment.captured",
    )


def test_classic_queues_stay_classic_on_a_vhost_whose_default_type_is_quorum(
    rabbitmq4: Any, ns: str, rm_settings: dict[str, Any]
) -> None:
    """A queue declared without ``x-queue-type`` takes the vhost's default type: quorum, with
    the broker's delivery limit and no dead-letter target, where QUEUE_TYPE says classic. (The
    delay queues are quorum queues on every QUEUE_TYPE.)"""
    vhost = f"rm-{ns}"
    rabbitmq4.ctl("add_vhost", vhost, "--default-queue-type", "quorum")
    try:
        rabbitmq4.ctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
        node = Node(rabbitmq4.URL, rabbitmq4.MANAGEMENT_URL)
        spec = payments(ns)
        ordered = ConsumerSpec(
            name=f"{ns}.ledger",
            queue=f"{ns}.ledger",
            handler=lambda message: None,
            bindings=("payment.*",),
            ordered=True,
        )
        with override_settings(RELIABLE_MESSAGING={**rm_settings, "QUEUE_TYPE": "classic"}):
            connection = node.connection(vhost)
            try:
                declare_topology(connection.channel(), [spec, ordered])
            finally:
                connection.close()
            delays = [delay_exchange_name(d) for d in all_delays([spec, ordered])]
        types = {name: q["type"] for name, q in node.queues("", vhost).items()}
        ours = [spec.queue, *(f"{ordered.queue}.p{i}" for i in range(4))]
        assert {name: types.get(name) for name in ours} == dict.fromkeys(ours, "classic")
        assert {name: types.get(name) for name in delays} == dict.fromkeys(delays, "quorum")
    finally:
        rabbitmq4.ctl("delete_vhost", vhost)
