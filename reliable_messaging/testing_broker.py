"""An in-memory twin of the consumer's broker transport, for fast tests of the real consumer.

``ConsumerService(specs, transport=StubTransport())`` runs the real connection thread, workers
and inbox (so a database is still needed) over queues held in memory:
:meth:`StubTransport.publish` puts a message on a queue, the stub delivers it within each
channel's prefetch window, and :attr:`StubTransport.log` records every ack, nack and retry copy
in order. Requeued messages come back ``redelivered``, as on RabbitMQ, and
:meth:`StubTransport.close_channel` plays the broker closing a channel. Not a broker: no
exchanges or bindings (publish to a queue by name), no delivery limits, and retry copies are
confirmed at once and, unless ``deliver_retries=False``, put back on their queue without the
delay.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from .broker.retry_publisher import RetryCopy
from .broker.topology import consumer_queues
from .broker.transport import OnMessage
from .conf import MessagingSettings
from .core.envelope import CONTENT_TYPE, wire_headers
from .core.registry import ConsumerSpec

__all__ = [
    "BrokerEvent",
    "StubChannel",
    "StubConnection",
    "StubConnectionLost",
    "StubMessage",
    "StubProperties",
    "StubTransport",
]


class StubConnectionLost(ConnectionError):
    """A stub connection or channel was used after it closed."""


@dataclass(frozen=True)
class StubProperties:
    """What pika calls ``BasicProperties``, the fields the consumer reads."""

    message_id: str | None = None
    content_type: str | None = CONTENT_TYPE
    timestamp: int | None = None
    headers: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class StubMessage:
    queue: str
    body: bytes
    # StubProperties, or what a retry copy carries (built by retry_properties).
    properties: Any
    redelivered: bool = False
    routing_key: str = ""
    exchange: str = ""


@dataclass(frozen=True)
class _Frame:
    """What pika calls ``Basic.Deliver``."""

    delivery_tag: int
    redelivered: bool
    exchange: str
    routing_key: str


@dataclass(frozen=True)
class BrokerEvent:
    """One thing the consumer did on the broker: ``kind`` is ``ack``, ``nack``, ``retry_copy``
    or ``channel_closed`` (by the broker); ``message_ids`` the messages it settled (all those an
    ack with ``multiple`` covered; "" for one without a message_id). ``connection`` counts the
    connections from 1."""

    kind: str
    connection: int
    channel: int
    delivery_tag: int = 0
    multiple: bool = False
    requeue: bool = False
    message_ids: tuple[str, ...] = ()
    # Why the broker closed the channel (channel_closed).
    reason: str = ""
    at: float = field(default_factory=time.monotonic)


@dataclass
class _Consumer:
    tag: str
    queue: str
    callback: OnMessage


class StubChannel:
    """One channel: consumers, a prefetch window and the deliveries it holds unacked."""

    def __init__(self, connection: StubConnection, number: int) -> None:
        self._connection = connection
        self._broker = connection.broker
        self.connection_number = connection.number
        self.channel_number = number
        self.is_open = True
        self.prefetch = 0
        self.consumers: list[_Consumer] = []
        self.unacked: dict[int, StubMessage] = {}
        self._tags = itertools.count(1)
        self._on_cancel: list[Callable[[Any], None]] = []

    def basic_qos(self, prefetch_count: int) -> None:
        self.prefetch = prefetch_count

    def basic_consume(self, queue: str, on_message_callback: OnMessage) -> str:
        with self._broker.lock:
            self._broker.queues.setdefault(queue, collections.deque())
            tag = f"ctag{self.channel_number}.{next(self._broker.ids)}"
            self.consumers.append(_Consumer(tag, queue, on_message_callback))
        return tag

    def basic_cancel(self, consumer_tag: str) -> None:
        with self._broker.lock:
            self.consumers = [c for c in self.consumers if c.tag != consumer_tag]

    def basic_ack(self, delivery_tag: int = 0, multiple: bool = False) -> None:
        with self._broker.lock:
            settled = self._take(delivery_tag, multiple)
            if settled is not None:
                self._broker.record("ack", self, delivery_tag, multiple=multiple, messages=settled)

    def basic_nack(
        self, delivery_tag: int = 0, multiple: bool = False, requeue: bool = True
    ) -> None:
        with self._broker.lock:
            settled = self._take(delivery_tag, multiple)
            if settled is None:
                return
            self._broker.record(
                "nack", self, delivery_tag, multiple=multiple, requeue=requeue, messages=settled
            )
            if requeue:
                self._broker.requeue(settled)

    def add_on_cancel_callback(self, callback: Callable[[Any], None]) -> None:
        self._on_cancel.append(callback)

    def close(self) -> None:
        self._close()

    # -- the stub's side -------------------------------------------------------------------------

    def _take(self, delivery_tag: int, multiple: bool) -> list[StubMessage] | None:
        """The deliveries an ack or nack settles; None when the tag is unknown, which RabbitMQ
        answers by closing the channel (406), as here."""
        if not self.is_open:
            raise StubConnectionLost(f"channel {self.channel_number} is closed")
        if delivery_tag not in self.unacked:
            self._close(by_broker=f"406 PRECONDITION_FAILED - unknown delivery tag {delivery_tag}")
            return None
        tags = [t for t in self.unacked if t <= delivery_tag] if multiple else [delivery_tag]
        return [self.unacked.pop(t) for t in sorted(tags)]

    def _close(self, by_broker: str | None = None) -> None:
        with self._broker.lock:
            if not self.is_open:
                return
            self.is_open = False
            held = [self.unacked[t] for t in sorted(self.unacked)]
            self.unacked.clear()
            self.consumers.clear()
            self._broker.requeue(held)
            if by_broker is not None:
                self._broker.record("channel_closed", self, 0, messages=held, reason=by_broker)
            self._broker.wake.notify_all()

    def _deliverable(self) -> list[tuple[_Consumer, _Frame, StubMessage]]:
        """Move messages from the consumed queues into this channel's window (broker lock)."""
        out: list[tuple[_Consumer, _Frame, StubMessage]] = []
        progress = True
        while self.is_open and progress:
            progress = False
            for consumer in self.consumers:
                if self.prefetch and len(self.unacked) >= self.prefetch:
                    return out
                queue = self._broker.queues.get(consumer.queue)
                if not queue:
                    continue
                message = queue.popleft()
                tag = next(self._tags)
                self.unacked[tag] = message
                frame = _Frame(tag, message.redelivered, message.exchange, message.routing_key)
                out.append((consumer, frame, message))
                progress = True
        return out


