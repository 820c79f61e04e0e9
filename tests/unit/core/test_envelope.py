"""The wire format: decode_delivery for every bad input and the fields of a valid message;
encode_payload for the types business payloads carry. Pure logic: no broker, no database."""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import json
import uuid
from typing import Any

import pika.data
import pika.spec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from reliable_messaging.core import routing
from reliable_messaging.core.envelope import (
    ATTEMPT_HEADER,
    ORDERING_KEY_HEADER,
    ORIGINAL_EXCHANGE_HEADER,
    ORIGINAL_ROUTING_KEY_HEADER,
    PUBLISHED_AT_HEADER,
    DecodeError,
    Delivery,
    Message,
    decode_delivery,
    delivery_from_frame,
    derived_message_id,
    encode_payload,
    jsonable,
    normalize_headers,
    user_headers,
    wire_headers,
)
from reliable_messaging.core.outcomes import FailureReason
from reliable_messaging.core.routing import topic_matches

LIMIT = 1024


def delivery(body: bytes = b'{"order_id": 7}', **kwargs: Any) -> Delivery:
    values: dict[str, Any] = {
        "queue": "billing.charge",
        "exchange": "shop",
        "routing_key": "order.placed",
        "message_id": "m-1",
        "content_type": "application/json",
    }
    values.update(kwargs)
    return Delivery(body=body, **values)


def decode(d: Delivery, **kwargs: Any) -> Message | DecodeError:
    return decode_delivery(d, max_body_bytes=kwargs.pop("max_body_bytes", LIMIT), **kwargs)


def assert_error(result: Message | DecodeError, reason: str) -> DecodeError:
    assert isinstance(result, DecodeError), f"expected {reason}, got {result!r}"
    assert result.reason == reason, result
    assert result.detail  # says why, in words
    return result


# --------------------------------------------------------------------------- bad inputs


def test_invalid_json() -> None:
    err = assert_error(decode(delivery(b'{"order_id": ')), FailureReason.INVALID_JSON)
    assert err.message_id == "m-1"
    assert "not valid JSON" in err.detail


def test_invalid_utf8() -> None:
    err = assert_error(decode(delivery(b'{"name": "\xff\xfe"}')), FailureReason.INVALID_UTF8)
    assert "UTF-8" in err.detail


def test_empty_body() -> None:
    assert_error(decode(delivery(b"")), FailureReason.EMPTY_BODY)


@pytest.mark.parametrize("message_id", [None, "", b""])
def test_missing_message_id(message_id: Any) -> None:
    err = assert_error(decode(delivery(message_id=message_id)), FailureReason.MISSING_MESSAGE_ID)
    assert err.message_id == ""
    assert "message_id" in err.detail


def test_missing_message_id_is_derived_from_the_body_when_enabled() -> None:
    body = b'{"order_id": 7}'
    message = decode(delivery(body, message_id=None), derive_message_id=True)
    assert isinstance(message, Message)
    assert message.message_id == derived_message_id(body)
    assert message.message_id.startswith("sha256:")
    # The same body always gives the same id, so its duplicates are recognised.
    again = decode(delivery(body, message_id=None), derive_message_id=True)
    assert isinstance(again, Message) and again.message_id == message.message_id


def test_body_too_large() -> None:
    err = assert_error(decode(delivery(b"[" + b"1," * 600 + b"1]")), FailureReason.BODY_TOO_LARGE)
    assert "MAX_BODY_BYTES" in err.detail and str(LIMIT) in err.detail
    assert err.message_id == "m-1"


def test_body_exactly_at_the_limit_is_accepted() -> None:
    body = json.dumps("x" * (LIMIT - 2)).encode()
    assert len(body) == LIMIT
    assert isinstance(decode(delivery(body)), Message)


def test_body_too_large_is_reported_before_anything_is_decoded() -> None:
    # Neither the message id nor the bytes are looked at: the size alone decides.
    huge = b"\xff" * (LIMIT + 1)
    assert_error(decode(delivery(huge, message_id=None)), FailureReason.BODY_TOO_LARGE)


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "application/xml", "application/octet-stream", "application/x-pickle"],
)
def test_unsupported_content_type(content_type: str) -> None:
    err = assert_error(
        decode(delivery(content_type=content_type)), FailureReason.UNSUPPORTED_CONTENT_TYPE
    )
    assert content_type in err.detail


