"""broker/publish_frames.py: the relay's frames, byte for byte as pika's ``basic_publish`` writes
them, for a spread of properties, headers and bodies; and what pika refuses, refused alike.

pika's side is its own ``Connection._send_message`` run on a stand-in that records the frames
it outputs. That the encoder engages on pika's real connection and the broker takes what it
writes is tests/integration/broker/test_publish_frames.py.
"""

from __future__ import annotations

import datetime as dt
import decimal
import struct
from types import SimpleNamespace
from typing import Any

import pika.connection
import pika.exceptions
import pytest
from pika.spec import Basic

from reliable_messaging.broker import codec
from reliable_messaging.broker.publish_frames import PublishFrames, field_table
from reliable_messaging.broker.publisher import (
    ENCODING_ERRORS,
    message_properties,
    publish_frames_for,
)
from reliable_messaging.core.priorities import priority_of_headers

BODY_MAX = 131_072 - 8  # pika's default frame_max less a frame's framing


@pytest.fixture(autouse=True)
def corrected_codec() -> None:
    codec.install()  # Django's ready() did it already; idempotent


def pika_frames(*message: Any, channel: int = 1, body_max: int = BODY_MAX) -> list[bytes]:
    """What pika's Channel.basic_publish hands its connection's transport for ``message``
    (exchange, routing key, body, message id, timestamp, headers)."""
    exchange, routing_key, body, message_id, timestamp, headers = message
    written: list[bytes] = []
    connection = SimpleNamespace(_body_max_length=body_max, _output_marshaled_frames=written.extend)
    properties = message_properties(message_id, timestamp, headers)
    method = Basic.Publish(exchange=exchange, routing_key=routing_key, mandatory=True)
    pika.connection.Connection._send_message(connection, channel, method, (properties, body))  # type: ignore[arg-type,attr-defined]
    return written


def our_frames(*message: Any, channel: int = 1, body_max: int = BODY_MAX) -> list[bytes]:
    exchange, routing_key, body, message_id, timestamp, headers = message
    return PublishFrames(channel, body_max).encode(
        exchange,
        routing_key,
        body,
        message_id=message_id,
        timestamp=timestamp,
        headers=headers,
        priority=priority_of_headers(headers),
    )


# Every AMQP field type the relay sends, at the edges of each width, and what only pika's own
# encoder (as broker/codec.py corrects it) writes: floats, decimals, times, tables, arrays, bytes.
HEADERS: list[dict[Any, Any]] = [
    {},
    {"x-rm-published-at": 1_764_460_000_123, "x-rm-outbox-id": 42},
    {"x-rm-published-at": 1, "x-rm-outbox-id": 2**31 - 1, "x-rm-ordering-key": "order-7"},
    {"i32": -(2**31), "i32max": 2**31 - 1, "i64": 2**31, "neg64": -(2**31) - 1},
    {"max64": 2**63 - 1, "min64": -(2**63), "zero": 0},
    {"t": True, "f": False, "none": None, "empty": ""},
    {"unicode": "Grüße, 東京 🚚", "ключ": "значение", "long": "v" * 70_000},
    {"float": 1.5, "negative float": -0.0, "big": 1e300},
    {"decimal": decimal.Decimal("19.99"), "whole decimal": decimal.Decimal("100")},
    {"time": dt.datetime(2026, 11, 30, 1, 2, 3, tzinfo=dt.UTC), "naive": dt.datetime(1960, 1, 1)},
    {"table": {"nested": {"deeper": [1, "two", None, 2**40]}, "n": 1}, "array": [True, 1.5]},
    {"bytes": b"\x00\xffraw", b"bytes key": "value"},
    {"x-rm-priority": 7, "traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"},
    {"x-rm-priority": 0},
    {"x-rm-priority": 300, "x-rm-outbox-id": 5},  # a priority the property cannot carry
    {"x-rm-priority": True},  # a bool is not a priority
    {"int subclass": pika.compat.long(5), "bool-like int": struct.calcsize("b")},
]


