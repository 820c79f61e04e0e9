"""Settings: every key has the contract's default; override_settings takes effect at once;
passwords never reach logs."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import override_settings

from reliable_messaging.conf import (
    DEFAULTS,
    SETTINGS,
    MessagingSettings,
    Rule,
    boolean,
    duration,
    increasing_seconds,
    integer,
    messaging_settings,
    one_of,
    redact_url,
    seconds,
)


def test_defaults_when_the_setting_is_empty() -> None:
    with override_settings(RELIABLE_MESSAGING={}):
        s = MessagingSettings()
        assert s.broker_url == "amqp://guest:guest@localhost:5672/%2F"
        assert s.exchange == "reliable_messaging"
        assert s.prefetch == 100
        assert s.retry_delays == (1.0, 5.0, 30.0, 120.0, 600.0)
        assert s.max_attempts == 6
        assert s.dedup_retention == timedelta(days=14)
        assert s.outbox_retention == timedelta(days=7)
        assert s.cache_alias is None
        assert s.queue_type == "classic"
        assert s.max_body_bytes == 1024 * 1024
        assert s.derive_message_id is False
        assert s.shutdown_timeout == 30.0
        assert s.reconnect_max_delay == 30.0
        assert s.heartbeat == 60


@pytest.mark.parametrize("value", [None, "not a dict", ["BROKER_URL"]])
def test_defaults_when_the_setting_is_missing_or_not_a_mapping(value: object) -> None:
    with override_settings(RELIABLE_MESSAGING=value):
        assert messaging_settings.exchange == DEFAULTS["EXCHANGE"]
        assert messaging_settings.max_attempts == DEFAULTS["MAX_ATTEMPTS"]


def test_every_documented_key_has_a_default() -> None:
    documented = {
        "BROKER_URL",
        "EXCHANGE",
        "PREFETCH",
        "RETRY_DELAYS",
        "MAX_ATTEMPTS",
        "DEDUP_RETENTION",
        "OUTBOX_RETENTION",
        "CACHE_ALIAS",
        "QUEUE_TYPE",
    }
    assert documented <= set(DEFAULTS)


def test_the_suite_settings_are_read() -> None:
    assert messaging_settings.retry_delays == (0.2, 0.4, 0.8)
    assert messaging_settings.max_attempts == 3
    assert messaging_settings.max_body_bytes == 64 * 1024
    assert messaging_settings.shutdown_timeout == 15.0


def test_override_settings_takes_effect_without_reimport() -> None:
    before = messaging_settings.exchange
    with override_settings(
        RELIABLE_MESSAGING={
            "EXCHANGE": "events",
            "RETRY_DELAYS": [2, 4],
            "MAX_ATTEMPTS": "7",
            "CACHE_ALIAS": "default",
        }
    ):
        assert messaging_settings.exchange == "events"
        assert messaging_settings.retry_delays == (2.0, 4.0)
        assert messaging_settings.max_attempts == 7
        assert messaging_settings.cache_alias == "default"
        assert messaging_settings.prefetch == 100  # keys not given keep their default
    assert messaging_settings.exchange == before


def test_repr_redacts_the_password() -> None:
    with override_settings(RELIABLE_MESSAGING={"BROKER_URL": "amqp://app:s3cret@mq:5672/shop"}):
        text = repr(messaging_settings)
    assert "s3cret" not in text
    assert "amqp://app:***@mq:5672/shop" in text


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("amqp://guest:guest@localhost:5672/%2F", "amqp://guest:***@localhost:5672/%2F"),
        (
            "amqps://app:p%40ss@mq.example.com/vh?heartbeat=10",
            "amqps://app:***@mq.example.com/vh?heartbeat=10",
        ),
        ("amqp://:onlypassword@mq/", "amqp://:***@mq/"),
        ("amqp://user@mq:5672/", "amqp://user@mq:5672/"),
        ("amqp://mq/", "amqp://mq/"),
        ("not a url", "not a url"),
    ],
)
def test_redact_url(url: str, expected: str) -> None:
    assert redact_url(url) == expected


@pytest.mark.parametrize("url", ["amqp://app:s3cret@mq:notaport/", "amqp://app:s3cret@mq:99999/"])
def test_redact_url_of_a_bad_port_does_not_raise(url: str) -> None:
    redacted = redact_url(url)
    assert "s3cret" not in redacted


def test_redact_url_keeps_an_ipv6_host_valid() -> None:
    assert redact_url("amqp://app:s3cret@[::1]:5672/%2F") == "amqp://app:***@[::1]:5672/%2F"


# --------------------------------------------------------------------------- declarations


def test_a_setting_is_read_at_access_time_through_its_declaration() -> None:
    s = MessagingSettings()
    with override_settings(RELIABLE_MESSAGING={"HANDLER_TIMEOUT": 5}):
        assert s.handler_timeout == 5.0 and isinstance(s.handler_timeout, float)
    with override_settings(RELIABLE_MESSAGING={"HANDLER_TIMEOUT": 7}):
        assert s.handler_timeout == 7.0
    with override_settings(RELIABLE_MESSAGING={}):
        assert s.handler_timeout == DEFAULTS["HANDLER_TIMEOUT"]
        assert s.require_route == () and s.ops_views_token is None


@pytest.mark.parametrize(
    ("rule", "value", "problem"),
    [
        (integer(1, 1), 0, "must be an integer >= 1, got 0."),
        (integer(1, 1), True, "must be an integer >= 1, got True."),
        (integer(1, 1, 9), 10, "must be an integer from 1 to 9, got 10."),
        (integer(1, 1, what="a positive integer"), "2", "must be a positive integer, got '2'."),
        (seconds(1, hint=""), 0, "must be a positive number of seconds, got 0."),
        (seconds(1, hint="", zero_allowed=True), -1, "must be a number of seconds >= 0, got -1."),
        (duration(1, hint=""), 3, "must be a positive timedelta, got 3."),
        (one_of(1, ("a", "b", "c"), hint=""), "d", "must be 'a', 'b' or 'c', got 'd'."),
        (boolean(1, hint=""), "no", "must be True or False, got 'no'."),
        (increasing_seconds(1, hint=""), [2, 1], "must be in increasing order, got [2, 1]."),
    ],
)
def test_rules_say_what_is_wrong(rule: Rule, value: object, problem: str) -> None:
    assert rule.problem(value) == problem


@pytest.mark.parametrize(
    ("rule", "value"),
    [
        (integer(1, 0), 0),
        (seconds(1, hint="", zero_allowed=True), 0),
        (seconds(1, hint=""), 0.5),
        (duration(1, hint=""), timedelta(seconds=1)),
        (one_of(1, ("a", "b"), hint=""), "b"),
        (boolean(1, hint=""), False),
        (increasing_seconds(1, hint=""), (1, 1.5)),
    ],
)
def test_rules_accept_valid_values(rule: Rule, value: object) -> None:
    assert rule.problem(value) is None


@pytest.mark.parametrize("value", [[1], {"a": 1}, object(), b"x", float("nan")])
def test_rules_never_raise(value: object) -> None:
    for setting in SETTINGS:
        if isinstance(setting.rule, Rule):
            setting.rule.problem(value)  # a complaint or None, never an exception
