"""The frames of the relay's ``basic.publish``, encoded in one step, byte for byte as pika's
``basic_publish`` writes them (docs/design.md, "The relay's frames")."""

from __future__ import annotations

import struct
from typing import Any

import pika.data
import pika.exceptions
import pika.spec
from pika.spec import BasicProperties

from ..core.envelope import CONTENT_TYPE

_FRAME_END = b"\xce"
_FRAME = struct.Struct(">BHI")  # type, channel, payload size
_METHOD_FRAME = 1
_HEADER_FRAME = 2
_BODY_FRAME = 3
# The content header's class (basic), weight (0) and body size, then the property flags.
_CONTENT_HEADER = struct.Struct(">HHQH")
_PUBLISH_METHOD = struct.pack(">IH", pika.spec.Basic.Publish.INDEX, 0)  # ticket 0
_MANDATORY = b"\x01"  # the bits octet: mandatory, not immediate
_INT32 = struct.Struct(">cI")
_SIGNED_INT = struct.Struct(">ci")
_UINT64 = struct.Struct(">Q")
_INT64 = struct.Struct(">cq")


def _long_letter() -> bytes | None:
    """The type letter pika writes a non-negative integer past 32 bits with (``l`` in pika 1.3
    and 1.4; 1.3 writes a negative one with another letter, so those are left to pika), if it
    writes one as 8 big-endian bytes."""
    pieces: list[bytes] = []
    sample = 2**40 + 5
    pika.data.encode_value(pieces, sample)
    raw = b"".join(pieces)
    if len(raw) == 9 and raw[1:] == sample.to_bytes(8, "big"):
        return raw[:1]
    return None


# A publish timestamp in milliseconds, on every message the relay sends, is such an integer.
_LONG = _long_letter()

# The properties every message of the relay has, in wire order around its headers: JSON,
# persistent; the priority only when its headers ask for one.
_FLAGS = (
    BasicProperties.FLAG_CONTENT_TYPE
    | BasicProperties.FLAG_HEADERS
    | BasicProperties.FLAG_DELIVERY_MODE
    | BasicProperties.FLAG_MESSAGE_ID
    | BasicProperties.FLAG_TIMESTAMP
)
_PERSISTENT = bytes([pika.DeliveryMode.Persistent.value])
# Method frames kept per (exchange, routing key); cleared past this many (a relay sends to few).
_METHOD_FRAMES_KEPT = 4096


def short_string(value: str | bytes) -> bytes:
    """An AMQP short string as pika encodes it (``ShortStringTooLong`` past 255 bytes)."""
    raw = value if isinstance(value, bytes) else value.encode("utf-8")
    if len(raw) > 255:
        raise pika.exceptions.ShortStringTooLong(raw)
    return bytes((len(raw),)) + raw


_CONTENT_TYPE = short_string(CONTENT_TYPE)

# Header names as short strings: a relay sends the same few names on every message.
_NAMES: dict[str, bytes] = {}
_NAMES_KEPT = 1024


def field_table(table: dict[Any, Any]) -> bytes:
    """``table`` as an AMQP field table, its size first, as ``pika.data.encode_table`` writes it.
    Values of exactly ``str``, ``int`` (32 bits, or 64 and not negative), ``bool`` and ``None``
    are written here; any other by ``pika.data.encode_value``, looked up at each call as pika's
    own table encoder does."""
    pieces: list[bytes] = [b""]
    append = pieces.append
    size = 0
    for key, value in table.items():
        name = _NAMES.get(key) if type(key) is str else None
        if name is None:
            name = short_string(key)
            if type(key) is str and len(_NAMES) < _NAMES_KEPT:
                _NAMES[key] = name
        append(name)
        size += len(name)
        kind = type(value)
        if kind is str:
            raw = value.encode("utf-8")
            append(_INT32.pack(b"S", len(raw)))
            append(raw)
            size += 5 + len(raw)
        elif kind is int and -0x80000000 <= value <= 0x7FFFFFFF:
            append(_SIGNED_INT.pack(b"I", value))
            size += 5
        elif kind is int and _LONG is not None and 0 <= value < 2**63:
            append(_INT64.pack(_LONG, value))
            size += 9
        elif kind is bool:
            append(b"t\x01" if value else b"t\x00")
            size += 2
        elif value is None:
            append(b"V")
            size += 1
        else:
            size += pika.data.encode_value(pieces, value)
    pieces[0] = struct.pack(">I", size)
    return b"".join(pieces)


class PublishFrames:
    """Encodes the relay's messages for one channel; a body goes in frames of at most
    ``body_max`` bytes (pika's ``Connection._body_max_length``: frame_max less a frame's 8 bytes
    of framing)."""

    def __init__(self, channel_number: int, body_max: int) -> None:
        self.channel_number = channel_number
        self.body_max = body_max
        self._methods: dict[tuple[str, str], bytes] = {}

    def method_frame(self, exchange: str, routing_key: str) -> bytes:
        """The ``basic.publish`` frame (mandatory) for this exchange and routing key."""
        key = (exchange, routing_key)
        frame = self._methods.get(key)
        if frame is None:
            payload = (
                _PUBLISH_METHOD + short_string(exchange) + short_string(routing_key) + _MANDATORY
            )
            frame = _FRAME.pack(_METHOD_FRAME, self.channel_number, len(payload))
            frame += payload + _FRAME_END
            if len(self._methods) >= _METHOD_FRAMES_KEPT:
                self._methods.clear()
            self._methods[key] = frame
        return frame

    def encode(
        self,
        exchange: str,
        routing_key: str,
        body: bytes,
        *,
        message_id: str,
        timestamp: int,
        headers: dict[Any, Any],
        priority: int | None,
    ) -> list[bytes]:
        """The frames of one message, as pika's ``basic_publish`` with ``message_properties``
        would write them; raises what pika raises for what it cannot encode."""
        method = self.method_frame(exchange, routing_key)
        table = field_table(headers)
        tail = short_string(message_id) + _UINT64.pack(timestamp)
        if priority is None:
            flags = _FLAGS
            middle = _PERSISTENT
        else:
            flags = _FLAGS | BasicProperties.FLAG_PRIORITY
            middle = _PERSISTENT + bytes((priority,))
        length = len(body)
        payload_size = _CONTENT_HEADER.size + len(_CONTENT_TYPE) + len(table) + len(middle)
        payload_size += len(tail)
        channel = self.channel_number
        frames = [
            method,
            _FRAME.pack(_HEADER_FRAME, channel, payload_size)
            + _CONTENT_HEADER.pack(BasicProperties.INDEX, 0, length, flags)
            + _CONTENT_TYPE
            + table
            + middle
            + tail
            + _FRAME_END,
        ]
        view = memoryview(body)
        for start in range(0, length, self.body_max):
            chunk = view[start : start + self.body_max]
            frames.append(_FRAME.pack(_BODY_FRAME, channel, len(chunk)) + chunk + _FRAME_END)
        return frames