class StubConnection:
    """One consuming connection of a :class:`StubTransport`."""

    def __init__(self, broker: StubTransport, settings: MessagingSettings) -> None:
        self.broker = broker
        self.settings = settings
        self.number = len(broker.connections) + 1
        self.is_open = True
        self.channels: list[StubChannel] = []
        self._numbers = itertools.count(1)
        self._callbacks: collections.deque[Callable[[], None]] = collections.deque()

    def channel(self) -> StubChannel:
        if not self.is_open:
            raise StubConnectionLost("connection closed")
        with self.broker.lock:
            channel = StubChannel(self, next(self._numbers))
            self.channels.append(channel)
            return channel

    def add_callback_threadsafe(self, callback: Callable[[], None]) -> None:
        with self.broker.lock:
            if not self.is_open:
                raise StubConnectionLost("connection closed")
            self._callbacks.append(callback)
            self.broker.wake.notify_all()

    def process_data_events(self, time_limit: float = 0.0) -> None:
        if not self.is_open:
            raise StubConnectionLost("connection closed")
        deadline = time.monotonic() + time_limit
        while True:
            with self.broker.lock:
                callbacks = list(self._callbacks)
                self._callbacks.clear()
                deliveries = [
                    (channel, *delivery)
                    for channel in self.channels
                    for delivery in channel._deliverable()
                ]
                if not callbacks and not deliveries:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return
                    self.broker.wake.wait(left)
                    continue
            # Outside the lock, as pika dispatches: a callback may use the channels.
            for callback in callbacks:
                callback()
            for channel, consumer, frame, message in deliveries:
                consumer.callback(channel, frame, message.properties, message.body)
            return

    def close(self) -> None:
        with self.broker.lock:
            for channel in self.channels:
                channel._close()
            self.is_open = False
            self._callbacks.clear()

    def declare_topology(
        self, specs: Sequence[ConsumerSpec], known_unavailable: Collection[str] = ()
    ) -> tuple[StubChannel, dict[str, str]]:
        with self.broker.lock:
            for spec in specs:
                for queue in consumer_queues(spec, self.settings):
                    self.broker.queues.setdefault(queue, collections.deque())
        return self.channel(), {}

    def messages_ready(self, queues: Sequence[str]) -> int:
        with self.broker.lock:
            return sum(len(self.broker.queues.get(queue, ())) for queue in queues)

    def retire_leftovers(self, specs: Sequence[ConsumerSpec]) -> None:
        """Nothing is ever left over in memory."""

    def drop(self) -> None:
        self.close()


