"""System checks: each misconfiguration is reported with its id and a hint, through Django's own
``run_checks()`` (so the checks are registered) and through the check functions directly."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.conf import settings
from django.core.checks import Error, Warning, run_checks
from django.test import override_settings

from reliable_messaging import Message
from reliable_messaging.checks import check_consumers, check_settings
from reliable_messaging.core.registry import ConsumerSpec, registry


def handler(message: Message) -> None:
    pass


def ids(messages: list[Any]) -> list[str]:
    return sorted(m.id for m in messages if (m.id or "").startswith("reliable_messaging."))


@pytest.fixture
def rm() -> Iterator[Any]:
    """``rm(**overrides)`` -> the check messages for the suite's settings plus overrides."""

    def run(**overrides: Any) -> list[Any]:
        with override_settings(RELIABLE_MESSAGING={**settings.RELIABLE_MESSAGING, **overrides}):
            return check_settings()

    yield run


def only(messages: list[Any], id_: str) -> Any:
    assert ids(messages) == [id_], [str(m) for m in messages]
    (message,) = messages
    assert message.hint  # every check says how to fix it
    return message


def test_the_suite_settings_pass() -> None:
    assert ids(run_checks()) == []
    assert check_settings() == []


def test_no_setting_at_all_passes() -> None:
    with override_settings(RELIABLE_MESSAGING=None):
        assert check_settings() == []


def test_setting_not_a_dict() -> None:
    with override_settings(RELIABLE_MESSAGING=["BROKER_URL"]):
        assert ids(check_settings()) == ["reliable_messaging.E000"]


@pytest.mark.parametrize("url", ["http://localhost:5672/", "localhost", 5672, None])
def test_broker_url_not_amqp(rm: Any, url: Any) -> None:
    message = only(rm(BROKER_URL=url), "reliable_messaging.E001")
    assert isinstance(message, Error)
    assert "BROKER_URL" in message.msg


@pytest.mark.parametrize(
    "url",
    [
        "amqp://guest:s3cret@localhost:5672/%2F?heartbeat=abc",
        "amqp://guest:s3cret@localhost:5672/%2F?frobnicate=1",
        "amqp://[::1",
    ],
)
def test_broker_url_unparsable_is_reported_through_run_checks(url: str) -> None:
    values = {**settings.RELIABLE_MESSAGING, "BROKER_URL": url}
    with override_settings(RELIABLE_MESSAGING=values):
        messages = run_checks()
    assert ids(messages) == ["reliable_messaging.E001"]
    (message,) = [m for m in messages if m.id == "reliable_messaging.E001"]
    assert "cannot be parsed" in message.msg
    assert "s3cret" not in message.msg


@pytest.mark.parametrize(
    "url", ["amqp://app:s3cret@localhost:notaport/%2F", "amqp://app:s3cret@localhost:99999/%2F"]
)
def test_broker_url_with_a_bad_port(rm: Any, url: str) -> None:
    message = only(rm(BROKER_URL=url), "reliable_messaging.E001")
    assert "s3cret" not in message.msg


def test_broker_url_password_is_not_shown(rm: Any) -> None:
    message = only(rm(BROKER_URL="http://app:s3cret@mq/"), "reliable_messaging.E001")
    assert "s3cret" not in message.msg and "***" in message.msg


@pytest.mark.parametrize(
    "delays", [[0, 1], [-1, 5], [5, 1], [1, 3, 2], [], "1,5", ["1"], [True], None]
)
def test_retry_delays_must_be_increasing_positive_numbers(rm: Any, delays: Any) -> None:
    message = only(rm(RETRY_DELAYS=delays), "reliable_messaging.E004")
    assert "RETRY_DELAYS" in message.msg


@pytest.mark.parametrize("attempts", [0, -3, "3", 2.5, True, None])
def test_max_attempts_below_one(rm: Any, attempts: Any) -> None:
    message = only(rm(MAX_ATTEMPTS=attempts), "reliable_messaging.E005")
    assert "MAX_ATTEMPTS" in message.msg


