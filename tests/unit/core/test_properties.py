"""Property tests: decode_delivery never raises, whatever arrives; encode_payload round-trips."""

from __future__ import annotations

import datetime as dt
import decimal
import json
from typing import Any

import pika.data
import pika.spec
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from reliable_messaging.core.envelope import (
    ATTEMPT_HEADER,
    BROKER_HEADERS,
    HEADER_PREFIX,
    ORDERING_KEY_HEADER,
    ORIGINAL_EXCHANGE_HEADER,
    ORIGINAL_ROUTING_KEY_HEADER,
    PUBLISHED_AT_HEADER,
    SENDER_ROUTING_HEADERS,
    DecodeError,
    Delivery,
    Message,
    decode_delivery,
    delivery_from_frame,
    encode_payload,
    jsonable,
    normalize_headers,
    wire_headers,
)
from reliable_messaging.core.outcomes import FailureReason

PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

REASONS = {v for k, v in vars(FailureReason).items() if k.isupper()}

# Values a pika delivery's headers can hold (pika/data.py decode_value).
amqp_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(),
    st.text(),
    st.binary(max_size=20),
    st.decimals(allow_nan=False, allow_infinity=False, places=3),
    st.datetimes(),
)
amqp_values = st.recursive(
    amqp_scalars,
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3)
    ),
    max_leaves=8,
)
header_names = st.one_of(
    st.sampled_from(
        [
            ATTEMPT_HEADER,
            PUBLISHED_AT_HEADER,
            ORDERING_KEY_HEADER,
            ORIGINAL_EXCHANGE_HEADER,
            ORIGINAL_ROUTING_KEY_HEADER,
            "x-death",
            "x-rm-first-failed-at",
            "tenant",
        ]
    ),
    st.text(max_size=12),
)
attempt_values = st.one_of(
    st.integers(),
    st.text(max_size=6),
    st.binary(max_size=6),
    st.sampled_from(["1", "2", "0", "-1", " 3 ", "9" * 5000]),
)
headers_strategy = st.one_of(
    st.dictionaries(header_names, amqp_values, max_size=6),
    st.dictionaries(st.just(ATTEMPT_HEADER), attempt_values, max_size=1),
)
bodies = st.one_of(
    st.binary(max_size=300),
    st.text(max_size=100).map(lambda s: s.encode("utf-8", "surrogatepass")),
    st.from_regex(r'\A\{"[a-z]{1,5}": ?(\d{1,4}|"[a-z]*"|null|true)\}\Z').map(str.encode),
)
message_ids = st.one_of(
    st.none(), st.text(max_size=300), st.binary(max_size=40), st.uuids().map(str)
)
content_types = st.one_of(
    st.none(),
    st.text(max_size=30),
    st.sampled_from(
        [
            "application/json",
            "text/plain",
            "application/json; charset=utf-8",
            "application/x+json",
            "",
        ]
    ),
)


@PROPERTY
@given(
    body=bodies,
    message_id=message_ids,
    content_type=content_types,
    headers=headers_strategy,
    timestamp=st.one_of(st.none(), st.integers(min_value=-(2**63), max_value=2**64 - 1)),
    redelivered=st.booleans(),
    max_body_bytes=st.integers(min_value=0, max_value=400),
    derive=st.booleans(),
)
@example(
    body=b"",
    message_id=None,
    content_type=None,
    headers={},
    timestamp=None,
    redelivered=False,
    max_body_bytes=0,
    derive=True,
)
@example(
    body=b'{"a": 1}',
    message_id="m",
    content_type=None,
    headers={PUBLISHED_AT_HEADER: float("nan")},
    timestamp=2**63,
    redelivered=True,
    max_body_bytes=100,
    derive=False,
)
def test_decode_delivery_never_raises(
    body: bytes,
    message_id: Any,
    content_type: Any,
    headers: dict[str, Any],
    timestamp: Any,
    redelivered: bool,
    max_body_bytes: int,
    derive: bool,
) -> None:
    delivery = Delivery(
        body=body,
        queue="q",
        exchange="ex",
        routing_key="rk",
        message_id=message_id,
        content_type=content_type,
        timestamp=timestamp,
        redelivered=redelivered,
        headers=headers,
    )
    result = decode_delivery(delivery, max_body_bytes=max_body_bytes, derive_message_id=derive)
    assert isinstance(result, Message | DecodeError)
    if isinstance(result, DecodeError):
        assert result.reason in REASONS
        assert result.detail
        assert isinstance(result.message_id, str)
        return
    # A Message is only ever made from a body that is JSON, within the limit, with an id.
    assert len(body) <= max_body_bytes
    assert json.dumps(result.payload) == json.dumps(json.loads(body.decode("utf-8")))
    assert result.message_id and len(result.message_id) <= 255
    assert result.attempt >= 1
    assert result.redelivered is redelivered
    assert isinstance(result.routing_key, str) and isinstance(result.exchange, str)
    assert all(not k.startswith(HEADER_PREFIX) and k not in BROKER_HEADERS for k in result.headers)
    if result.published_at is not None:
        assert result.published_at.tzinfo is not None
    # What a dead letter would store of the headers is always valid JSON.
    json.dumps(jsonable(dict(headers)))


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)


