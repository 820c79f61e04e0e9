"""The consumer's broker transport over pika's ``BlockingConnection`` (the default): a thin
adapter adding the steps that take more than one AMQP method."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any, cast

import pika
import pika.exceptions
from pika.adapters.blocking_connection import BlockingConnection

from ..conf import MessagingSettings
from ..core.registry import ConsumerSpec
from .leftovers import retire_leftovers
from .probes import PassiveProbe
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

    def messages_ready(self, queues: Sequence[str]) -> int:
        ready = 0
        with contextlib.closing(PassiveProbe(self._connection)) as probe:
            for queue in queues:
                with contextlib.suppress(pika.exceptions.ChannelClosedByBroker):
                    ready += (probe.queue(queue) or (0, 0))[0]
        return ready

    def drop(self) -> None:
        """End the TCP stream without AMQP's close handshake, once every frame written so far
        (the acks) has left: a close would cancel the consumers first, and a single-active
        consumer's standby would get the ready messages ahead of the requeued ones
        (docs/guarantees.md, a graceful stop of an ordered partition's active consumer)."""
        impl: Any = getattr(self._connection, "_impl")  # noqa: B009 - pika private, see above
        transport = getattr(impl, "_transport", None)
        deadline = time.monotonic() + 10
        while (
            transport is not None
            and transport.get_write_buffer_size()
            and time.monotonic() < deadline
        ):
            self._connection.process_data_events(time_limit=0.05)
        sock = getattr(transport, "_sock", None)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(*CONNECTION_ERRORS):
            # pika notices the end of the stream and marks the connection closed.
            self._connection.process_data_events(time_limit=0.2)


class PikaTransport:
    """Consuming connections from :func:`~reliable_messaging.broker.topology.connect` (the nodes of
    ``BROKER_URL`` in a random order)."""

    connection_errors: tuple[type[BaseException], ...] = CONNECTION_ERRORS

    def connect(self, settings: MessagingSettings, name: str) -> PikaConnection:
        return PikaConnection(connect(settings, name=name), settings)
