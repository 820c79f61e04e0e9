"""The consumer's broker transport over pika's blocking adapter (the default).

Everything here is a thin adapter: pika's ``BlockingConnection`` already has the shape of
:class:`~reliable_messaging.broker.transport.BrokerConnection`; this adds the steps that take
more than one AMQP method (topology, leftovers, a channel closed without cancelling its
consumers) and the retry publisher of :mod:`.retry_publisher`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, cast

import pika
from pika.adapters.blocking_connection import BlockingChannel, BlockingConnection

from .. import metrics
from ..conf import MessagingSettings
from ..core.envelope import CONTENT_TYPE, wire_headers
from ..registry import ConsumerSpec
from .leftovers import retire_leftovers
from .retry_publisher import RetryPublisher
from .topology import CONNECTION_ERRORS, connect, declare_topology
from .transport import BrokerChannel


class PikaConnection:
    """A consuming :class:`BlockingConnection` and the settings it was opened with."""

    def __init__(self, connection: BlockingConnection, settings: MessagingSettings) -> None:
        self._connection = connection
        self._settings = settings

    @property
    def is_open(self) -> bool:
        return bool(self._connection.is_open)

    def channel(self) -> BrokerChannel:
        return cast(BrokerChannel, self._connection.channel())

    def process_data_events(self, time_limit: float) -> None:
        self._connection.process_data_events(time_limit=time_limit)

    def add_callback_threadsafe(self, callback: Callable[[], None]) -> None:
        self._connection.add_callback_threadsafe(callback)

    def close(self) -> None:
        self._connection.close()

    def declare_topology(
        self, specs: Sequence[ConsumerSpec], known_unavailable: Collection[str] = ()
    ) -> tuple[BrokerChannel, dict[str, str]]:
        declared = declare_topology(
            self._connection.channel(), specs, self._settings, known_unavailable=known_unavailable
        )
        return cast(BrokerChannel, declared.channel), declared.unavailable

    def retire_leftovers(self, specs: Sequence[ConsumerSpec]) -> None:
        retire_leftovers(self._connection, specs, self._settings)

    def close_keeping_consumers(self, channel: BrokerChannel) -> None:
        """pika's ``BlockingChannel.close`` cancels every consumer before it closes the channel.
        On a single-active-consumer queue the cancel makes the broker activate the standby at
        once, and hand it the ready messages behind the ones this channel still holds, which
        come back only when the channel closes: order broken. Closing the channel itself makes
        the broker requeue what it held in place *before* it activates the next consumer."""
        if not channel.is_open:
            return
        blocking = cast(BlockingChannel, channel)
        impl: Any = getattr(blocking, "_impl")  # noqa: B009 - pika private, see above
        impl.close(reply_code=200, reply_text="graceful stop")
        deadline = time.monotonic() + 10
        while not blocking.is_closed and time.monotonic() < deadline:
            self._connection.process_data_events(time_limit=0.1)


class PikaTransport:
    """Consuming connections from :func:`~reliable_messaging.broker.topology.connect` (the nodes of
    ``BROKER_URL`` in a random order) and the :class:`RetryPublisher`."""

    connection_errors: tuple[type[BaseException], ...] = CONNECTION_ERRORS

    def connect(self, settings: MessagingSettings, name: str) -> PikaConnection:
        return PikaConnection(connect(settings, name=name), settings)

    def retry_publisher(
        self,
        settings: MessagingSettings,
        *,
        health: metrics.HealthState | None,
        on_missing: Callable[[str], None],
    ) -> RetryPublisher:
        return RetryPublisher(settings, health=health, on_missing=on_missing)

    def retry_properties(self, original: Any, headers: Mapping[str, Any]) -> pika.BasicProperties:
        return pika.BasicProperties(
            content_type=original.content_type or CONTENT_TYPE,
            delivery_mode=pika.DeliveryMode.Persistent,
            message_id=original.message_id,
            timestamp=original.timestamp,
            headers=wire_headers(headers),
        )