def test_cache_alias_naming_no_cache(rm: Any) -> None:
    message = only(rm(CACHE_ALIAS="redis"), "reliable_messaging.E007")
    assert "'redis'" in message.msg and "CACHES" in message.msg
    assert rm(CACHE_ALIAS="messaging") == []  # the suite's django-redis cache
    assert rm(CACHE_ALIAS=None) == []


def test_cache_alias_must_be_a_django_redis_cache(rm: Any) -> None:
    # The suite's "default" cache is locmem: the fast path could not talk to Redis through it.
    message = only(rm(CACHE_ALIAS="default"), "reliable_messaging.E013")
    assert "LocMemCache" in message.msg and "django_redis.cache.RedisCache" in message.hint


def test_unknown_key_is_a_warning_with_a_suggestion(rm: Any) -> None:
    message = only(rm(RETRY_DELAY=[1, 2]), "reliable_messaging.W001")
    assert isinstance(message, Warning)
    assert "'RETRY_DELAY'" in message.msg
    assert "RETRY_DELAYS" in (message.hint or "")


def test_unknown_key_without_a_close_match_lists_the_known_keys(rm: Any) -> None:
    message = only(rm(ZZZ=1), "reliable_messaging.W001")
    assert "BROKER_URL" in (message.hint or "")


def test_dedup_retention_shorter_than_the_retry_horizon(rm: Any) -> None:
    # 0.2 + 0.4 seconds of delays between 3 attempts: the inbox must remember at least that.
    message = only(rm(DEDUP_RETENTION=timedelta(milliseconds=500)), "reliable_messaging.W002")
    assert "DEDUP_RETENTION" in message.msg
    assert rm(DEDUP_RETENTION=timedelta(milliseconds=600)) == []


def test_retry_horizon_counts_the_consumers_own_policy(rm: Any) -> None:
    spec = ConsumerSpec(
        name="slow.retry",
        queue="slow.retry.q",
        handler=handler,
        bindings=("x",),
        max_attempts=4,
        retry_delays=(60.0, 3600.0),
    )
    with registry.isolated():
        registry.register(spec)
        # 60 + 3600 + 3600 seconds: one day is enough, one hour is not.
        assert rm(DEDUP_RETENTION=timedelta(days=1)) == []
        only(rm(DEDUP_RETENTION=timedelta(hours=1)), "reliable_messaging.W002")


@pytest.mark.parametrize(
    ("key", "value", "id_"),
    [
        ("EXCHANGE", "", "reliable_messaging.E002"),
        ("EXCHANGE", 5, "reliable_messaging.E002"),
        ("PREFETCH", 0, "reliable_messaging.E003"),
        ("PREFETCH", 70000, "reliable_messaging.E003"),
        ("DEDUP_RETENTION", 14, "reliable_messaging.E006"),
        ("OUTBOX_RETENTION", timedelta(0), "reliable_messaging.E006"),
        ("QUEUE_TYPE", "stream", "reliable_messaging.E008"),
        ("MAX_BODY_BYTES", 0, "reliable_messaging.E009"),
        ("SHUTDOWN_TIMEOUT", 0, "reliable_messaging.E010"),
        ("RECONNECT_MAX_DELAY", "5", "reliable_messaging.E010"),
        ("HEARTBEAT", -1, "reliable_messaging.E011"),
        ("OPS_VIEWS_TOKEN", "short", "reliable_messaging.E046"),
        ("OPS_VIEWS_TOKEN", 12345678901234567890, "reliable_messaging.E046"),
        ("OPS_VIEWS_PUBLIC", "yes", "reliable_messaging.E047"),
    ],
)
def test_other_bad_values(rm: Any, key: str, value: Any, id_: str) -> None:
    message = only(rm(**{key: value}), id_)
    assert key in message.msg


def test_several_problems_are_all_reported(rm: Any) -> None:
    messages = rm(MAX_ATTEMPTS=0, RETRY_DELAYS=[3, 1], CACHE_ALIAS="nope", TYPO=1)
    assert ids(messages) == [
        "reliable_messaging.E004",
        "reliable_messaging.E005",
        "reliable_messaging.E007",
        "reliable_messaging.W001",
    ]


