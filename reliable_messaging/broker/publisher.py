"""The relay's transport: a publisher with confirms on pika's ``SelectConnection``, seen
through :class:`PublisherTransport` and answering through :class:`PublisherEvents` (docs/design.md,
the transport seam). Every method runs on the I/O loop's thread, except ``post``.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import pika
import pika.channel
import pika.exceptions
from pika.spec import Basic, BasicProperties

from ..conf import MessagingSettings
from ..core.envelope import CONTENT_TYPE
from ..core.priorities import priority_of_headers
from .probes import ExchangeProbe
from .publish_frames import PublishFrames
from .queues import scrub_broker_secrets
from .stored_properties import decoded_properties
from .topology import connection_parameters
from .write_coalescing import coalesce_writes

# Logged under the relay's name, the one users' logging configuration knows.
logger = logging.getLogger("reliable_messaging.relay")


# What pika raises for a message it cannot encode (nothing is written then).
ENCODING_ERRORS: tuple[type[BaseException], ...] = (
    pika.exceptions.UnsupportedAMQPFieldException,
    pika.exceptions.ShortStringTooLong,
    struct.error,
    TypeError,
    ValueError,
    OverflowError,
    RecursionError,  # a table nested deeper than the interpreter's stack
)


class Unencodable(Exception):
    """pika cannot encode the message: nothing was written and no delivery tag was used."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(f"cannot encode the message: {error!r}")
        self.error = error


@dataclass(frozen=True)
class Returned:
    """A ``mandatory`` message the broker could route to no queue (``basic.return``)."""

    headers: dict[str, Any]
    exchange: str
    routing_key: str
    reply_code: int
    reply_text: str


@dataclass(frozen=True)
class ChannelClosed:
    """Why the channel closed; ``by_broker`` with the broker's reply code and text."""

    by_broker: bool
    reply_code: int
    reply_text: str
    description: str

    def __str__(self) -> str:
        return self.description


class PublisherEvents(Protocol):
    """What a :class:`ConfirmingPublisher` tells its owner, on the I/O loop's thread."""

    def on_ready(self) -> None:
        """A channel in confirm mode is open: publishing may start (tags start at 1)."""

    def on_confirm(self, tag: int, multiple: bool, acked: bool) -> None:
        """``basic.ack`` or ``basic.nack`` for ``tag`` (with ``multiple``: every tag up to it)."""

    def on_returned(self, returned: Returned) -> None:
        """An unroutable message; its confirm follows."""

    def on_channel_closed(self, closed: ChannelClosed) -> None:
        """The channel closed while the connection may still be open."""

    def on_connect_failed(self, error: str) -> None:
        """No connection could be opened: the loop is ending."""

    def on_connection_closed(self, reason: str) -> None:
        """The connection closed: the loop is ending."""

    def on_blocked(self, reason: str) -> None:
        """The broker stopped reading from the connection (a memory or disk alarm)."""

    def on_unblocked(self) -> None:
        """The broker reads from the connection again."""


class PublisherTransport(Protocol):
    """What the relay asks of the broker: a connection, a channel in confirm mode, its I/O loop."""

    @property
    def is_open(self) -> bool:
        """The connection is open."""

    @property
    def ready(self) -> bool:
        """The channel is open in confirm mode: publishing goes out."""

    @property
    def more_brokers(self) -> bool:
        """Another node of the list is left to try in this round of connects."""

    @property
    def frame_max(self) -> int:
        """The frame size the connection was tuned to."""

    def run(self, events: PublisherEvents) -> None:
        """Connect and run the I/O loop, telling ``events``, until the connection ends."""

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
        """Publish a persistent, mandatory message; its delivery tag, or :class:`Unencodable`.
        ``stored_properties`` (a retry copy's, encoded): sent as they are, ``headers`` added."""

    def flush(self) -> None:
        """Write what was published since the last flush."""

    def exchange_exists(self, exchange: str) -> bool:
        """Whether ``exchange`` exists (True when it cannot tell)."""

    def forget_exchange(self, exchange: str | None) -> None:
        """The broker said ``exchange`` is gone: ask again before the next publish to it."""

    def reopen_channel(self) -> None: ...

    def close(self, reason: str = "Normal shutdown") -> None:
        """Close the connection; the loop ends when the broker answers."""

    def abandon(self) -> None:
        """End the loop without the closing handshake (a blocked connection sends no Close-Ok)."""

    def call_later(self, delay: float, callback: Callable[[], None]) -> Any: ...

    def cancel(self, timer: Any) -> None: ...

    def post(self, callback: Callable[[], None]) -> None:
        """From any thread: run ``callback`` on the I/O loop (lost once the loop has ended)."""

    def watch_readable(self, fd: int, callback: Callable[[], None]) -> None: ...

    def unwatch(self, fd: int) -> None: ...