@pytest.mark.parametrize("headers", HEADERS, ids=range(len(HEADERS)))
def test_the_header_spread_encodes_as_pika_does(headers: dict[Any, Any]) -> None:
    args = ("rm.events", "order.created", b'{"order_id": 1}', "0193b0c6-m", 1_764_460_000)
    assert our_frames(*args, dict(headers)) == pika_frames(*args, dict(headers))


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"{}",
        b"x" * (BODY_MAX - 1),
        b"x" * BODY_MAX,
        b"y" * (BODY_MAX + 1),
        bytes(range(256)) * 1500,  # 384,000 bytes: three frames, the last one short
        "é".encode() * (BODY_MAX // 2 + 3),
    ],
    ids=["empty", "tiny", "under frame", "at frame", "one over", "three frames", "unicode"],
)
def test_bodies_are_split_at_the_frame_size_as_pika_splits_them(body: bytes) -> None:
    args = ("", "rm.q", body, "m-1", 0, {"x-rm-outbox-id": 1})
    assert our_frames(*args) == pika_frames(*args)


def test_a_small_frame_size_splits_a_body_into_many_frames() -> None:
    args = ("ex", "rk", b"z" * 10_000 + b"end", "m", 7, {"k": "v"})
    ours = our_frames(*args, body_max=4088, channel=3)
    assert ours == pika_frames(*args, body_max=4088, channel=3)
    assert len(ours) == 2 + 3


@pytest.mark.parametrize(
    ("exchange", "routing_key", "message_id"),
    [
        ("", "", ""),
        ("ß-exchange", "order.créé.東京", "id-ü"),
        ("e" * 255, "r" * 255, "m" * 255),
        ("tasks", "🚚" * 63, "0" * 36),
    ],
)
def test_names_and_ids_encode_as_pika_does(
    exchange: str, routing_key: str, message_id: str
) -> None:
    args = (exchange, routing_key, b"[]", message_id, 2**40, {"x-rm-outbox-id": 9})
    assert our_frames(*args) == pika_frames(*args)
    encoder = PublishFrames(1, BODY_MAX)
    first = encoder.encode(
        exchange, routing_key, b"1", message_id="a", timestamp=1, headers={}, priority=None
    )
    again = encoder.encode(
        exchange, routing_key, b"2", message_id="b", timestamp=2, headers={}, priority=None
    )
    assert first[0] is again[0]  # the method frame is encoded once per exchange and key


UNENCODABLE: list[tuple[str, str, str, int, dict[Any, Any]]] = [
    ("e" * 256, "rk", "m", 0, {}),
    ("e", "é" * 128, "m", 0, {}),
    ("e", "rk", "m" * 256, 0, {}),
    ("e", "rk", "m", -1, {}),
    ("e", "rk", "m", 2**64, {}),
    ("e", "rk", "m", 0, {"k" * 256: 1}),
    ("e", "rk", "m", 0, {"huge": 2**63}),
    ("e", "rk", "m", 0, {"tiny": -(2**63) - 1}),
    ("e", "rk", "m", 0, {"object": object()}),
    ("e", "rk", "m", 0, {"set": {1, 2}}),
    ("e", "rk", "m", 0, {"surrogate": "\udcff"}),
]


@pytest.mark.parametrize("case", UNENCODABLE, ids=range(len(UNENCODABLE)))
def test_what_pika_cannot_encode_is_refused_alike(
    case: tuple[str, str, str, int, dict[Any, Any]],
) -> None:
    exchange, routing_key, message_id, timestamp, headers = case
    args = (exchange, routing_key, b"{}", message_id, timestamp, headers)
    try:
        frames = pika_frames(*args)
    except ENCODING_ERRORS as theirs:
        with pytest.raises(ENCODING_ERRORS) as ours:
            our_frames(*args)
        assert type(ours.value) is type(theirs)
    else:  # pika 1.3.0 writes 2**63 as an unsigned 64-bit int; later releases refuse it
        assert our_frames(*args) == frames


def test_the_table_alone_is_pikas_table() -> None:
    for headers in HEADERS:
        pieces: list[bytes] = []
        pika.data.encode_table(pieces, headers)
        assert field_table(headers) == b"".join(pieces)


def test_an_unknown_pika_falls_back_to_basic_publish() -> None:
    channel = SimpleNamespace(channel_number=1, _raise_if_not_open=lambda: None)
    known = SimpleNamespace(
        _body_max_length=BODY_MAX, bytes_sent=0, frames_sent=0, _adapter_emit_data=print
    )
    assert publish_frames_for(known, channel) is not None
    for missing in ("_body_max_length", "bytes_sent", "frames_sent", "_adapter_emit_data"):
        other = SimpleNamespace(**{k: v for k, v in vars(known).items() if k != missing})
        assert publish_frames_for(other, channel) is None