def test_consumer_without_bindings_is_a_warning() -> None:
    spec = ConsumerSpec(name="lonely", queue="lonely.q", handler=handler)
    with registry.isolated():
        registry.register(spec)
        messages = check_consumers()
        assert ids(messages) == ["reliable_messaging.W003"]
        assert "'lonely'" in messages[0].msg
        assert "reliable_messaging.W003" in ids(run_checks())
    assert check_consumers() == []


# --------------------------------------------------------------------------- time limits


def consumer_timeout_settings(**overrides: Any) -> dict[str, Any]:
    """Settings where only the consumer-timeout checks can speak: short handlers, no grace."""
    return {"HANDLER_TIMEOUT": 10.0, "HANDLER_TIMEOUT_GRACE": 0.0, **overrides}


@pytest.mark.parametrize(
    ("handler_timeout", "grace", "broker_timeout"),
    [(30.0, 10.0, 40.0), (30.0, 10.0, 35.0), (600.0, 10.0, 600.0), (1800.0, 0.0, 1800.0)],
)
def test_handler_timeout_reaching_the_broker_consumer_timeout(
    rm: Any, handler_timeout: float, grace: float, broker_timeout: float
) -> None:
    message = only(
        rm(
            HANDLER_TIMEOUT=handler_timeout,
            HANDLER_TIMEOUT_GRACE=grace,
            BROKER_CONSUMER_TIMEOUT=broker_timeout,
        ),
        "reliable_messaging.W014",
    )
    assert isinstance(message, Warning)
    assert "HANDLER_TIMEOUT" in message.msg and "BROKER_CONSUMER_TIMEOUT" in message.msg
    assert "consumer_timeout" in (message.hint or "")


def test_handler_timeout_below_the_broker_consumer_timeout_is_silent(rm: Any) -> None:
    assert rm(HANDLER_TIMEOUT=29.5, HANDLER_TIMEOUT_GRACE=10.0, BROKER_CONSUMER_TIMEOUT=40.0) == []
    # The grace counts: without it the same handler timeout fits.
    assert rm(HANDLER_TIMEOUT=35.0, HANDLER_TIMEOUT_GRACE=0.0, BROKER_CONSUMER_TIMEOUT=40.0) == []
    only(
        rm(HANDLER_TIMEOUT=35.0, HANDLER_TIMEOUT_GRACE=5.0, BROKER_CONSUMER_TIMEOUT=40.0),
        "reliable_messaging.W014",
    )


def test_a_consumers_own_timeout_reaching_the_broker_consumer_timeout(rm: Any) -> None:
    spec = ConsumerSpec(
        name="slow.handler", queue="slow.handler.q", handler=handler, bindings=("x",), timeout=95
    )
    with registry.isolated():
        registry.register(spec)
        # HANDLER_TIMEOUT is 10s: only the consumer's own 95s (+ grace) can reach 100s.
        assert rm(**consumer_timeout_settings(BROKER_CONSUMER_TIMEOUT=100.0)) == []
        late = consumer_timeout_settings(BROKER_CONSUMER_TIMEOUT=100.0, HANDLER_TIMEOUT_GRACE=5.0)
        message = only(rm(**late), "reliable_messaging.W014")
        assert "'slow.handler'" in message.msg and "95s" in message.msg
        assert ids(run_checks()) == []  # the suite settings: 95s + 10s < 1800s
    assert rm(**late) == []  # without the consumer


def ordered_spec(name: str = "ordered.slow", **kwargs: Any) -> ConsumerSpec:
    return ConsumerSpec(
        name=name, queue=f"{name}.q", handler=handler, bindings=("x",), ordered=True, **kwargs
    )


