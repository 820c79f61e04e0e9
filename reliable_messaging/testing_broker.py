"""In-memory twins of the broker transports: ``ConsumerService(specs,
transport=StubTransport())`` and ``build_relay(transport=StubPublisher())`` run the real consumer
and relay without RabbitMQ, but with the database (``docs/testing-handlers.md``)."""

from __future__ import annotations

import collections
import heapq
import itertools
import os
import select
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from .broker.limits import header_frame_of
from .broker.publisher import ChannelClosed, PublisherEvents, Returned, publish_properties
from .broker.topology import consumer_queues
from .broker.transport import OnMessage
from .conf import MessagingSettings
from .core.envelope import CONTENT_TYPE
from .core.registry import ConsumerSpec
from .core.routing import topic_matches

__all__ = [
    "BrokerEvent",
    "StubChannel",
    "StubConnection",
    "StubConnectionLost",
    "StubMessage",
    "StubProperties",
    "StubPublished",
    "StubPublisher",
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
    # StubProperties, or pika's (a retry copy's, sent by a relay over a StubPublisher).
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
    """One thing the consumer did on the broker: ``kind`` is ``ack``, ``nack`` or
    ``channel_closed`` (by the broker); ``message_ids`` the messages it settled."""

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
        self._settle("ack", delivery_tag, multiple, requeue=False)

    def basic_nack(
        self, delivery_tag: int = 0, multiple: bool = False, requeue: bool = True
    ) -> None:
        self._settle("nack", delivery_tag, multiple, requeue)

    def add_on_cancel_callback(self, callback: Callable[[Any], None]) -> None:
        """The stub broker never cancels a consumer."""

    def close(self, by_broker: str | None = None) -> None:
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

    # -- the stub's side -------------------------------------------------------------------------

    def _settle(self, kind: str, delivery_tag: int, multiple: bool, requeue: bool) -> None:
        """Take the deliveries an ack or nack settles; an unknown tag closes the channel (406),
        as RabbitMQ does."""
        with self._broker.lock:
            if not self.is_open:
                raise StubConnectionLost(f"channel {self.channel_number} is closed")
            if delivery_tag not in self.unacked:
                self.close(
                    by_broker=f"406 PRECONDITION_FAILED - unknown delivery tag {delivery_tag}"
                )
                return
            tags = [t for t in self.unacked if t <= delivery_tag] if multiple else [delivery_tag]
            settled = [self.unacked.pop(t) for t in sorted(tags)]
            self._broker.record(
                kind, self, delivery_tag, multiple=multiple, requeue=requeue, messages=settled
            )
            if requeue:
                self._broker.requeue(settled)

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
                channel.close()
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
        return sum(self.broker.ready(queue) for queue in queues)

    def retire_leftovers(self, specs: Sequence[ConsumerSpec]) -> None:
        """Nothing is ever left over in memory."""

    drop = close  # nothing to abandon in memory


class StubTransport:
    """The broker in memory; pass it as ``ConsumerService(..., transport=StubTransport())``."""

    connection_errors: tuple[type[BaseException], ...] = (StubConnectionLost,)

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.wake = threading.Condition(self.lock)
        self.queues: dict[str, collections.deque[StubMessage]] = {}
        self.connections: list[StubConnection] = []
        self.log: list[BrokerEvent] = []
        self.ids = itertools.count(1)

    def connect(self, settings: MessagingSettings, name: str) -> StubConnection:
        with self.lock:
            connection = StubConnection(self, settings)
            self.connections.append(connection)
            return connection

    # -- the test's side -----------------------------------------------------------------------

    def publish(
        self,
        queue: str,
        body: bytes,
        *,
        message_id: str | None = None,
        headers: Mapping[str, Any] | None = None,
        routing_key: str = "",
        redelivered: bool = False,
        properties: Any = None,
    ) -> None:
        """Put a message at the tail of ``queue`` (created if need be), with ``properties``
        (pika's, or :class:`StubProperties`) or else these ``message_id`` and ``headers``."""
        if properties is None:
            properties = StubProperties(message_id=message_id, headers=dict(headers or {}))
        message = StubMessage(
            queue, body, properties, redelivered=redelivered, routing_key=routing_key or queue
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
        """Close the open channel consuming ``queue`` as the broker would; its number."""
        with self.lock:
            for connection in self.connections:
                for channel in connection.channels:
                    if channel.is_open and any(c.queue == queue for c in channel.consumers):
                        channel.close(by_broker=reason)
                        return channel.channel_number
        raise LookupError(f"no open channel consumes {queue}")

    # -- bookkeeping (broker lock held) --------------------------------------------------------

    def record(
        self,
        kind: str,
        channel: StubChannel,
        delivery_tag: int,
        *,
        messages: Sequence[StubMessage] = (),
        **details: Any,
    ) -> None:
        """Log what was done on ``channel``; ``details`` are more fields of its event."""
        ids = tuple(m.properties.message_id or "" for m in messages)
        numbers = (channel.connection_number, channel.channel_number)
        self.log.append(BrokerEvent(kind, *numbers, delivery_tag, message_ids=ids, **details))

    def requeue(self, messages: Sequence[StubMessage]) -> None:
        """Back to the head of their queues, in their order, marked redelivered."""
        for message in reversed(messages):
            queue = self.queues.setdefault(message.queue, collections.deque())
            queue.appendleft(replace(message, redelivered=True))
        self.wake.notify_all()


# -- the relay's broker --------------------------------------------------------------------------


@dataclass(frozen=True)
class StubPublished:
    """A message a :class:`StubPublisher` took; ``connection`` counts connections from 1."""

    connection: int
    tag: int
    exchange: str
    routing_key: str
    body: bytes
    message_id: str
    headers: Mapping[str, Any]
    properties: Any = field(default=None, compare=False, repr=False)


@dataclass(order=True)
class _Timer:
    at: float
    callback: Callable[[], None] = field(compare=False)
    cancelled: bool = field(default=False, compare=False)


class StubPublisher:
    """The relay's :class:`~reliable_messaging.broker.publisher.PublisherTransport` in memory.

    ``confirms``: ``"in order"``, ``"reverse"``, ``"multiple"`` or ``"hold"`` (none);
    ``routes``: the bound routing-key patterns (others are returned); ``missing``: exchanges
    that do not exist (404); ``nack`` and ``refuse`` judge each message; ``on_publish`` sees
    each one taken. ``routed`` holds what reached a queue, in confirm order; with
    ``delivers_to``, what was routed through the default exchange (a retry copy) is also put on
    that consumer twin's queue of the routing key's name."""

    def __init__(
        self,
        *,
        confirms: str = "in order",
        routes: Collection[str] = ("#",),
        missing: Collection[str] = (),
        nack: Callable[[StubPublished], bool] | None = None,
        refuse: Callable[[StubPublished], tuple[int, str] | None] | None = None,
        on_publish: Callable[[StubPublished], None] | None = None,
        frame_max: int = 131072,
        delivers_to: StubTransport | None = None,
    ) -> None:
        assert confirms in ("in order", "reverse", "multiple", "hold"), confirms
        self.confirms = confirms
        self.routes = tuple(routes)
        self.missing = set(missing)
        self.nack = nack
        self.refuse = refuse
        self.on_publish = on_publish
        self.frame_max = frame_max
        self.delivers_to = delivers_to
        self.connections = 0
        self.published: list[StubPublished] = []  # every message the broker took
        self.routed: list[StubPublished] = []
        self.returned: list[StubPublished] = []
        self.nacked: list[StubPublished] = []
        self.channel_closes: list[tuple[int, str]] = []
        self.connection_closes: list[str] = []
        self._events: PublisherEvents | None = None
        self.is_open = False
        self._channel_open = False
        self._next_tag = 1
        self._unconfirmed: dict[int, StubPublished] = {}
        self._deaf = False  # a refusal or a drop is under way: nothing more is taken
        self._dropping = False  # the connection is going: nothing more is confirmed
        self._blocked = False
        self._known: set[str] = {""}  # exchanges the probe found (as ExchangeProbe caches them)
        self._timers: list[_Timer] = []
        self._readers: dict[int, Callable[[], None]] = {}
        self._lock = threading.Lock()
        self._posted: collections.deque[Callable[[], None]] = collections.deque()
        self._wake: tuple[int, int] | None = None

    @property
    def ready(self) -> bool:
        return self.is_open and self._channel_open

    more_brokers = False

    def run(self, events: PublisherEvents) -> None:
        """One connection: serve timers, posted callbacks, sockets and answers until it closes."""
        self.connections += 1
        self._events, self.is_open = events, True
        self._deaf = self._dropping = self._blocked = False
        with self._lock:
            self._wake = os.pipe()
        self.reopen_channel()
        try:
            while self.is_open:
                self._turn()
        finally:
            with self._lock:
                wake, self._wake = self._wake, None
                self._posted.clear()
            for fd in wake or ():
                os.close(fd)
            self.is_open = self._channel_open = False
            self._timers.clear()
            self._readers.clear()

    def publish(
        self,
        exchange: str,
        routing_key: str,
        body: bytes,
        *,
        message_id: str,
        timestamp: int,
        headers: dict[str, Any],
        stored_properties: bytes | None = None,
    ) -> int:
        assert self.ready, "publish on a closed channel"
        properties = publish_properties(message_id, timestamp, headers, stored_properties)
        # The frames pika would write: it fails here on what it cannot encode.
        size = header_frame_of(exchange, routing_key, len(body), properties)
        tag, self._next_tag = self._next_tag, self._next_tag + 1
        if self._deaf:
            return tag  # after a refusal the broker reads nothing more on the channel
        message = StubPublished(
            self.connections,
            tag,
            exchange,
            routing_key,
            body,
            message_id,
            dict(headers),
            properties,
        )
        if size > self.frame_max:
            self.drop_connection(
                f"(501, 'FRAME_ERROR - type 2, all octets = <<>>: "
                f"{{frame_too_large,{size},{self.frame_max}}}')"
            )
            return tag
        refusal = self.refuse(message) if self.refuse is not None else None
        if exchange in self.missing:
            refusal = (404, f"NOT_FOUND - no exchange '{exchange}' in vhost '/'")
        if refusal is not None:
            self.close_channel(*refusal)
            return tag
        self.published.append(message)
        self._unconfirmed[tag] = message
        if self.on_publish is not None:
            self.on_publish(message)
        return tag

    def flush(self) -> None:
        """Nothing is buffered."""

    def exchange_exists(self, exchange: str) -> bool:
        if exchange in self._known:
            return True  # remembered, as the real probe does, until forgotten
        if exchange in self.missing:
            return False
        self._known.add(exchange)
        return True

    def forget_exchange(self, exchange: str | None) -> None:
        self._known.discard(exchange or "")
        self._known.add("")

    def reopen_channel(self) -> None:
        self.post(self._open_channel)

    def close(self, reason: str = "Normal shutdown") -> None:
        self.post(lambda: self._close_connection(str((200, reason))))

    def abandon(self) -> None:
        self.is_open = False

    def call_later(self, delay: float, callback: Callable[[], None]) -> _Timer:
        timer = _Timer(time.monotonic() + delay, callback)
        heapq.heappush(self._timers, timer)
        return timer

    def cancel(self, timer: Any) -> None:
        if timer is not None:
            timer.cancelled = True

    def post(self, callback: Callable[[], None]) -> None:
        with self._lock:
            if self._wake is None:
                return  # the loop has ended, as with pika
            self._posted.append(callback)
            os.write(self._wake[1], b"x")

    def watch_readable(self, fd: int, callback: Callable[[], None]) -> None:
        self._readers[fd] = callback

    def unwatch(self, fd: int) -> None:
        self._readers.pop(fd, None)

    # -- what the test makes the broker do (from any thread, or from on_publish) -----------------

    def close_channel(self, reply_code: int, reply_text: str) -> None:
        """Refuse a publish: what went before is still confirmed, nothing after is read."""
        self._deaf = True
        self.post(lambda: self._close_channel(reply_code, reply_text))

    def drop_connection(
        self, reason: str = '(320, "CONNECTION_FORCED - broker forced connection closure")'
    ) -> None:
        """Close the connection at once: nothing unconfirmed is confirmed (nor routed)."""
        self._deaf = self._dropping = True
        self.post(lambda: self._close_connection(reason))

    def block(self, reason: str = "low on memory") -> None:
        """``connection.blocked``: no confirm comes until :meth:`unblock`."""
        self._blocked = True
        self.post(lambda: self._event("on_blocked", reason))

    def unblock(self) -> None:
        def unblocked() -> None:
            self._blocked = False
            self._event("on_unblocked")

        self.post(unblocked)

    def delete_exchange(self, exchange: str) -> None:
        """The exchange goes; the probe still remembers it until the broker's 404."""
        self.missing.add(exchange)

    def _turn(self) -> None:
        now = time.monotonic()
        while self._timers and self._timers[0].at <= now and self.is_open:
            timer = heapq.heappop(self._timers)
            if not timer.cancelled:
                timer.callback()
        with self._lock:
            posted = list(self._posted)
            self._posted.clear()
        for callback in posted:
            if self.is_open:
                callback()
        if not self.is_open:
            return
        self._settle()
        timeout = 0.2 if not self._timers else max(0.0, self._timers[0].at - time.monotonic())
        with self._lock:
            if self._posted:
                timeout = 0.0
            assert self._wake is not None
            wake = self._wake[0]
        readable, _, _ = select.select([wake, *self._readers], [], [], min(timeout, 0.2))
        for fd in readable:
            if fd == wake:
                os.read(wake, 4096)
            elif fd in self._readers:
                self._readers[fd]()

    def _event(self, name: str, *args: Any) -> None:
        if self._events is not None and self.is_open:
            getattr(self._events, name)(*args)

    def _open_channel(self) -> None:
        self._channel_open, self._next_tag, self._deaf = True, 1, False
        self._unconfirmed.clear()
        self._event("on_ready")

    def _close_channel(self, reply_code: int, reply_text: str) -> None:
        self._settle()  # the messages before the refused one are confirmed first
        self._channel_open = False
        self._unconfirmed.clear()
        self.channel_closes.append((reply_code, reply_text))
        description = str((reply_code, reply_text))
        self._event("on_channel_closed", ChannelClosed(True, reply_code, reply_text, description))

    def _close_connection(self, reason: str) -> None:
        if not self.is_open:
            return
        self._unconfirmed.clear()
        self.connection_closes.append(reason)
        self._event("on_connection_closed", reason)
        self.is_open = self._channel_open = False

    def _settle(self) -> None:
        """The broker's answers to what was published: returns, then confirms."""
        if self._blocked or self._dropping or self.confirms == "hold" or not self._unconfirmed:
            return
        taken = sorted(self._unconfirmed.items(), reverse=self.confirms == "reverse")
        self._unconfirmed.clear()
        answers = [(tag, m, not (self.nack is not None and self.nack(m))) for tag, m in taken]
        for _tag, message, acked in answers:
            if not acked:
                self.nacked.append(message)
            elif any(topic_matches(p, message.routing_key) for p in self.routes):
                self.routed.append(message)
                if self.delivers_to is not None and message.exchange == "":
                    # Before its confirm, as a broker enqueues a message before confirming it.
                    self.delivers_to.publish(
                        message.routing_key, message.body, properties=message.properties
                    )
            else:
                self.returned.append(message)
                returned = Returned(
                    dict(message.headers), message.exchange, message.routing_key, 312, "NO_ROUTE"
                )
                self._event("on_returned", returned)
        multiple = self.confirms == "multiple"
        for i, (tag, _message, acked) in enumerate(answers):
            if multiple and i + 1 < len(answers) and answers[i + 1][2] == acked:
                continue  # one ack or nack for the whole run
            self._event("on_confirm", tag, multiple, acked)