@PROPERTY
@given(value=json_values)
def test_encode_payload_round_trips_through_decode(value: Any) -> None:
    body = encode_payload(value)
    assert isinstance(body, bytes)
    assert json.loads(body) == value
    message = decode_delivery(
        Delivery(
            body=body,
            queue="q",
            exchange="ex",
            routing_key="rk",
            message_id="m",
            content_type="application/json",
        ),
        max_body_bytes=len(body),
    )
    assert isinstance(message, Message)
    assert message.payload == value


@PROPERTY
@given(
    amount=st.decimals(allow_nan=False, allow_infinity=False),
    when=st.datetimes(timezones=st.just(dt.UTC)),
    day=st.dates(),
    ident=st.uuids(),
)
def test_encode_payload_business_types_round_trip_as_strings(
    amount: decimal.Decimal, when: dt.datetime, day: dt.date, ident: Any
) -> None:
    decoded = json.loads(encode_payload({"amount": amount, "at": when, "day": day, "id": ident}))
    assert decimal.Decimal(decoded["amount"]) == amount
    assert str(decimal.Decimal(decoded["amount"])) == str(amount)  # not rounded through float
    assert dt.datetime.fromisoformat(decoded["at"]) == when
    assert dt.date.fromisoformat(decoded["day"]) == day
    assert decoded["id"] == str(ident)


@PROPERTY
@given(value=json_values, bad=st.sampled_from([float("nan"), float("inf"), float("-inf")]))
def test_encode_payload_refuses_non_finite_floats_anywhere(value: Any, bad: float) -> None:
    with pytest.raises(TypeError):
        encode_payload({"data": value, "nested": [{"x": bad}]})


def test_encode_payload_of_a_decoded_lone_surrogate() -> None:
    message = decode_delivery(
        Delivery(
            body=b'{"name": "\\ud800"}', queue="q", exchange="ex", routing_key="rk", message_id="m"
        ),
        max_body_bytes=1000,
    )
    # A lone surrogate is no character: no UTF-8 text or database column can hold it, so the
    # delivery is refused at decoding (a dead letter), and encoding one is a TypeError.
    assert isinstance(message, DecodeError)
    assert message.reason == "invalid_json"
    with pytest.raises(TypeError):
        encode_payload({"name": "\ud800"})


# --------------------------------------------------------------------------- retry copies

