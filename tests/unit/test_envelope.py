"""The wire format: decode_delivery for every bad input and the fields of a valid message;
encode_payload for the types business payloads carry. Pure logic: no broker, no database."""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import json
import uuid
from typing import Any

import pytest

from reliable_messaging.envelope import (
    ATTEMPT_HEADER,
    ORDERING_KEY_HEADER,
    ORIGINAL_EXCHANGE_HEADER,
    ORIGINAL_ROUTING_KEY_HEADER,
    PUBLISHED_AT_HEADER,
    DecodeError,
    DecodeReason,
    Delivery,
    Message,
    decode_delivery,
    derived_message_id,
    encode_payload,
    jsonable,
    user_headers,
)

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
    err = assert_error(decode(delivery(b'{"order_id": ')), DecodeReason.INVALID_JSON)
    assert err.message_id == "m-1"
    assert "not valid JSON" in err.detail


def test_invalid_utf8() -> None:
    err = assert_error(decode(delivery(b'{"name": "\xff\xfe"}')), DecodeReason.INVALID_UTF8)
    assert "UTF-8" in err.detail


def test_empty_body() -> None:
    assert_error(decode(delivery(b"")), DecodeReason.EMPTY_BODY)


@pytest.mark.parametrize("message_id", [None, "", b""])
def test_missing_message_id(message_id: Any) -> None:
    err = assert_error(decode(delivery(message_id=message_id)), DecodeReason.MISSING_MESSAGE_ID)
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
    err = assert_error(decode(delivery(b"[" + b"1," * 600 + b"1]")), DecodeReason.BODY_TOO_LARGE)
    assert "MAX_BODY_BYTES" in err.detail and str(LIMIT) in err.detail
    assert err.message_id == "m-1"


def test_body_exactly_at_the_limit_is_accepted() -> None:
    body = json.dumps("x" * (LIMIT - 2)).encode()
    assert len(body) == LIMIT
    assert isinstance(decode(delivery(body)), Message)


def test_body_too_large_is_reported_before_anything_is_decoded() -> None:
    # Neither the message id nor the bytes are looked at: the size alone decides.
    huge = b"\xff" * (LIMIT + 1)
    assert_error(decode(delivery(huge, message_id=None)), DecodeReason.BODY_TOO_LARGE)


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "application/xml", "application/octet-stream", "application/x-pickle"],
)
def test_unsupported_content_type(content_type: str) -> None:
    err = assert_error(
        decode(delivery(content_type=content_type)), DecodeReason.UNSUPPORTED_CONTENT_TYPE
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
        decode(delivery(headers={ATTEMPT_HEADER: attempt})), DecodeReason.INVALID_HEADERS
    )
    assert ATTEMPT_HEADER in err.detail


def test_message_id_longer_than_the_column_is_invalid() -> None:
    assert isinstance(decode(delivery(message_id="m" * 255)), Message)
    err = assert_error(decode(delivery(message_id="m" * 256)), DecodeReason.INVALID_HEADERS)
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