@pytest.mark.parametrize(
    "content_type",
    [
        None,
        "",
        "application/json",
        "application/json; charset=utf-8",
        "APPLICATION/JSON",
        "application/vnd.shop.order+json",
    ],
)
def test_json_content_types_are_accepted(content_type: str | None) -> None:
    assert isinstance(decode(delivery(content_type=content_type)), Message)


@pytest.mark.parametrize("attempt", ["abc", "", 0, -1, "0", True, 2.0, b"x", [1], {"n": 1}])
def test_invalid_attempt_header(attempt: Any) -> None:
    err = assert_error(
        decode(delivery(headers={ATTEMPT_HEADER: attempt})), FailureReason.INVALID_HEADERS
    )
    assert ATTEMPT_HEADER in err.detail


def test_message_id_longer_than_the_column_is_invalid() -> None:
    assert isinstance(decode(delivery(message_id="m" * 255)), Message)
    err = assert_error(decode(delivery(message_id="m" * 256)), FailureReason.INVALID_HEADERS)
    assert "255" in err.detail


# --------------------------------------------------------------------------- a valid message


def test_valid_message_fields() -> None:
    published_ms = 1_700_000_000_123
    d = delivery(
        b'{"order_id": 7, "amount": "9.99"}',
        redelivered=True,
        timestamp=1_600_000_000,
        headers={
            "tenant": "acme",
            PUBLISHED_AT_HEADER: published_ms,
            ORDERING_KEY_HEADER: "order-7",
            "x-death": [{"queue": "somewhere"}],
        },
    )
    message = decode(d)
    assert isinstance(message, Message)
    assert message.message_id == "m-1"
    assert message.payload == {"order_id": 7, "amount": "9.99"}
    assert message.routing_key == "order.placed"
    assert message.exchange == "shop"
    assert message.attempt == 1
    assert message.redelivered is True
    assert message.published_at == dt.datetime(2023, 11, 14, 22, 13, 20, 123000, tzinfo=dt.UTC)
    assert message.ordering_key == "order-7"
    # Handlers see the publisher's headers only: not ours, not the broker's bookkeeping.
    assert dict(message.headers) == {"tenant": "acme"}
    with pytest.raises(TypeError):
        message.headers["tenant"] = "other"  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        message.payload = {}  # type: ignore[misc]


@pytest.mark.parametrize(("raw", "expected"), [(None, 1), (1, 1), (2, 2), ("3", 3), (b"4", 4)])
def test_attempt_from_header(raw: Any, expected: int) -> None:
    headers = {} if raw is None else {ATTEMPT_HEADER: raw}
    message = decode(delivery(headers=headers))
    assert isinstance(message, Message)
    assert message.attempt == expected


def test_retried_copy_keeps_the_original_routing_key_and_exchange() -> None:
    # A retried copy comes back through the default exchange with the queue as routing key;
    # the handler must still see where the message was first published.
    d = delivery(
        exchange="",
        routing_key="billing.charge",
        headers={
            ATTEMPT_HEADER: 2,
            ORIGINAL_EXCHANGE_HEADER: b"shop",
            ORIGINAL_ROUTING_KEY_HEADER: "order.placed",
        },
    )
    message = decode(d)
    assert isinstance(message, Message)
    assert (message.exchange, message.routing_key, message.attempt) == ("shop", "order.placed", 2)


@pytest.mark.parametrize(
    ("exchange", "routing_key"), [("shop", "order.placed"), ("", "another.queue")]
)
def test_origin_headers_of_a_message_routed_to_the_queue_are_a_producers_claim(
    exchange: str, routing_key: str
) -> None:
    # Only our copies come through the default exchange under the queue's own name.
    d = delivery(
        exchange=exchange,
        routing_key=routing_key,
        headers={ORIGINAL_EXCHANGE_HEADER: "billing", ORIGINAL_ROUTING_KEY_HEADER: "order.paid"},
    )
    message = decode(d)
    assert isinstance(message, Message)
    assert (message.exchange, message.routing_key) == (exchange, routing_key)


