"""A part of the topology on a node that is down: the consumer consumes the rest, says what it
cannot, and takes the missing queue back once its node returns. Classic queues live on one node
(their home), so this is what a ``QUEUE_TYPE = "classic"`` deployment on a cluster meets."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pika
import pytest
from django.conf import settings
from django.test import override_settings

from reliable_messaging import Message
from reliable_messaging.broker.topology import declare_topology
from reliable_messaging.consuming.service import ConsumerService
from reliable_messaging.core.liveness import HealthState
from reliable_messaging.core.registry import ConsumerSpec
from tests.support import wait_until
from tests.testapp.models import Effect

from .rabbit_cluster import RabbitCluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.django_db(transaction=True)]


def _spec(ns: str, label: str) -> ConsumerSpec:
    def handler(message: Message) -> None:
        Effect.objects.create(consumer=label, message_id=message.message_id, attempt=1)

    return ConsumerSpec(
        name=f"{ns}.{label}", queue=f"{ns}.{label}", handler=handler, bindings=("order.*",)
    )


def _publish(url: str, exchange: str, message_id: str) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        channel.basic_publish(
            exchange,
            "order.placed",
            b"{}",
            pika.BasicProperties(
                message_id=message_id, content_type="application/json", delivery_mode=2
            ),
            mandatory=True,
        )
    finally:
        connection.close()


@pytest.fixture
def vhost(rabbit_cluster: RabbitCluster) -> Iterator[str]:
    rabbit_cluster.ensure_all_running()
    name = f"rmtopo{uuid.uuid4().hex[:8]}"
    rabbit_cluster.add_vhost(name)
    try:
        yield name
    finally:
        rabbit_cluster.ensure_all_running()
        rabbit_cluster.delete_vhost(name)


def test_a_classic_queue_whose_node_is_down_is_left_out_and_taken_back(
    rabbit_cluster: RabbitCluster, vhost: str
) -> None:
    ns = f"t{uuid.uuid4().hex[:8]}"
    alpha, beta = _spec(ns, "alpha"), _spec(ns, "beta")
    urls = rabbit_cluster.urls(vhost)
    values: dict[str, Any] = {
        **settings.RELIABLE_MESSAGING,
        "EXCHANGE": f"rmtest.{ns}",
        "QUEUE_TYPE": "classic",
        # The consumer is given the nodes that stay up; the third is the home of alpha's queue.
        "BROKER_URL": urls[:2],
    }
    with override_settings(RELIABLE_MESSAGING=values):
        # Alpha's queue is declared through the third node: a classic queue lives there.
        home = pika.BlockingConnection(pika.URLParameters(urls[2]))
        try:
            declare_topology(home.channel(), [alpha])
        finally:
            home.close()
        _publish(urls[0], f"rmtest.{ns}", "before-stop")  # waits in alpha's queue
        rabbit_cluster.stop(rabbit_cluster.nodes[2])
        health = HealthState()
        service = ConsumerService([alpha, beta], health=health)
        thread = threading.Thread(target=service.run, daemon=True)
        thread.start()
        try:
            assert service.connected.wait(60), "the consumer did not connect"
            wait_until(
                lambda: any(alpha.queue in note for note in health.notes()),
                timeout=30,
                message="alpha's queue named as unavailable",
            )
            ok, reasons = health.check()
            assert ok, reasons  # beta is consumed: the process works
            _publish(urls[1], f"rmtest.{ns}", "while-down")
            wait_until(
                lambda: Effect.objects.filter(consumer="beta", message_id="while-down").exists(),
                timeout=30,
                message="beta consumed while alpha's node is down",
            )
            rabbit_cluster.start(rabbit_cluster.nodes[2])
            wait_until(lambda: not health.notes(), timeout=60, message="alpha's queue taken back")
            # What waited in alpha's queue on the stopped node is handled once it is back.
            wait_until(
                lambda: Effect.objects.filter(consumer="alpha", message_id="before-stop").exists(),
                timeout=30,
                message="alpha's message handled after its node returned",
            )
        finally:
            service.request_stop()
            thread.join(30)
    # Beta's queue did not exist before the consumer declared it; the message published while
    # alpha's node was down could not reach alpha's queue (a classic queue's limit, named in the
    # docs). Every effect exactly once.
    effects = sorted(Effect.objects.values_list("consumer", "message_id"))
    assert effects == [("alpha", "before-stop"), ("beta", "while-down")]
