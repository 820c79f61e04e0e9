"""The consumer's seam around the broker: what its connection thread asks of a connection.

Implemented over pika (:mod:`.pika_transport`) and in memory
(:mod:`reliable_messaging.testing_broker`). Every method runs on the connection's thread except
:meth:`BrokerConnection.add_callback_threadsafe`, which is how the workers hand outcomes back.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ..conf import MessagingSettings
    from ..core.registry import ConsumerSpec

# (channel, method frame, properties, body), as pika calls a consumer.
OnMessage = Callable[[Any, Any, Any, bytes], None]


class BrokerChannel(Protocol):
    """One channel of a :class:`BrokerConnection`."""

    @property
    def channel_number(self) -> int: ...

    @property
    def is_open(self) -> bool: ...

    def basic_qos(self, prefetch_count: int) -> None: ...

    def basic_consume(self, queue: str, on_message_callback: OnMessage) -> str: ...

    def basic_cancel(self, consumer_tag: str) -> object: ...

    def basic_ack(self, delivery_tag: int = 0, multiple: bool = False) -> None: ...

    def basic_nack(
        self, delivery_tag: int = 0, multiple: bool = False, requeue: bool = True
    ) -> None: ...

    def add_on_cancel_callback(self, callback: Callable[[Any], None]) -> None: ...

    def close(self) -> None: ...


class BrokerConnection(Protocol):
    """One consuming connection."""

    @property
    def is_open(self) -> bool: ...

    def channel(self) -> BrokerChannel: ...

    def process_data_events(self, time_limit: float) -> None:
        """Serve the connection (deliveries, callbacks, heartbeats) for up to ``time_limit``s."""

    def add_callback_threadsafe(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` on the connection's thread; raises once the connection is gone."""

    def close(self) -> None: ...

    def declare_topology(
        self, specs: Sequence[ConsumerSpec], known_unavailable: Collection[str] = ()
    ) -> tuple[BrokerChannel, dict[str, str]]:
        """Declare what ``specs`` need; an open channel and the queues that cannot be
        declared now (their node down), with why."""

    def messages_ready(self, queues: Sequence[str]) -> int:
        """Messages ready in ``queues``; a queue the broker cannot serve counts none."""

    def retire_leftovers(self, specs: Sequence[ConsumerSpec]) -> None:
        """Retire the queues ``specs`` left behind (see :mod:`.leftovers`)."""

    def drop(self) -> None:
        """End the connection without the AMQP close handshake, once the acks written have left
        (an ordered stop: see :meth:`.pika_transport.PikaConnection.drop`)."""


class BrokerTransport(Protocol):
    """Opens consuming connections."""

    # What a lost or refused connection raises: the service reconnects on these.
    connection_errors: tuple[type[BaseException], ...]

    def connect(self, settings: MessagingSettings, name: str) -> BrokerConnection: ...