# Everything a delivery's headers can hold once decoded (pika with broker/codec.py), plus what our
# own retry headers add (exception texts with lone surrogates) and what a caller may pass.
any_text = st.text(alphabet=st.characters(blacklist_categories=()), max_size=300)
nasty_names = st.one_of(any_text, st.binary(min_size=1, max_size=255))
nasty_scalars = st.one_of(
    amqp_scalars,
    any_text,
    st.integers(),  # beyond 64 bits too
    st.decimals(),  # NaN, infinities, any precision
    st.datetimes(min_value=dt.datetime(1, 1, 2), timezones=st.sampled_from([None, dt.UTC])),
    st.dates(),
    st.times(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sets(st.integers(), max_size=3),
)
nasty_values = st.recursive(
    nasty_scalars,
    lambda children: (
        st.lists(children, max_size=3)
        | st.tuples(children, children)
        | st.dictionaries(nasty_names, children, max_size=3)
    ),
    max_leaves=10,
)


def pika_round_trip(headers: dict[str, Any]) -> dict[Any, Any]:
    """``headers`` as the broker receives them in a publish, and as a consumer decodes them."""
    properties = pika.spec.BasicProperties(headers=headers)
    encoded = b"".join(properties.encode())
    decoded: dict[Any, Any] = dict(pika.spec.BasicProperties().decode(encoded).headers or {})
    return decoded


@PROPERTY
@given(headers=st.dictionaries(nasty_names, nasty_values, max_size=5))
@example(headers={b"\xff" * 255: 1, "x" * 300: 2.5, "ok": dt.datetime(1960, 1, 1)})
@example(headers={"deep": {"a": [{"b": {"c": [[[[1]]]]}}]}, "e": "\ud800"})
@example(headers={"big": decimal.Decimal("1E+999999999"), "s": decimal.Decimal("sNaN"), "i": 2**64})
def test_pika_can_encode_whatever_wire_headers_returns(headers: dict[Any, Any]) -> None:
    from reliable_messaging.broker import codec as amqp_codec

    amqp_codec.install()
    wired = wire_headers(normalize_headers(headers))
    received = pika_round_trip(wired)  # raises if pika (or the broker's 255 bytes) refuses
    assert all(len(name.encode()) <= 255 for name in wired)
    assert set(received) == set(wired)
    for name, value in wired.items():
        if isinstance(value, float) and value == value:  # not NaN
            assert received[name] == value  # doubles arrive exactly
    assert wire_headers(normalize_headers(headers)) == wired  # the same copy every time
    # A retry of the retry copy: what pika decoded (its own int subclass included) goes again.
    assert pika_round_trip(wire_headers(normalize_headers(received))).keys() == received.keys()


@PROPERTY
@given(names=st.lists(st.text(min_size=1, max_size=400), min_size=2, max_size=5, unique=True))
def test_distinct_header_names_stay_distinct_on_the_wire(names: list[str]) -> None:
    # CC and BCC are dropped on purpose: the broker would route a copy by them.
    kept = [name for name in names if name not in SENDER_ROUTING_HEADERS]
    assert len(wire_headers(dict.fromkeys(names, 1))) == len(kept)


# --------------------------------------------------------------------------- frames


short_strings = st.one_of(st.text(max_size=40), st.binary(max_size=60))


@PROPERTY
@given(
    exchange=short_strings,
    routing_key=short_strings,
    message_id=st.none() | short_strings,
    content_type=st.none() | short_strings,
    names=st.lists(st.binary(min_size=1, max_size=40), max_size=3),
    timestamp=st.none() | st.integers(min_value=0, max_value=2**64 - 1),
)
def test_delivery_from_frame_never_raises_and_gives_text(
    exchange: Any,
    routing_key: Any,
    message_id: Any,
    content_type: Any,
    names: list[bytes],
    timestamp: int | None,
) -> None:
    method = pika.spec.Basic.Deliver(
        consumer_tag="c", delivery_tag=1, exchange=exchange, routing_key=routing_key
    )
    properties = pika.spec.BasicProperties(
        message_id=message_id,
        content_type=content_type,
        timestamp=timestamp,
        headers=dict.fromkeys(names, 1),  # type: ignore[arg-type]  # bytes names on purpose
    )
    delivery = delivery_from_frame("q", method, properties, b"{}")
    assert isinstance(delivery.exchange, str) and isinstance(delivery.routing_key, str)
    assert delivery.message_id is None or isinstance(delivery.message_id, str)
    assert delivery.content_type is None or isinstance(delivery.content_type, str)
    assert all(isinstance(name, str) for name in delivery.headers)
    result = decode_delivery(delivery, max_body_bytes=100)
    assert isinstance(result, Message | DecodeError)
    not_utf8 = []
    for value in (exchange, routing_key, message_id):
        if isinstance(value, bytes):
            try:
                value.decode("utf-8")
            except UnicodeDecodeError:
                not_utf8.append(value)
    if not_utf8:  # refused, never matched or handled under an escaped name
        assert isinstance(result, DecodeError)
        assert result.reason == FailureReason.INVALID_HEADERS