class _StubRetryPublisher:
    """Confirms each copy at once; puts it back on its queue unless told not to."""

    def __init__(self, broker: StubTransport) -> None:
        self._broker = broker

    def start(self) -> _StubRetryPublisher:
        return self

    def submit(self, copy: RetryCopy) -> None:
        with self._broker.lock:
            self._broker.retry_copies.append(copy)
            self._broker.log.append(BrokerEvent("retry_copy", 0, 0, message_ids=(copy.message_id,)))
            if self._broker.deliver_retries:
                # As the broker hands it back from the delay queue: through the default
                # exchange, under the queue's name.
                self._broker.queues.setdefault(copy.routing_key, collections.deque()).append(
                    StubMessage(
                        copy.routing_key, copy.body, copy.properties, routing_key=copy.routing_key
                    )
                )
                self._broker.wake.notify_all()
        copy.placed()

    def pending(self) -> int:
        return 0

    def refresh(self) -> None:
        pass

    def stop(self, timeout: float = 5.0) -> None:
        pass


class StubTransport:
    """The broker in memory; pass it as ``ConsumerService(..., transport=StubTransport())``."""

    connection_errors: tuple[type[BaseException], ...] = (StubConnectionLost,)

    def __init__(self, *, deliver_retries: bool = True) -> None:
        self.lock = threading.RLock()
        self.wake = threading.Condition(self.lock)
        self.deliver_retries = deliver_retries
        self.queues: dict[str, collections.deque[StubMessage]] = {}
        self.connections: list[StubConnection] = []
        self.log: list[BrokerEvent] = []
        self.retry_copies: list[RetryCopy] = []
        self.ids = itertools.count(1)

    # -- the transport -------------------------------------------------------------------------

    def connect(self, settings: MessagingSettings, name: str) -> StubConnection:
        with self.lock:
            connection = StubConnection(self, settings)
            self.connections.append(connection)
            return connection

    def retry_publisher(
        self, settings: MessagingSettings, *, health: Any, on_missing: Callable[[str], None]
    ) -> _StubRetryPublisher:
        return _StubRetryPublisher(self)

    def retry_properties(self, original: Any, headers: Mapping[str, Any]) -> StubProperties:
        return StubProperties(
            message_id=original.message_id,
            content_type=original.content_type or CONTENT_TYPE,
            timestamp=original.timestamp,
            headers=wire_headers(headers),
        )

    # -- the test's side -----------------------------------------------------------------------

    def publish(
        self,
        queue: str,
        body: bytes,
        *,
        message_id: str | None,
        headers: Mapping[str, Any] | None = None,
        routing_key: str = "",
        redelivered: bool = False,
    ) -> None:
        """Put a message at the tail of ``queue`` (created if need be)."""
        message = StubMessage(
            queue,
            body,
            StubProperties(message_id=message_id, headers=dict(headers or {})),
            redelivered=redelivered,
            routing_key=routing_key or queue,
        )
        with self.lock:
            self.queues.setdefault(queue, collections.deque()).append(message)
            self.wake.notify_all()

    def ready(self, queue: str) -> int:
        """Messages waiting in ``queue`` (not delivered)."""
        with self.lock:
            return len(self.queues.get(queue, ()))

    def unacked(self) -> int:
        """Messages delivered on an open channel and not yet settled."""
        with self.lock:
            return sum(
                len(ch.unacked) for conn in self.connections for ch in conn.channels if ch.is_open
            )

    def events(self, kind: str | None = None) -> list[BrokerEvent]:
        with self.lock:
            return [e for e in self.log if kind is None or e.kind == kind]

    def close_channel(self, queue: str, reason: str = "406 PRECONDITION_FAILED") -> int:
        """Close, as the broker would, the open channel consuming ``queue``: what it held goes
        back to the head of its queues, redelivered. Returns the channel's number."""
        with self.lock:
            for connection in self.connections:
                for channel in connection.channels:
                    if channel.is_open and any(c.queue == queue for c in channel.consumers):
                        channel._close(by_broker=reason)
                        return channel.channel_number
        raise LookupError(f"no open channel consumes {queue}")

    # -- bookkeeping (broker lock held) --------------------------------------------------------

    def record(
        self,
        kind: str,
        channel: StubChannel,
        delivery_tag: int,
        *,
        multiple: bool = False,
        requeue: bool = False,
        messages: Sequence[StubMessage] = (),
        reason: str = "",
    ) -> None:
        self.log.append(
            BrokerEvent(
                kind,
                channel.connection_number,
                channel.channel_number,
                delivery_tag,
                multiple=multiple,
                requeue=requeue,
                message_ids=tuple(m.properties.message_id or "" for m in messages),
                reason=reason,
            )
        )

    def requeue(self, messages: Sequence[StubMessage]) -> None:
        """Back to the head of their queues, in their order, marked redelivered."""
        for message in reversed(messages):
            queue = self.queues.setdefault(message.queue, collections.deque())
            queue.appendleft(replace(message, redelivered=True))
        self.wake.notify_all()
