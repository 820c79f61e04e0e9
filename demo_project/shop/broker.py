"""The demo's own use of RabbitMQ: a clean slate of queues, a poison message, queue depths.

The handlers' queues are the app's topology; the Celery queue is
declared by the Celery worker, so it may not exist yet when the demo starts.

The demo talks to the broker directly only for what the app deliberately does not offer: purging
queues and publishing a malformed message. Everything else goes through ``publish()``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pika
import pika.exceptions
from pika.spec import BasicProperties

from reliable_messaging.broker.topology import (
    connection_parameters,
    consumer_queues,
    declare_topology,
)
from reliable_messaging.conf import messaging_settings
from reliable_messaging.core.envelope import CONTENT_TYPE
from reliable_messaging.core.registry import ConsumerSpec

NOT_FOUND = 404


class DemoBroker:
    """One blocking connection of the demo process, kept apart from the workers' connections."""

    def __init__(self, specs: Iterable[ConsumerSpec], celery_queue: str) -> None:
        self.specs = list(specs)
        self.celery_queue = celery_queue
        self.consumer_queues = [q for spec in self.specs for q in consumer_queues(spec)]
        self._connection = pika.BlockingConnection(connection_parameters(name="run_demo"))
        self._channel = self._connection.channel()
        # The poison message must really be in the queues before the consumers start.
        self._channel.confirm_delivery()

    @property
    def queues(self) -> list[str]:
        return list(self.consumer_queues)

    def declare(self) -> None:
        """Declare the exchange and the handlers' queues (idempotent)."""
        declare_topology(self._channel, self.specs)

    def attached_consumers(self) -> dict[str, int]:
        """Queues some other process consumes right now, with how many consumers."""
        counts = {
            queue: self._channel.queue_declare(queue, passive=True).method.consumer_count or 0
            for queue in self.consumer_queues
        }
        celery = self._celery_queue_method()
        if celery is not None:
            counts[self.celery_queue] = celery.consumer_count or 0
        return {queue: count for queue, count in counts.items() if count}

    def purge(self) -> None:
        """Drop messages an interrupted run left behind, so they cannot skew this run's counts
        (tasks included: an email task for an order the reset deleted would fail)."""
        for queue in self.queues:
            self._channel.queue_purge(queue)
        if self._celery_queue_method() is not None:
            self._channel.queue_purge(self.celery_queue)

    def _celery_queue_method(self) -> Any:
        """The Celery queue's passive declare-ok, or None when no worker declared it yet. On
        a channel of its own: the broker closes the channel of a failed passive declare."""
        channel = self._connection.channel()
        try:
            return channel.queue_declare(self.celery_queue, passive=True).method
        except pika.exceptions.ChannelClosedByBroker as exc:
            if exc.reply_code != NOT_FOUND:
                raise
            return None
        finally:
            if channel.is_open:
                channel.close()

    def publish_raw(self, routing_key: str, body: bytes, *, message_id: str) -> None:
        """Publish ``body`` as is, bypassing the outbox (which only accepts valid JSON)."""
        self._channel.basic_publish(
            exchange=messaging_settings.exchange,
            routing_key=routing_key,
            body=body,
            properties=BasicProperties(
                content_type=CONTENT_TYPE,
                delivery_mode=pika.DeliveryMode.Persistent,
                message_id=message_id,
            ),
            mandatory=True,
        )

    def depths(self) -> dict[str, int]:
        """Messages ready in each queue. Deliveries a consumer holds unacked are not counted;
        once the consumers have exited, those are back in their queue and counted again."""
        return {
            queue: self._channel.queue_declare(queue, passive=True).method.message_count or 0
            for queue in self.queues
        }

    def close(self) -> None:
        if self._connection.is_open:
            self._connection.close()