def test_ordered_retry_horizon_reaching_half_the_broker_consumer_timeout(rm: Any) -> None:
    # Waits after attempts 1, 2 and 3: 10 + 20 + 20 (the last delay repeats) = 50s.
    spec = ordered_spec(retry_delays=(10.0, 20.0), max_attempts=4)
    with registry.isolated():
        registry.register(spec)
        message = only(
            rm(**consumer_timeout_settings(BROKER_CONSUMER_TIMEOUT=100.0)),
            "reliable_messaging.W015",
        )
        assert isinstance(message, Warning)
        assert "'ordered.slow'" in message.msg and "50s" in message.msg
        assert rm(**consumer_timeout_settings(BROKER_CONSUMER_TIMEOUT=100.5)) == []
        # One attempt fewer: 10 + 20 = 30s fits in 50s.
        registry.unregister(spec.name)
        registry.register(ordered_spec(retry_delays=(10.0, 20.0), max_attempts=3))
        assert rm(**consumer_timeout_settings(BROKER_CONSUMER_TIMEOUT=100.0)) == []


def test_ordered_retry_horizon_uses_the_settings_policy_by_default(rm: Any) -> None:
    with registry.isolated():
        registry.register(ordered_spec())
        # RETRY_DELAYS [10, 20] and MAX_ATTEMPTS 4 in the settings: the same 50s.
        values = consumer_timeout_settings(RETRY_DELAYS=[10, 20], MAX_ATTEMPTS=4)
        only(rm(**values, BROKER_CONSUMER_TIMEOUT=100.0), "reliable_messaging.W015")
        assert rm(**values, BROKER_CONSUMER_TIMEOUT=101.0) == []


def test_a_plain_consumer_retrying_through_the_broker_has_no_horizon_warning(rm: Any) -> None:
    spec = ConsumerSpec(
        name="plain.slow",
        queue="plain.slow.q",
        handler=handler,
        bindings=("x",),
        retry_delays=(10.0, 20.0),
        max_attempts=4,
    )
    with registry.isolated():
        registry.register(spec)
        assert rm(**consumer_timeout_settings(BROKER_CONSUMER_TIMEOUT=100.0)) == []


def test_time_limit_checks_are_silent_with_the_defaults() -> None:
    # The defaults: HANDLER_TIMEOUT 600 + grace 10 < 1800, and an ordered consumer of the default
    # policy retries for 1 + 5 + 30 + 120 + 600 = 756s < 900s.
    only_broker = {"BROKER_URL": settings.RELIABLE_MESSAGING["BROKER_URL"]}
    with registry.isolated(), override_settings(RELIABLE_MESSAGING=only_broker):
        registry.register(ordered_spec())
        registry.register(
            ConsumerSpec(
                name="timed", queue="timed.q", handler=handler, bindings=("x",), timeout=60
            )
        )
        assert check_settings() == []
        assert ids(run_checks()) == []


@pytest.mark.parametrize(
    ("key", "value", "id_"),
    [
        ("HANDLER_TIMEOUT", 0, "reliable_messaging.E010"),
        ("HANDLER_TIMEOUT", -5.0, "reliable_messaging.E010"),
        ("HANDLER_TIMEOUT", "600", "reliable_messaging.E010"),
        ("BROKER_CONSUMER_TIMEOUT", 0, "reliable_messaging.E010"),
        ("HANDLER_TIMEOUT_GRACE", -1, "reliable_messaging.E010"),
        ("HANDLER_TIMEOUT_GRACE", None, "reliable_messaging.E010"),
        ("CRASH_LIMIT", 0, "reliable_messaging.E012"),
        ("CRASH_LIMIT", 2.0, "reliable_messaging.E012"),
    ],
)
def test_bad_time_limit_and_crash_values(rm: Any, key: str, value: Any, id_: str) -> None:
    message = only(rm(**{key: value}), id_)
    assert isinstance(message, Error)
    assert key in message.msg


def test_zero_grace_is_allowed(rm: Any) -> None:
    assert rm(HANDLER_TIMEOUT_GRACE=0) == []