def message_properties(message_id: str, timestamp: int, headers: dict[str, Any]) -> BasicProperties:
    """The properties of a message the relay sends: JSON, persistent, with its id, its headers
    and the priority its ``x-rm-priority`` header asks for (a task's, see core/priorities.py)."""
    return BasicProperties(
        content_type=CONTENT_TYPE,
        delivery_mode=pika.DeliveryMode.Persistent,
        priority=priority_of_headers(headers),
        message_id=message_id,
        timestamp=timestamp,
        headers=headers,
    )


def publish_properties(
    message_id: str, timestamp: int, headers: dict[str, Any], stored: bytes | None
) -> BasicProperties:
    """A row's properties: a retry copy's as stored with ``headers`` added (see
    :mod:`.stored_properties`), else :func:`message_properties`."""
    if stored is None:
        return message_properties(message_id, timestamp, headers)
    properties = decoded_properties(stored)
    properties.headers = {**(properties.headers or {}), **headers}
    return properties


def publish_frames_for(connection: Any, channel: Any) -> PublishFrames | None:
    """The frame encoder for ``channel``, or None (use ``basic_publish``) when pika's internals
    are not the ones it knows."""
    body_max = getattr(connection, "_body_max_length", None)
    if not (isinstance(body_max, int) and body_max > 0):
        return None
    known = (
        isinstance(getattr(connection, "bytes_sent", None), int)
        and isinstance(getattr(connection, "frames_sent", None), int)
        and callable(getattr(connection, "_adapter_emit_data", None))
        and callable(getattr(channel, "_raise_if_not_open", None))
    )
    return PublishFrames(channel.channel_number, body_max) if known else None


