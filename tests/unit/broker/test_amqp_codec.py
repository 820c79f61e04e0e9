"""broker/codec.py: content-header frames other clients send, decoded as pika hands them over.

Frames are built byte by byte (what Node's amqplib, py-amqp or a Java client put on the wire)
and decoded with pika's own ``decode_frame``, as the consumer's connection does. No broker.
"""

from __future__ import annotations

import datetime as dt
import struct
from typing import Any

import pika.data
import pika.exceptions
import pika.frame
import pika.spec
import pytest

from reliable_messaging.broker import codec as amqp_codec
from reliable_messaging.core.envelope import (
    UNDECODABLE_HEADER,
    DecodeError,
    Message,
    decode_delivery,
    delivery_from_frame,
)
from reliable_messaging.core.outcomes import FailureReason

UTC = dt.UTC
JS_NOW_MS = 1_700_000_000_123  # Date.now() where seconds were meant
JAVA_1960 = -315_619_200  # new Date(-315619200000L) / 1000: 1960-01-01


@pytest.fixture(autouse=True)
def codec() -> None:
    amqp_codec.install()  # Django's ready() did it already; idempotent


def short(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("B", len(raw)) + raw


def table(*entries: tuple[str | bytes, bytes]) -> bytes:
    """An AMQP field table from (name, type tag + encoded value) pairs."""
    body = b"".join(short(name) + value for name, value in entries)
    return struct.pack(">I", len(body)) + body


def double(value: float) -> bytes:
    return b"d" + struct.pack(">d", value)


def timestamp(bits: int) -> bytes:
    return b"T" + struct.pack(">Q", bits % 2**64)  # a negative value as its two's complement


def header_frame(headers: bytes, message_id: str = "m-1", body_size: int = 2) -> bytes:
    """A content-header frame: flags, a header table, message_id and content type."""
    flags = (
        pika.spec.BasicProperties.FLAG_CONTENT_TYPE
        | pika.spec.BasicProperties.FLAG_HEADERS
        | pika.spec.BasicProperties.FLAG_MESSAGE_ID
    )
    properties = struct.pack(">H", flags) + short("application/json") + headers + short(message_id)
    payload = struct.pack(">HHQ", 60, 0, body_size) + properties
    return struct.pack(">BHI", 2, 1, len(payload)) + payload + b"\xce"


def decoded_properties(frame: bytes) -> Any:
    consumed, header = pika.frame.decode_frame(frame)
    assert consumed == len(frame)
    assert isinstance(header, pika.frame.Header)
    return header.properties


def decoded_message(frame: bytes, body: bytes = b"{}") -> Message | DecodeError:
    method = pika.spec.Basic.Deliver(
        consumer_tag="c", delivery_tag=1, exchange="shop", routing_key="order.placed"
    )
    delivery = delivery_from_frame("q", method, decoded_properties(frame), body)
    return decode_delivery(delivery, max_body_bytes=1024)


# --------------------------------------------------------------------------- pika's own bugs


def test_pika_still_decodes_doubles_as_integers() -> None:
    # pika issue 599. When this fails, a pika release decodes doubles right: drop the "d" and
    # "f" cases of amqp_codec.decode_field_value (and this test).
    value, _ = amqp_codec.PIKA_DECODE_VALUE(double(3.75), 0)
    assert value == 3 and isinstance(value, int), "pika fixed doubles: drop the workaround"
    value, _ = amqp_codec.PIKA_DECODE_VALUE(b"f" + struct.pack(">f", 0.5), 0)
    assert value == 0, "pika fixed floats: drop the workaround"


@pytest.mark.parametrize("bits", [JS_NOW_MS, JAVA_1960 % 2**64])
def test_pika_still_fails_on_timestamps_it_cannot_make_a_datetime_of(bits: int) -> None:
    # When pika stops raising here, the "T" case of decode_field_value may be reconsidered.
    with pytest.raises((ValueError, OverflowError, OSError)):
        amqp_codec.PIKA_DECODE_VALUE(timestamp(bits), 0)


def test_pika_still_cannot_encode_floats_or_dates_before_1970() -> None:
    with pytest.raises(pika.exceptions.UnsupportedAMQPFieldException):
        amqp_codec.PIKA_ENCODE_VALUE([], 3.75)
    with pytest.raises(struct.error):
        amqp_codec.PIKA_ENCODE_VALUE([], dt.datetime(1960, 1, 1, tzinfo=UTC))


# --------------------------------------------------------------------------- the fixes


def test_install_is_idempotent() -> None:
    amqp_codec.install()
    amqp_codec.install()
    assert amqp_codec.installed()
    assert pika.data.decode_value is amqp_codec.decode_field_value
    assert amqp_codec.PIKA_DECODE_VALUE is not amqp_codec.decode_field_value


def test_doubles_and_floats_decode_exactly_nested_too() -> None:
    nested = table(("x", double(0.1)))
    array = b"A" + struct.pack(">I", 9) + double(-2.5e-8)
    frame = header_frame(
        table(
            ("ratio", double(3.75)),
            ("half", b"f" + struct.pack(">f", 0.5)),
            ("nested", b"F" + nested),
            ("list", array),
        )
    )
    headers = decoded_properties(frame).headers
    assert headers == {"ratio": 3.75, "half": 0.5, "nested": {"x": 0.1}, "list": [-2.5e-8]}
    assert isinstance(headers["ratio"], float)
    message = decoded_message(frame)
    assert isinstance(message, Message)
    assert message.headers["ratio"] == 3.75


@pytest.mark.parametrize(
    ("bits", "expected"),
    [
        (1_700_000_000, dt.datetime(2023, 11, 14, 22, 13, 20, tzinfo=UTC)),
        (JS_NOW_MS, dt.datetime(2023, 11, 14, 22, 13, 20, 123000, tzinfo=UTC)),
        (JAVA_1960, dt.datetime(1960, 1, 1, tzinfo=UTC)),
        (2**62, 2**62),  # neither seconds nor milliseconds of any date: the raw number
        (-(2**62), -(2**62)),
    ],
    ids=["seconds", "javascript-milliseconds", "java-before-1970", "huge", "huge-negative"],
)
def test_timestamps_decode_to_a_date_or_the_raw_number(bits: int, expected: Any) -> None:
    headers = decoded_properties(header_frame(table(("at", timestamp(bits))))).headers
    assert headers["at"] == expected
    assert isinstance(decoded_message(header_frame(table(("at", timestamp(bits))))), Message)


def test_floats_and_dates_before_1970_encode_and_come_back() -> None:
    sent: dict[str, Any] = {
        "ratio": 3.75,
        "born": dt.datetime(1960, 1, 1, tzinfo=UTC),
        "n": [0.1, {"x": 1e300}],
    }
    pieces: list[bytes] = []
    pika.data.encode_table(pieces, sent)
    received, _ = pika.data.decode_table(b"".join(pieces), 0)
    assert received == sent


# --------------------------------------------------------------------------- the guard


def nested_table(depth: int) -> bytes:
    inner = table(("leaf", b"t\x01"))
    for _ in range(depth):
        inner = table(("k", b"F" + inner))
    return inner


def test_headers_nested_beyond_the_recursion_limit_cost_the_message_not_the_connection() -> None:
    headers = table(
        ("tenant", b"S" + struct.pack(">I", 4) + b"acme"), ("deep", b"F" + nested_table(3000))
    )
    frame = header_frame(headers, message_id="m-deep")
    properties = decoded_properties(frame)  # pika alone raises RecursionError here
    assert properties.message_id == "m-deep"  # read past the table, by its length
    assert properties.content_type == "application/json"
    assert properties.headers["tenant"] == "acme"  # entries before the bad one are kept
    assert "RecursionError" in properties.headers[UNDECODABLE_HEADER]
    assert "'deep'" in properties.headers[UNDECODABLE_HEADER]
    result = decoded_message(frame, body=b'{"kept": true}')
    assert isinstance(result, DecodeError)
    assert result.reason == FailureReason.INVALID_HEADERS
    assert result.message_id == "m-deep"
    assert "could not be decoded" in result.detail


def test_an_unknown_field_type_costs_the_message_not_the_connection() -> None:
    frame = header_frame(table(("ok", b"t\x01"), ("odd", b"Z\x00\x00")), message_id="m-odd")
    properties = decoded_properties(frame)
    assert properties.message_id == "m-odd"
    assert properties.headers["ok"] is True
    assert "InvalidFieldTypeException" in properties.headers[UNDECODABLE_HEADER]
    result = decoded_message(frame)
    assert isinstance(result, DecodeError) and result.reason == FailureReason.INVALID_HEADERS


def test_a_truncated_header_table_keeps_what_was_read() -> None:
    good = table(("ok", b"t\x01"))
    lying = struct.pack(">I", 10_000) + good[4:]  # claims more than the frame holds
    frame = header_frame(lying)
    properties = decoded_properties(frame)
    assert UNDECODABLE_HEADER in properties.headers
    result = decoded_message(frame)
    assert isinstance(result, DecodeError) and result.reason == FailureReason.INVALID_HEADERS


def test_a_well_formed_frame_decodes_exactly_as_pika_does() -> None:
    sent = pika.spec.BasicProperties(
        content_type="application/json",
        headers={"a": 1, "b": "text", "c": [True, None]},
        delivery_mode=2,
        message_id="m-1",
        timestamp=1_700_000_000,
        app_id="shop",
    )
    encoded = b"".join(sent.encode())
    ours = pika.spec.BasicProperties().decode(encoded)
    theirs = amqp_codec.PIKA_DECODE_PROPERTIES(pika.spec.BasicProperties(), encoded)
    assert vars(ours) == vars(theirs)