def test_crash_limit_reaching_the_quorum_delivery_limit_warns() -> None:
    base = {**settings.RELIABLE_MESSAGING, "QUEUE_TYPE": "quorum", "QUORUM_DELIVERY_LIMIT": 3}
    with override_settings(RELIABLE_MESSAGING={**base, "CRASH_LIMIT": 3}):
        assert "reliable_messaging.W016" in {m.id for m in check_settings()}
    with override_settings(RELIABLE_MESSAGING={**base, "CRASH_LIMIT": 2}):
        assert "reliable_messaging.W016" not in {m.id for m in check_settings()}


# --------------------------------------------------------------------------- exact wording
# The per-setting checks derive from the declarations in conf.py; these pin one message and hint
# of each kind of rule word for word, as users (and their log searches) know them.


@pytest.mark.parametrize(
    ("key", "value", "id_", "msg", "hint"),
    [
        (
            "EXCHANGE",
            "",
            "E002",
            "RELIABLE_MESSAGING['EXCHANGE'] must be a non-empty string.",
            "Name the topic exchange publish() uses, e.g. 'events'.",
        ),
        (
            "PREFETCH",
            0,
            "E003",
            "RELIABLE_MESSAGING['PREFETCH'] must be an integer from 1 to 65535, got 0.",
            "A value near 2-4x --concurrency is usual.",
        ),
        (
            "RETRY_DELAYS",
            [],
            "E004",
            "RELIABLE_MESSAGING['RETRY_DELAYS'] must be a non-empty list of seconds, got [].",
            "Give increasing positive seconds, e.g. [1, 5, 30, 120, 600].",
        ),
        (
            "MAX_ATTEMPTS",
            0,
            "E005",
            "RELIABLE_MESSAGING['MAX_ATTEMPTS'] must be an integer >= 1, got 0.",
            "1 means no retry; the default is 6.",
        ),
        (
            "DEDUP_RETENTION",
            14,
            "E006",
            "RELIABLE_MESSAGING['DEDUP_RETENTION'] must be a positive timedelta, got 14.",
            "e.g. timedelta(days=14)",
        ),
        (
            "QUEUE_TYPE",
            "stream",
            "E008",
            "RELIABLE_MESSAGING['QUEUE_TYPE'] must be 'classic' or 'quorum', got 'stream'.",
            "Use 'quorum' for replicated queues.",
        ),
        (
            "MAX_BODY_BYTES",
            0,
            "E009",
            "RELIABLE_MESSAGING['MAX_BODY_BYTES'] must be a positive integer, got 0.",
            "The default is 1048576 (1 MiB).",
        ),
        (
            "SHUTDOWN_TIMEOUT",
            0,
            "E010",
            "RELIABLE_MESSAGING['SHUTDOWN_TIMEOUT'] must be a positive number of seconds, got 0.",
            "e.g. 30",
        ),
        (
            "HANDLER_TIMEOUT_GRACE",
            -1,
            "E010",
            "RELIABLE_MESSAGING['HANDLER_TIMEOUT_GRACE'] must be a number of seconds >= 0, got -1.",
            "e.g. 10",
        ),
        (
            "HEARTBEAT",
            -1,
            "E011",
            "RELIABLE_MESSAGING['HEARTBEAT'] must be an integer >= 0, got -1.",
            "0 disables heartbeats; 60 is usual.",
        ),
        (
            "QUORUM_DELIVERY_LIMIT",
            0,
            "E012",
            "RELIABLE_MESSAGING['QUORUM_DELIVERY_LIMIT'] must be an integer >= 1, got 0.",
            "The default is 50.",
        ),
        (
            "REQUIRE_ROUTE",
            "a.b",
            "E045",
            "RELIABLE_MESSAGING['REQUIRE_ROUTE'] must be a list of topic patterns (words "
            "separated by '.', '*' for one word, '#' for any), got 'a.b'.",
            'e.g. ["billing.command.#", "*.charge"]; [] (the default) treats every unroutable '
            "row as an event nobody subscribes to yet.",
        ),
        (
            "OPS_VIEWS_TOKEN",
            "short",
            "E046",
            "RELIABLE_MESSAGING['OPS_VIEWS_TOKEN'] must be a string of at least 16 characters or "
            "None (it is a password for the metrics/ and healthz/ views).",
            'e.g. os.environ["MESSAGING_OPS_TOKEN"], made with '
            "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`",
        ),
        (
            "OPS_VIEWS_PUBLIC",
            "yes",
            "E047",
            "RELIABLE_MESSAGING['OPS_VIEWS_PUBLIC'] must be True or False, got 'yes'.",
            "False (the default) keeps metrics/ and healthz/ to staff and the token.",
        ),
    ],
)
def test_the_wording_of_each_kind_of_rule(
    rm: Any, key: str, value: Any, id_: str, msg: str, hint: str
) -> None:
    message = only(rm(**{key: value}), f"reliable_messaging.{id_}")
    assert (message.msg, message.hint) == (msg, hint)


