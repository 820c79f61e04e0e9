"""What the broker refuses for its size: a body over its ``max_message_size`` (learned by
asking: nothing else tells it), and properties over ``frame_max`` (one header frame too large
closes the whole connection)."""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Mapping
from typing import Any

import pika
import pika.exceptions
from pika import frame
from pika.adapters.blocking_connection import BlockingConnection
from pika.spec import Basic, BasicProperties

from ..conf import MessagingSettings, messaging_settings
from ..core.priorities import priority_of_headers
from .publish_frames import PublishFrames
from .publisher import ENCODING_ERRORS, Unencodable
from .replies import PRECONDITION_FAILED
from .topology import connect

# "message size 123 is larger than configured max size 45"
MESSAGE_SIZE = re.compile(r"message size (\d+)")
_REFUSAL = re.compile(r"message size (\d+) is larger than configured max size (\d+)")
# No queue can be named so (amq. is reserved): the probe is accepted and dropped, never delivered.
PROBE_ROUTING_KEY = "amq.reliable-messaging.size-probe"
# Room for the headers the relay adds to every row it sends (publish() cannot know them yet).
RELAY_HEADERS_ROOM = 64


# How long a max_message_size learned from a broker's refusal holds: an operator who raises the
# limit sees publish() take the larger bodies again within it, with no restart (a body still
# over it meanwhile becomes a row the relay fails at once, and the limit is learned again).
LEARNED_FOR = 60.0

# The max_message_size a broker last quoted in a refusal, with the monotonic time it did (None:
# none refused, or it was forgotten).
_learned: tuple[int, float] | None = None


def _learned_limit() -> int | None:
    """The broker's ``max_message_size`` learned in the last ``LEARNED_FOR`` seconds, or None."""
    global _learned
    learned = _learned
    if learned is None:
        return None
    if time.monotonic() - learned[1] > LEARNED_FOR:
        _learned = None
        return None
    return learned[0]


def body_size_refusal(size: int) -> str | None:
    """Why a body of ``size`` bytes must not be sent (over ``MAX_BODY_BYTES`` or the broker's
    learned limit), or None."""
    limit = messaging_settings.max_body_bytes
    if size > limit:
        return (
            f"the payload encodes to {size} bytes, over RELIABLE_MESSAGING"
            f"['MAX_BODY_BYTES'] ({limit}): consumers would dead-letter it unread"
        )
    broker_limit = _learned_limit()
    if broker_limit is not None and size > broker_limit:
        return (
            f"the payload encodes to {size} bytes, over the broker's max_message_size "
            f"({broker_limit}): the broker would refuse it. Lower RELIABLE_MESSAGING"
            f"['MAX_BODY_BYTES'] to at most {broker_limit}, or raise max_message_size"
        )
    return None


def size_limit_in(reply_text: object) -> int | None:
    """The broker's ``max_message_size`` quoted in a 406 refusal (and remembered for
    ``LEARNED_FOR`` seconds: the newest quote replaces an older one), or None."""
    global _learned
    found = _REFUSAL.search(str(reply_text))
    if not found:
        return None
    limit = int(found.group(2))
    _learned = (limit, time.monotonic())
    return limit


def broker_refuses(connection: BlockingConnection, size: int) -> int | None:
    """The broker's ``max_message_size`` if it refuses a body of ``size`` bytes (published to
    nowhere on a channel of its own); None when it takes it."""
    try:
        with connection.channel() as channel:
            channel.confirm_delivery()
            channel.basic_publish("", PROBE_ROUTING_KEY, b"\0" * size)
    except pika.exceptions.ChannelClosedByBroker as exc:
        if exc.reply_code == PRECONDITION_FAILED and (limit := size_limit_in(exc.reply_text)):
            return limit
        raise
    global _learned
    if _learned is not None and _learned[0] < size:
        _learned = None  # the broker took more than the limit it quoted: it was raised
    return None


def ask_broker(
    size: int, settings: MessagingSettings = messaging_settings, *, timeout: float = 5.0
) -> tuple[int | None, str | None]:
    """:func:`broker_refuses` on a connection of its own: (the limit, or None; why the broker
    could not be asked, or None)."""
    try:
        with connect(settings, name="reliable_messaging size check", timeout=timeout) as connection:
            return broker_refuses(connection, size), None
    except (pika.exceptions.AMQPError, OSError) as exc:
        return None, type(exc).__name__


def header_frame_size(properties: BasicProperties, body_size: int = 0) -> int:
    """Bytes of the content header frame carrying ``properties``, as pika writes it."""
    return len(frame.Header(1, body_size, properties).marshal())


def frame_size_refusal(size: int, frame_max: int) -> str | None:
    """Why a header frame of ``size`` bytes must not be sent on a connection tuned to
    ``frame_max``, or None."""
    if size <= frame_max:
        return None
    return (
        f"the message's properties and headers encode to a {size}-byte header frame, over the "
        f"broker's frame size (frame_max, {frame_max} bytes): the broker would close the "
        f"connection on it. Carry large values in the payload, which is split across frames"
    )


@functools.lru_cache(maxsize=8)
def _client_frame_max(urls: tuple[str, ...]) -> int:
    """The largest frame the relay's connections may negotiate: pika's 131072 unless the
    ``BROKER_URL`` asks for less (``?frame_max=``)."""
    return min(pika.URLParameters(url).frame_max for url in urls)


# Encodes a header frame as the relay writes it (a body of 0 bytes: no body frame).
_HEADER_FRAMES = PublishFrames(channel_number=1, body_max=1)


def header_frame_refusal(
    message_id: str, headers: Mapping[str, Any], settings: MessagingSettings = messaging_settings
) -> str | None:
    """Why a message with ``headers`` can never be sent (its header frame, encoded as the relay
    encodes it, over ``frame_max``), or None."""
    sent = dict(headers)
    _method, header = _HEADER_FRAMES.encode(
        "",
        "",
        b"",
        message_id=message_id,
        timestamp=0,
        headers=sent,
        priority=priority_of_headers(sent),
    )
    frame_max = _client_frame_max(tuple(settings.broker_urls))
    return frame_size_refusal(len(header) + RELAY_HEADERS_ROOM, frame_max)


def header_frame_of(
    exchange: str, routing_key: str, body_size: int, properties: BasicProperties
) -> int:
    """The size of the header frame pika would write for this publish; raises
    :class:`Unencodable` for a message pika cannot encode (as a publish would)."""
    try:
        Basic.Publish(exchange=exchange, routing_key=routing_key, mandatory=True).encode()
        return header_frame_size(properties, body_size)
    except ENCODING_ERRORS as exc:
        raise Unencodable(exc) from exc
