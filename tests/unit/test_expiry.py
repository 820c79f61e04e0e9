"""Message expiry decided in one pure function: the deadline header, a consumer's max_age,
replays exempt, and a deadline a foreign producer wrote in a form we cannot read."""

from __future__ import annotations

import datetime as dt
import decimal
import logging
from typing import Any

import pytest

from reliable_messaging.consuming.expiry import MalformedDeadline, expiry_of, parse_deadline
from reliable_messaging.consuming.retries import retry_headers
from reliable_messaging.core.envelope import (
    EXPIRES_AT_HEADER,
    PUBLISHED_AT_HEADER,
    REPLAY_HEADER,
    Delivery,
    Message,
    decode_delivery,
)
from reliable_messaging.core.registry import ConsumerSpec

NOW = 1_800_000_000.0  # Unix seconds
NOW_MS = int(NOW * 1000)


def spec(**kwargs: Any) -> ConsumerSpec:
    return ConsumerSpec(name="shop.late", queue="shop.late", handler=lambda m: None, **kwargs)


def delivery(headers: dict[str, Any] | None = None, timestamp: int | None = None) -> Delivery:
    return Delivery(
        body=b'{"order": 1}',
        queue="shop.late",
        exchange="shop",
        routing_key="order.placed",
        message_id="m-1",
        content_type="application/json",
        timestamp=timestamp,
        headers=headers or {},
    )


def message_of(d: Delivery) -> Message:
    decoded = decode_delivery(d, max_body_bytes=1 << 20)
    assert isinstance(decoded, Message), decoded
    return decoded


def expiry(
    headers: dict[str, Any] | None = None,
    timestamp: int | None = None,
    now: float = NOW,
    **spec_kwargs: Any,
) -> str | None:
    d = delivery(headers, timestamp)
    return expiry_of(d, message_of(d), spec(**spec_kwargs), now=now)


# -- the header's value ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (None, None),
        (NOW_MS, NOW_MS),
        (str(NOW_MS), NOW_MS),
        (f" {NOW_MS}\n", NOW_MS),
        (str(NOW_MS).encode(), NOW_MS),
        (float(NOW_MS) + 0.75, NOW_MS),
        (decimal.Decimal(NOW_MS), NOW_MS),
        (0, 0),
        (-5, -5),
        (2**63 - 1, 2**63 - 1),
    ],
)
def test_integer_like_deadlines_are_read(raw: Any, expected: int | None) -> None:
    assert parse_deadline(raw) == expected


@pytest.mark.parametrize(
    "raw",
    [
        True,
        False,
        "soon",
        "",
        "12.5",
        "1e12",
        b"\xff\xfe",
        "9" * 40,
        2**63,
        -(2**63) - 1,
        10**40,
        float("nan"),
        float("inf"),
        1e300,
        decimal.Decimal("1E+999999999"),
        decimal.Decimal("NaN"),
        [NOW_MS],
        {"at": NOW_MS},
        dt.datetime(2030, 1, 1, tzinfo=dt.UTC),
    ],
)
def test_anything_else_is_malformed(raw: Any) -> None:
    with pytest.raises(MalformedDeadline, match=EXPIRES_AT_HEADER):
        parse_deadline(raw)


# -- the decision ---------------------------------------------------------------------------------


def test_a_message_without_a_deadline_or_max_age_never_expires() -> None:
    assert expiry(timestamp=int(NOW) - 10 * 365 * 86400) is None


def test_the_deadline_header_expires_a_message_once_passed() -> None:
    assert expiry({EXPIRES_AT_HEADER: NOW_MS + 1}) is None
    assert expiry({EXPIRES_AT_HEADER: NOW_MS}) is None  # at the deadline, not past it
    late = expiry({EXPIRES_AT_HEADER: NOW_MS - 2500})
    assert late is not None
    assert "passed 2.500s" in late and EXPIRES_AT_HEADER in late


def test_a_foreign_producers_string_deadline_counts_too() -> None:
    assert expiry({EXPIRES_AT_HEADER: str(NOW_MS - 1000)}) is not None
    assert expiry({EXPIRES_AT_HEADER: str(NOW_MS + 1000).encode()}) is None


def test_max_age_counts_from_the_published_at_header() -> None:
    published = {PUBLISHED_AT_HEADER: NOW_MS - 61_000}
    assert expiry(published, max_age=120.0) is None
    late = expiry(published, max_age=60.0)
    assert late is not None
    assert "61.000s old" in late and "1.000s past" in late and "max_age of 60s" in late


def test_max_age_falls_back_to_the_amqp_timestamp() -> None:
    assert expiry(timestamp=int(NOW) - 30, max_age=60.0) is None
    assert expiry(timestamp=int(NOW) - 90, max_age=60.0) is not None


def test_max_age_without_a_publish_time_cannot_expire_the_message() -> None:
    assert expiry(max_age=0.001) is None


def test_either_deadline_is_enough() -> None:
    fresh_but_due = {EXPIRES_AT_HEADER: NOW_MS - 1, PUBLISHED_AT_HEADER: NOW_MS - 1}
    assert expiry(fresh_but_due, max_age=3600.0) is not None
    old_but_not_due = {EXPIRES_AT_HEADER: NOW_MS + 60_000, PUBLISHED_AT_HEADER: NOW_MS - 61_000}
    assert expiry(old_but_not_due, max_age=60.0) is not None


def test_a_replay_is_exempt_from_both_deadlines() -> None:
    headers = {REPLAY_HEADER: 1, EXPIRES_AT_HEADER: NOW_MS - 86_400_000}
    assert expiry({**headers, PUBLISHED_AT_HEADER: NOW_MS - 86_400_000}, max_age=1.0) is None


@pytest.mark.parametrize("raw", ["tomorrow", True, 10**40, b"\x00"])
def test_a_malformed_deadline_is_ignored_with_a_warning(
    raw: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="reliable_messaging.consuming.expiry"):
        assert expiry({EXPIRES_AT_HEADER: raw}) is None
    [record] = caplog.records
    assert EXPIRES_AT_HEADER in record.getMessage()
    assert "message_id=m-1" in record.getMessage()
    # The consumer's own max_age still applies to such a message.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="reliable_messaging.consuming.expiry"):
        assert (
            expiry({EXPIRES_AT_HEADER: raw, PUBLISHED_AT_HEADER: NOW_MS - 5000}, max_age=1.0)
            is not None
        )


def test_the_default_clock_is_this_hosts() -> None:
    d = delivery({EXPIRES_AT_HEADER: 1000})  # one second after 1970
    assert expiry_of(d, message_of(d), spec()) is not None


# -- retries never extend a deadline --------------------------------------------------------------


def test_a_retry_copy_keeps_the_deadline_and_the_publish_time() -> None:
    d = delivery(
        {EXPIRES_AT_HEADER: NOW_MS + 500, PUBLISHED_AT_HEADER: NOW_MS - 100}, timestamp=int(NOW)
    )
    headers = retry_headers(d, message_of(d), RuntimeError("boom"), next_attempt=2)
    assert headers[EXPIRES_AT_HEADER] == NOW_MS + 500
    assert headers[PUBLISHED_AT_HEADER] == NOW_MS - 100
    retried = delivery(headers, timestamp=int(NOW))
    # The next attempt, a second later, is past both deadlines the first one had.
    assert expiry_of(retried, message_of(retried), spec(), now=NOW + 1) is not None
    assert expiry_of(retried, message_of(retried), spec(max_age=1.0), now=NOW + 0.95) is not None