def test_wire_headers_drop_the_headers_the_broker_routes_by() -> None:
    headers = {"CC": ["q1"], b"BCC": ["q2"], "cc": ["q3"], "x-user": 1}
    assert wire_headers(headers) == {"cc": ["q3"], "x-user": 1}


def test_published_at_falls_back_to_the_timestamp_property() -> None:
    message = decode(delivery(timestamp=1_600_000_000))
    assert isinstance(message, Message)
    assert message.published_at == dt.datetime(2020, 9, 13, 12, 26, 40, tzinfo=dt.UTC)
    message = decode(delivery(timestamp=None))
    assert isinstance(message, Message) and message.published_at is None


@pytest.mark.parametrize("raw", [10**30, float("inf"), float("nan"), -(10**30)])
def test_published_at_out_of_range_is_none_not_an_error(raw: Any) -> None:
    message = decode(delivery(headers={PUBLISHED_AT_HEADER: raw}))
    assert isinstance(message, Message)
    assert message.published_at is None


def test_bytes_message_id_and_ordering_key_are_text() -> None:
    message = decode(delivery(message_id=b"m-bytes", headers={ORDERING_KEY_HEADER: b"k-1"}))
    assert isinstance(message, Message)
    assert message.message_id == "m-bytes"
    assert message.ordering_key == "k-1"


def test_user_headers_drop_ours_and_the_brokers() -> None:
    headers = {
        "a": 1,
        "x-rm-attempt": 2,
        "x-death": [],
        "x-first-death-queue": "q",
        "x-custom": "kept",
    }
    assert user_headers(headers) == {"a": 1, "x-custom": "kept"}


def test_non_utf8_header_name_does_not_crash_decoding() -> None:
    # pika decodes a header name it cannot read as UTF-8 into bytes (pika/data.py
    # decode_short_string); user_headers() then calls bytes.startswith("x-rm-").
    result = decode(delivery(headers={b"\xff\xfe": 1}))
    assert isinstance(result, Message | DecodeError)


# --------------------------------------------------------------------------- encode_payload


def test_encode_decimal_as_a_string() -> None:
    assert encode_payload({"amount": decimal.Decimal("9.99")}) == b'{"amount":"9.99"}'
    assert json.loads(encode_payload(decimal.Decimal("0.1000"))) == "0.1000"  # no float rounding


def test_encode_datetime_date_time_and_timedelta() -> None:
    when = dt.datetime(2024, 5, 6, 7, 8, 9, 123456, tzinfo=dt.UTC)
    assert json.loads(encode_payload({"at": when})) == {"at": "2024-05-06T07:08:09.123456+00:00"}
    assert json.loads(encode_payload(dt.date(2024, 5, 6))) == "2024-05-06"
    assert json.loads(encode_payload(dt.time(7, 8))) == "07:08:00"
    assert json.loads(encode_payload(dt.timedelta(minutes=2))) == 120.0


def test_encode_uuid_sets_and_tuples() -> None:
    value = uuid.UUID("12345678-1234-5678-1234-567812345678")
    assert encode_payload(value) == b'"12345678-1234-5678-1234-567812345678"'
    assert json.loads(encode_payload({"ids": {3, 1, 2}})) == {"ids": [1, 2, 3]}
    assert json.loads(encode_payload((1, "a"))) == [1, "a"]


def test_encode_is_compact_utf8() -> None:
    assert encode_payload({"name": "Zoë", "n": 1}) == '{"name":"Zoë","n":1}'.encode()


@pytest.mark.parametrize("value", [object(), {"x": object()}, b"bytes", {"tz": dt.UTC}])
def test_encode_object_is_a_type_error(value: Any) -> None:
    with pytest.raises(TypeError, match="cannot be encoded as JSON"):
        encode_payload(value)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), {"x": [float("-inf")]}])