def test_an_unhashable_cache_alias_is_reported_not_raised(rm: Any) -> None:
    message = only(rm(CACHE_ALIAS=["x"]), "reliable_messaging.E007")
    assert "['x']" in message.msg


def test_crash_limit_hint_quotes_the_declared_defaults() -> None:
    base = {**settings.RELIABLE_MESSAGING, "QUEUE_TYPE": "quorum", "CRASH_LIMIT": 60}
    with override_settings(RELIABLE_MESSAGING=base):
        (message,) = check_settings()
    assert message.hint == "Keep CRASH_LIMIT well below QUORUM_DELIVERY_LIMIT (defaults: 3 and 50)."


@pytest.mark.parametrize("dsn", ["host=db port=5432", "postgresql://app@db:5432/shop", None])
def test_relay_listen_dsn_accepts_a_url_or_key_value_pairs(rm: Any, dsn: Any) -> None:
    assert rm(RELAY_LISTEN_DSN=dsn) == []


@pytest.mark.parametrize("dsn", ["host=db password='s3cret", "nonsense", "", 5432])
def test_relay_listen_dsn_malformed(rm: Any, dsn: Any) -> None:
    message = only(rm(RELAY_LISTEN_DSN=dsn), "reliable_messaging.E048")
    assert "RELAY_LISTEN_DSN" in message.msg
    assert "s3cret" not in message.msg  # the parser's words may quote a password


@pytest.mark.parametrize(
    "url",
    [None, "http://rabbitmq:15672", "https://monitor:s3cret@rabbitmq:15671/", "http://[::1]:15672"],
)
def test_management_url_accepts_none_or_an_http_url(rm: Any, url: Any) -> None:
    assert rm(MANAGEMENT_URL=url) == []


@pytest.mark.parametrize(
    "url",
    ["amqp://guest:s3cret@rabbitmq:5672/", "rabbitmq:15672", "http://", "http://h:port", 15672],
)
def test_management_url_malformed(rm: Any, url: Any) -> None:
    message = only(rm(MANAGEMENT_URL=url), "reliable_messaging.E049")
    assert "MANAGEMENT_URL" in message.msg
    assert "s3cret" not in message.msg


@pytest.mark.parametrize(
    "template",
    [
        "javascript:alert('{trace_id}')",
        "https://tempo.example.com/explore",  # no {trace_id}
        "https://tempo.example.com/{trace_id}/{tenant}",
        "https://tempo.example.com/{trace_id}/{0}",
        "https://tempo.example.com/{trace_id",
        42,
    ],
)
def test_trace_url_template_must_be_a_link_to_a_trace(rm: Any, template: Any) -> None:
    message = only(rm(TRACE_URL_TEMPLATE=template), "reliable_messaging.E052")
    assert "TRACE_URL_TEMPLATE" in message.msg


@pytest.mark.parametrize(
    "template",
    [None, "https://jaeger.example.com/trace/{trace_id}?uiFind={span_id}"],
)
def test_trace_url_template_accepts_a_template_of_the_ids(rm: Any, template: Any) -> None:
    assert ids(rm(TRACE_URL_TEMPLATE=template)) == []