class ConfirmingPublisher:
    """The :class:`PublisherTransport` over pika."""

    events: PublisherEvents  # the owner of the loop :meth:`run` runs

    def __init__(self, settings: MessagingSettings, name: str = "relay") -> None:
        self.settings = settings
        self.name = name
        self._connection: pika.SelectConnection | None = None
        self._channel: pika.channel.Channel | None = None
        # The open channel's frame encoder; None where this pika is not one it knows.
        self._frames: PublishFrames | None = None
        self._next_tag = 1
        # Broker URLs not yet tried in this round of connects (see run).
        self._brokers: list[pika.URLParameters] = []
        self._probe = ExchangeProbe(settings)

    def run(self, events: PublisherEvents) -> None:
        self.events = events
        if not self._brokers:  # a shuffled list: a node that is down costs one connect
            self._brokers = connection_parameters(self.settings, name=self.name)
        self._connection = pika.SelectConnection(
            self._brokers.pop(),
            on_open_callback=self._on_connection_open,
            on_open_error_callback=self._on_connection_open_error,
            on_close_callback=self._on_connection_closed,
        )
        try:
            self._connection.ioloop.start()
        except Exception:
            # A callback failed in a way nothing above handled (a channel closing under a
            # publish, say). Never die for it: the owner settles what it can, and reconnects.
            logger.exception("relay: unexpected error; reconnecting")
            events.on_connection_closed("unexpected error")
            self._close_quietly()
        finally:
            self._probe.close()  # its own connection, opened again by the next loop

    @property
    def more_brokers(self) -> bool:
        return bool(self._brokers)

    @property
    def is_open(self) -> bool:
        return self._connection is not None and self._connection.is_open

    @property
    def frame_max(self) -> int:
        if self._connection is None:
            return int(pika.ConnectionParameters.DEFAULT_FRAME_MAX)
        return int(self._connection.params.frame_max)

    @property
    def ready(self) -> bool:
        return self._channel is not None and self._channel.is_open

    def close(self, reason: str = "Normal shutdown") -> None:
        connection = self._connection
        if connection is None:
            return
        if connection.is_open:
            connection.close(reply_text=reason)
        else:
            connection.ioloop.stop()

    def abandon(self) -> None:
        if self._connection is not None:
            self._connection.ioloop.stop()

    def reopen_channel(self) -> None:
        if self._connection is not None and self._connection.is_open:
            self._connection.channel(on_open_callback=self._on_channel_open)

    def _close_quietly(self) -> None:
        connection, self._connection, self._channel = self._connection, None, None
        if connection is not None and connection.is_open:
            try:
                connection.close()
                connection.ioloop.start()  # runs until _on_connection_closed stops it
            except Exception:
                logger.debug("closing a broken relay connection failed", exc_info=True)

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
        channel = self._channel
        assert channel is not None
        frames = self._frames
        if frames is None or stored_properties is not None:
            # A retry copy's stored properties go as they are, through pika.
            properties = publish_properties(message_id, timestamp, headers, stored_properties)
            try:
                channel.basic_publish(exchange, routing_key, body, properties, mandatory=True)
            except ENCODING_ERRORS as exc:
                raise Unencodable(exc) from exc
        else:
            channel._raise_if_not_open()  # type: ignore[attr-defined]  # as basic_publish does
            try:
                encoded = frames.encode(
                    exchange,
                    routing_key,
                    body,
                    message_id=message_id,
                    timestamp=timestamp,
                    headers=headers,
                    priority=priority_of_headers(headers),
                )
            except ENCODING_ERRORS as exc:
                raise Unencodable(exc) from exc
            self._write(encoded)  # only once the whole message is encoded
        tag = self._next_tag
        self._next_tag += 1
        return tag

    def _write(self, frames: list[bytes]) -> None:
        """Hand a message's frames to the connection in one buffer as pika does, keeping its
        counts of bytes and frames sent (which its heartbeats read)."""
        connection: Any = self._connection
        data = frames[0] if len(frames) == 1 else b"".join(frames)
        connection.bytes_sent += len(data)
        connection.frames_sent += len(frames)
        connection._adapter_emit_data(data)

    def flush(self) -> None:
        """A few writes instead of three a message (see write_coalescing)."""
        coalesce_writes(self._connection)

    def exchange_exists(self, exchange: str) -> bool:
        return self._probe.exists(exchange)

    def forget_exchange(self, exchange: str | None) -> None:
        self._probe.forget(exchange)

    def call_later(self, delay: float, callback: Callable[[], None]) -> Any:
        assert self._connection is not None
        return self._connection.ioloop.call_later(delay, callback)

    def cancel(self, timer: Any) -> None:
        if timer is not None and self._connection is not None:
            self._connection.ioloop.remove_timeout(timer)

    def post(self, callback: Callable[[], None]) -> None:
        connection = self._connection
        if connection is not None:
            try:
                connection.ioloop.add_callback_threadsafe(callback)
            except Exception:
                logger.debug("the I/O loop is gone; dropping a callback", exc_info=True)

    def watch_readable(self, fd: int, callback: Callable[[], None]) -> None:
        assert self._connection is not None
        ioloop = self._connection.ioloop
        ioloop.add_handler(fd, lambda _fd, _events: callback(), ioloop.READ)

    def unwatch(self, fd: int) -> None:
        if self._connection is not None:
            try:
                self._connection.ioloop.remove_handler(fd)
            except Exception:
                logger.debug("removing a socket from the I/O loop failed", exc_info=True)

    def _on_connection_open(self, connection: pika.SelectConnection) -> None:
        connection.add_on_connection_blocked_callback(self._on_connection_blocked)
        connection.add_on_connection_unblocked_callback(lambda _c, _f: self.events.on_unblocked())
        connection.channel(on_open_callback=self._on_channel_open)

    def _on_connection_open_error(
        self, connection: pika.SelectConnection, error: BaseException | str
    ) -> None:
        shown = scrub_broker_secrets(str(error), self.settings)
        logger.warning("relay: cannot connect to %s: %s", self.settings.broker_shown, shown)
        self.events.on_connect_failed(shown)
        connection.ioloop.stop()

    def _on_connection_closed(
        self, connection: pika.SelectConnection, reason: BaseException
    ) -> None:
        self._channel = None
        self.events.on_connection_closed(scrub_broker_secrets(str(reason), self.settings))
        connection.ioloop.stop()

    def _on_channel_open(self, channel: pika.channel.Channel) -> None:
        self._channel = channel
        self._frames = publish_frames_for(self._connection, channel)
        self._next_tag = 1
        channel.add_on_close_callback(self._on_channel_closed)
        channel.add_on_return_callback(self._on_return)
        channel.confirm_delivery(
            ack_nack_callback=self._on_delivery_confirmation,
            callback=lambda _frame: self.events.on_ready(),
        )

    def _on_channel_closed(self, channel: pika.channel.Channel, reason: BaseException) -> None:
        self._channel = None
        self.events.on_channel_closed(
            ChannelClosed(
                by_broker=isinstance(reason, pika.exceptions.ChannelClosedByBroker),
                reply_code=int(getattr(reason, "reply_code", 0) or 0),
                reply_text=str(getattr(reason, "reply_text", "") or ""),
                description=str(reason),
            )
        )

    def _on_return(
        self,
        channel: pika.channel.Channel,
        method: Basic.Return,
        properties: BasicProperties,
        body: bytes,
    ) -> None:
        self.events.on_returned(
            Returned(
                headers=dict(properties.headers or {}),
                exchange=method.exchange or "",
                routing_key=method.routing_key or "",
                reply_code=int(method.reply_code or 0),
                reply_text=method.reply_text or "",
            )
        )

    def _on_connection_blocked(self, connection: pika.SelectConnection, frame: Any) -> None:
        self.events.on_blocked(getattr(frame.method, "reason", "") or "no reason given")

    def _on_delivery_confirmation(self, frame: Any) -> None:
        method = frame.method
        self.events.on_confirm(
            method.delivery_tag, bool(method.multiple), isinstance(method, Basic.Ack)
        )