def test_encode_nan_and_infinity_are_type_errors(value: Any) -> None:
    with pytest.raises(TypeError, match="cannot be encoded as JSON"):
        encode_payload(value)


def test_encode_circular_is_a_type_error() -> None:
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(TypeError):
        encode_payload(loop)


# --------------------------------------------------------------------------- jsonable


def test_jsonable_makes_header_values_storable() -> None:
    value = {
        "bytes": b"\xffab",
        "nul": "a\x00b",
        "decimal": decimal.Decimal("1.50"),
        "when": dt.datetime(2024, 1, 2, tzinfo=dt.UTC),
        "nested": [{"k": b"v"}, (1, 2)],
        "plain": [True, None, 1, 1.5],
        "other": dt.time(1, 2),
    }
    assert jsonable(value) == {
        "bytes": "\\xffab",
        "nul": "a\\x00b",
        "decimal": "1.50",
        "when": "2024-01-02T00:00:00+00:00",
        "nested": [{"k": "v"}, [1, 2]],
        "plain": [True, None, 1, 1.5],
        "other": repr(dt.time(1, 2)),
    }
    json.dumps(jsonable(value), allow_nan=False)


def test_jsonable_stores_non_finite_floats_as_text() -> None:
    # Doubles from foreign producers can be NaN or infinite; PostgreSQL's jsonb has neither.
    value = jsonable({"nan": float("nan"), "inf": float("inf"), "ratio": 3.75})
    assert value == {"nan": "nan", "inf": "inf", "ratio": 3.75}
    json.dumps(value, allow_nan=False)


# --------------------------------------------------------------------------- frames from pika


def deliver_frame(routing_key: str | bytes = "order.placed", exchange: str | bytes = "shop") -> Any:
    """A Basic.Deliver as pika decodes it off the wire (short strings that are not UTF-8 come
    out as bytes)."""
    sent = pika.spec.Basic.Deliver(
        consumer_tag="ctag",
        delivery_tag=7,
        redelivered=False,
        exchange=exchange,  # type: ignore[arg-type]  # raw bytes on purpose
        routing_key=routing_key,  # type: ignore[arg-type]
    )
    return pika.spec.Basic.Deliver().decode(b"".join(sent.encode()))


def properties_frame(**kwargs: Any) -> Any:
    """BasicProperties as pika decodes them off the wire."""
    values: dict[str, Any] = {"message_id": "m-1", "content_type": "application/json"}
    values.update(kwargs)
    sent = pika.spec.BasicProperties(**values)
    return pika.spec.BasicProperties().decode(b"".join(sent.encode()))


def test_a_routing_key_that_is_not_utf8_is_escaped_text_and_refused() -> None:
    method = deliver_frame(routing_key=b"order.\xff")
    assert method.routing_key == b"order.\xff"  # what pika hands over
    d = delivery_from_frame("billing.charge", method, properties_frame(), b'{"order_id": 7}')
    assert isinstance(d.routing_key, str)
    assert d.routing_key == "order.\\xff"
    # Refused, not matched: even though its escaped form would match "order.*".
    err = assert_error(decode(d), FailureReason.INVALID_HEADERS)
    assert "routing key is not UTF-8" in err.detail
    assert err.message_id == "m-1"


def test_topic_matching_never_raises_on_a_key_that_is_not_text() -> None:
    assert topic_matches("order.*", "order.placed")
    assert not topic_matches("order.*", b"order.\xff")  # type: ignore[arg-type]
    assert not topic_matches("#", b"\xff")  # type: ignore[arg-type]


_WORDS = st.lists(st.sampled_from(["", "order", "placed", "a", "*", "#", "o.p"]), max_size=4)


@given(pattern=_WORDS, key=_WORDS)
def test_a_pattern_without_wildcards_matches_as_the_word_by_word_matcher_does(
    pattern: list[str], key: list[str]
) -> None:
    binding, routing_key = ".".join(pattern), ".".join(key).replace("*", "").replace("#", "")
    expected = routing._match(routing._split(binding), routing._split(routing_key))
    assert topic_matches(binding, routing_key) is expected


def test_delivery_from_frame_turns_every_field_into_text() -> None:
    method = deliver_frame(routing_key="order.placed", exchange=b"sh\xffop")
    properties = properties_frame(
        message_id="m-9", content_type="application/json", headers={"tenant": "acme"}
    )
    properties.headers[b"\xfename"] = 1  # a header name pika could not decode as UTF-8
    d = delivery_from_frame("billing.charge", method, properties, b"{}")
    assert (d.exchange, d.routing_key, d.message_id, d.content_type) == (
        "sh\\xffop",
        "order.placed",
        "m-9",
        "application/json",
    )
    assert all(isinstance(k, str) for k in d.headers)
    assert d.headers["\\xfename"] == 1
    assert d.delivery_tag == 7
    assert "exchange is not UTF-8" in assert_error(decode(d), FailureReason.INVALID_HEADERS).detail


def test_delivery_from_frame_never_raises_on_garbage() -> None:
    class Broken:
        def __getattr__(self, name: str) -> Any:
            raise RuntimeError(f"no {name}")

    d = delivery_from_frame("q", Broken(), Broken(), b"{}")
    err = assert_error(decode(d), FailureReason.INVALID_HEADERS)
    assert "could not be read" in err.detail


def test_a_timestamp_property_before_1970_is_signed() -> None:
    # Java writes 1960-01-01 as a negative 64-bit number; pika reads it unsigned.
    properties = properties_frame(timestamp=2**64 - 315_619_200)
    d = delivery_from_frame("q", deliver_frame(), properties, b"{}")
    assert d.timestamp == -315_619_200
    message = decode(d)
    assert isinstance(message, Message)
    assert message.published_at == dt.datetime(1960, 1, 1, tzinfo=dt.UTC)


# --------------------------------------------------------------------------- JSON limits


def test_json_nested_too_deeply_to_decode_is_invalid_json() -> None:
    body = b"[" * 50_000 + b"]" * 50_000
    err = assert_error(decode(delivery(body), max_body_bytes=len(body)), FailureReason.INVALID_JSON)
    assert "nested too deeply" in err.detail


def test_an_integer_beyond_pythons_digit_limit_is_invalid_json() -> None:
    body = b'{"n": ' + b"9" * 5000 + b"}"
    err = assert_error(decode(delivery(body), max_body_bytes=len(body)), FailureReason.INVALID_JSON)
    assert "4300" in err.detail


def deep_list(depth: int, leaf: Any = 1) -> Any:
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


def test_a_payload_nested_600_deep_decodes_and_converts() -> None:
    # json.loads accepts it; everything after it on the dead-letter path must too.
    body = json.dumps(deep_list(600, "\\u00e9")).encode()  # "\\u" makes the surrogate check run
    message = decode(delivery(body), max_body_bytes=len(body))
    assert isinstance(message, Message)
    assert jsonable(message.payload) == message.payload
    shallow = jsonable(message.payload, max_depth=3)
    assert shallow == [[["(nested deeper than 3 levels: see the raw body)"]]]


def test_jsonable_notes_a_structure_that_holds_itself() -> None:
    loop: list[Any] = [1]
    loop.append(loop)
    assert jsonable(loop) == [1, "(a reference to itself)"]


# --------------------------------------------------------------------------- message ids


def test_two_binary_message_ids_never_share_an_inbox_key() -> None:
    first = decode(delivery(message_id=b"\xff\x01"))
    second = decode(delivery(message_id=b"\xfe\x01"))
    for result in (first, second):
        err = assert_error(result, FailureReason.INVALID_HEADERS)
        assert "message_id is not UTF-8" in err.detail
    assert isinstance(first, DecodeError) and isinstance(second, DecodeError)
    # Their dead letters are keyed apart too.
    assert first.message_id != second.message_id


def test_a_binary_message_id_off_the_wire_is_refused() -> None:
    properties = properties_frame(message_id=b"\xff\x01")
    d = delivery_from_frame("q", deliver_frame(), properties, b"{}")
    assert isinstance(d.message_id, str)
    err = assert_error(decode(d), FailureReason.INVALID_HEADERS)
    assert "message_id is not UTF-8" in err.detail
    assert err.message_id == d.message_id


def test_a_long_binary_message_id_keeps_a_distinct_key_within_the_column() -> None:
    first = decode(delivery(message_id=b"\xff" * 254 + b"\x01"))
    second = decode(delivery(message_id=b"\xff" * 254 + b"\x02"))
    assert isinstance(first, DecodeError) and isinstance(second, DecodeError)
    assert first.message_id != second.message_id
    assert len(first.message_id.encode()) <= 255 and len(second.message_id.encode()) <= 255


def test_utf8_bytes_message_id_is_still_accepted() -> None:
    message = decode(delivery(message_id="é-1".encode()))
    assert isinstance(message, Message) and message.message_id == "é-1"


# --------------------------------------------------------------------------- wire_headers


def encodes(headers: dict[str, Any]) -> dict[Any, Any]:
    """What the broker would receive: ``headers`` through pika's encoder and decoder."""
    pieces: list[bytes] = []
    pika.data.encode_table(pieces, headers)
    decoded, _ = pika.data.decode_table(b"".join(pieces), 0)
    return decoded


def test_a_long_header_name_that_was_not_utf8_fits_a_short_string() -> None:
    raw = {b"\xff" * 200 + b"a": 1, b"\xff" * 200 + b"b": 2, "tenant": "acme"}
    headers = normalize_headers(raw)
    assert all(len(k.encode()) > 255 for k in headers if k != "tenant")
    wired = wire_headers(headers)
    assert len(wired) == 3  # the two long names stay apart
    assert all(len(k.encode()) <= 255 for k in wired)
    assert wired["tenant"] == "acme"
    assert sorted(v for k, v in encodes(wired).items() if k != "tenant") == [1, 2]
    assert wire_headers(headers) == wired  # stable


def test_wire_headers_keeps_what_pika_can_write_and_converts_the_rest() -> None:
    when = dt.datetime(2024, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
    headers = {
        "ratio": 3.75,
        "at": when,
        "born": dt.datetime(1960, 1, 1, tzinfo=dt.UTC),
        "price": decimal.Decimal("9.99"),
        "huge": 2**70,
        "precise": decimal.Decimal("1.000000000001"),
        "nan": decimal.Decimal("NaN"),
        "day": dt.date(2024, 1, 2),
        "pair": (1, "a"),
        "text": "lone \ud800",
        "nested": {"deeper": [{"x": 0.5}]},
    }
    received = encodes(wire_headers(headers))
    assert received["ratio"] == 3.75 and isinstance(received["ratio"], float)
    assert received["at"] == when
    assert received["born"] == dt.datetime(1960, 1, 1, tzinfo=dt.UTC)
    assert received["price"] == decimal.Decimal("9.99")
    assert received["huge"] == str(2**70)
    assert received["precise"] == "1.000000000001"
    assert received["nan"] == "NaN"
    assert received["day"] == "2024-01-02"
    assert received["pair"] == [1, "a"]
    assert received["text"] == "lone \\ud800"
    assert received["nested"] == {"deeper": [{"x": 0.5}]}


def test_wire_headers_cuts_tables_nested_deeper_than_pika_can_write() -> None:
    deep: dict[str, Any] = {"leaf": 1}
    for _ in range(2000):
        deep = {"k": deep}
    received = encodes(wire_headers({"deep": deep}))
    level, depth = received["deep"], 1
    while isinstance(level, dict):
        level, depth = level["k"], depth + 1
    assert depth == 65 and "nested deeper than 64 levels" in level


@pytest.mark.timeout(10)
def test_wire_headers_of_headers_pika_decoded_is_a_retry_of_a_retry() -> None:
    # pika decodes 64-bit integers as its own int subclass; a second retry copy carries them.
    received = encodes({"x-rm-first-failed-at": 1_700_000_000_123, "sizes": [2**40, -(2**62)]})
    assert type(received["x-rm-first-failed-at"]) is not int  # pika.compat.long
    assert encodes(wire_headers(received)) == received
