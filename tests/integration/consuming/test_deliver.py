"""The real processing path (decode, inbox row + handler in one transaction, retry decision,
dead letter) through ``reliable_messaging.testing.deliver``, against PostgreSQL; no broker."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from django.conf import settings
from django.db import IntegrityError, OperationalError, connection
from django.test import override_settings
from django.utils import timezone

from reliable_messaging import Message
from reliable_messaging.checks import check_settings
from reliable_messaging.core.envelope import (
    ATTEMPT_HEADER,
    FIRST_FAILED_AT_HEADER,
    LAST_ERROR_HEADER,
    ORIGINAL_EXCHANGE_HEADER,
    ORIGINAL_ROUTING_KEY_HEADER,
)
from reliable_messaging.core.outcomes import Acknowledge, ScheduleRetry
from reliable_messaging.core.registry import ConsumerSpec
from reliable_messaging.models import DeadLetter, ProcessedMessage
from reliable_messaging.testing import deliver, find_consumer
from tests.testapp.models import Effect

pytestmark = pytest.mark.django_db

ALPHA = "tests.alpha"


def effects(label: str = "alpha", message_id: str | None = None) -> list[Effect]:
    qs = Effect.objects.filter(consumer=label)
    if message_id is not None:
        qs = qs.filter(message_id=message_id)
    return list(qs.order_by("id"))


# --------------------------------------------------------------------------- exactly once


def test_processed_then_duplicate_runs_the_handler_once() -> None:
    first = deliver(ALPHA, {"order_id": 1}, message_id="m-1")
    again = deliver(ALPHA, {"order_id": 1}, message_id="m-1", redelivered=True)
    assert first == Acknowledge("processed")
    assert again == Acknowledge("duplicate")
    assert [(e.message_id, e.attempt) for e in effects()] == [("m-1", 1)]
    assert list(ProcessedMessage.objects.values_list("consumer", "message_id")) == [(ALPHA, "m-1")]


def test_duplicate_of_a_retried_copy_is_recognised_too() -> None:
    assert deliver(ALPHA, {"fail": {"alpha": 1}}, message_id="m-r").__class__ is ScheduleRetry
    assert deliver(ALPHA, {"fail": {"alpha": 1}}, message_id="m-r", attempt=2) == Acknowledge(
        "processed"
    )
    # A late copy of the first attempt (e.g. redelivered after a crash) must not run it again.
    assert deliver(ALPHA, {"fail": {"alpha": 1}}, message_id="m-r") == Acknowledge("duplicate")
    assert [e.attempt for e in effects(message_id="m-r")] == [2]


def test_two_consumers_of_one_message_each_run_once() -> None:
    for _ in range(2):
        deliver("tests.alpha", {"x": 1}, message_id="shared")
        deliver("tests.beta", {"x": 1}, message_id="shared")
    assert len(effects("alpha")) == 1 and len(effects("beta")) == 1
    assert ProcessedMessage.objects.filter(message_id="shared").count() == 2


def test_derived_message_id_deduplicates_identical_bodies() -> None:
    values = {**settings.RELIABLE_MESSAGING, "DERIVE_MESSAGE_ID": True}
    with override_settings(RELIABLE_MESSAGING=values):
        first = deliver(ALPHA, body=b'{"order": 9}', message_id="")
        again = deliver(ALPHA, body=b'{"order": 9}', message_id="")
        other = deliver(ALPHA, body=b'{"order": 10}', message_id="")
    assert [first, again, other] == [
        Acknowledge("processed"),
        Acknowledge("duplicate"),
        Acknowledge("processed"),
    ]
    assert len(effects()) == 2
    assert all(e.message_id.startswith("sha256:") for e in effects())


@pytest.mark.parametrize("value", ["False", "0", 1])
def test_a_derive_message_id_that_is_not_true_leaves_it_off(value: object) -> None:
    """Read from an environment variable, "False" is a truthy string: it must not turn on
    derived ids (which merge every two equal bodies) where no system check runs."""
    values = {**settings.RELIABLE_MESSAGING, "DERIVE_MESSAGE_ID": value}
    with override_settings(RELIABLE_MESSAGING=values):
        outcome = deliver(ALPHA, body=b'{"order": 9}', message_id="")
        assert [m.id for m in check_settings()] == ["reliable_messaging.E051"]
    assert outcome == Acknowledge("dead_lettered", "missing_message_id")
    assert effects() == []


def test_handler_sees_the_message_fields() -> None:
    seen: list[Message] = []
    spec = ConsumerSpec(
        name="fields", queue="fields.q", handler=seen.append, bindings=("order.placed",)
    )
    outcome = deliver(
        spec, {"n": 1}, message_id="m-f", headers={"tenant": "acme"}, routing_key="order.placed"
    )
    assert outcome == Acknowledge("processed")
    (message,) = seen
    assert (message.message_id, message.payload, message.routing_key) == (
        "m-f",
        {"n": 1},
        "order.placed",
    )
    assert dict(message.headers) == {"tenant": "acme"}
    assert message.attempt == 1


# --------------------------------------------------------------------------- rollback


def test_exception_rolls_back_the_effects_and_the_inbox_row() -> None:
    outcome = deliver(ALPHA, {"fail": {"alpha": 1}}, message_id="m-2", routing_key="order.placed")
    assert isinstance(outcome, ScheduleRetry)
    assert (outcome.delay, outcome.next_attempt) == (0.2, 2)
    assert "RuntimeError: alpha: transient failure on attempt 1" in outcome.error
    assert effects() == []  # the handler's insert was rolled back ...
    assert not ProcessedMessage.objects.exists()  # ... and so was the inbox row
    assert not DeadLetter.objects.exists()
    # The retry copy carries what the next attempt needs.
    headers = outcome.headers
    assert headers[ATTEMPT_HEADER] == 2
    assert headers[ORIGINAL_EXCHANGE_HEADER] == settings.RELIABLE_MESSAGING["EXCHANGE"]
    assert headers[ORIGINAL_ROUTING_KEY_HEADER] == "order.placed"
    assert isinstance(headers[FIRST_FAILED_AT_HEADER], int)
    assert headers[LAST_ERROR_HEADER].startswith("RuntimeError")

    second = deliver(ALPHA, {"fail": {"alpha": 1}}, message_id="m-2", headers=headers, attempt=2)
    assert second == Acknowledge("processed")
    assert [(e.message_id, e.attempt) for e in effects()] == [("m-2", 2)]


def test_retry_delays_follow_the_attempts() -> None:
    payload = {"fail": {"alpha": 5}}
    first = deliver(ALPHA, payload, message_id="m-3")
    second = deliver(ALPHA, payload, message_id="m-3", attempt=2)
    assert isinstance(first, ScheduleRetry) and isinstance(second, ScheduleRetry)
    assert [(first.delay, first.next_attempt), (second.delay, second.next_attempt)] == [
        (0.2, 2),
        (0.4, 3),
    ]


def test_a_handler_integrity_error_is_a_failure_not_a_duplicate() -> None:
    def handler(message: Message) -> None:
        Effect.objects.create(consumer="own", message_id=message.message_id, attempt=1)
        raise IntegrityError("the handler's own unique constraint")

    spec = ConsumerSpec(name="own-integrity", queue="own.q", handler=handler)
    outcome = deliver(spec, {}, message_id="m-i")
    assert isinstance(outcome, ScheduleRetry)
    assert not ProcessedMessage.objects.exists() and effects("own") == []


@pytest.mark.django_db(transaction=True)  # the processor reconnects to probe the database
def test_a_handler_operational_error_with_the_database_up_is_retried() -> None:
    def handler(message: Message) -> None:
        raise OperationalError("could not serialize access due to concurrent update")

    spec = ConsumerSpec(name="own-operational", queue="own.q2", handler=handler)
    outcome = deliver(spec, {}, message_id="m-o")
    assert isinstance(outcome, ScheduleRetry)
    connection.ensure_connection()
    assert not ProcessedMessage.objects.exists()


# --------------------------------------------------------------------------- dead letters


def test_permanent_error_is_dead_lettered_at_once() -> None:
    outcome = deliver(
        ALPHA,
        {"permanent": {"alpha": 1}, "order": 5},
        message_id="m-p",
        routing_key="order.placed",
        headers={"tenant": "acme"},
    )
    assert outcome == Acknowledge("dead_lettered", "permanent")
    assert effects() == [] and not ProcessedMessage.objects.exists()
    dl = DeadLetter.objects.get()
    assert (dl.consumer, dl.message_id, dl.reason, dl.attempts, dl.status) == (
        ALPHA,
        "m-p",
        "permanent",
        1,
        "dead",
    )
    assert dl.queue == find_consumer(ALPHA).queue
    assert dl.routing_key == "order.placed"
    assert dl.payload == {"permanent": {"alpha": 1}, "order": 5}
    assert dl.headers == {"tenant": "acme"}
    assert dl.exception_type == "reliable_messaging.exceptions.PermanentError"
    assert dl.exception_message == "alpha refuses this message for good"
    assert "PermanentError" in dl.traceback and "behave" in dl.traceback
    assert [e["event"] for e in dl.history] == ["dead_lettered"]
    assert dl.history[0]["reason"] == "permanent"


def test_missing_field_keyerror_is_retried_then_dead_lettered() -> None:
    payload = {"require": "sku", "fields": {}}
    assert isinstance(deliver(ALPHA, payload, message_id="m-k"), ScheduleRetry)
    assert isinstance(deliver(ALPHA, payload, message_id="m-k", attempt=2), ScheduleRetry)
    first_failed = int((timezone.now() - dt.timedelta(seconds=5)).timestamp() * 1000)
    outcome = deliver(
        ALPHA, payload, message_id="m-k", attempt=3, headers={FIRST_FAILED_AT_HEADER: first_failed}
    )
    assert outcome == Acknowledge("dead_lettered", "retries_exhausted")
    dl = DeadLetter.objects.get()
    assert (dl.reason, dl.attempts) == ("retries_exhausted", 3)
    assert dl.exception_type == "builtins.KeyError"
    assert dl.exception_message == "'sku'"
    assert "KeyError" in dl.traceback
    # first_failed_at comes from the header the first failure put on the copies.
    assert dl.first_failed_at == dt.datetime.fromtimestamp(first_failed / 1000, tz=dt.UTC)
    assert dl.first_failed_at < dl.last_failed_at
    assert effects() == []


def test_invalid_utf8_body_is_kept_byte_for_byte() -> None:
    body = b'{"name": "caf\xe9", "raw": "\x00\xff\xfe"}'
    outcome = deliver(
        ALPHA,
        body=body,
        message_id="m-u",
        headers={"tenant": b"acme\xff"},
        routing_key="order.placed",
    )
    assert outcome == Acknowledge("dead_lettered", "invalid_utf8")
    dl = DeadLetter.objects.get()
    dl.refresh_from_db()
    assert bytes(dl.body) == body
    assert dl.reason == "invalid_utf8"
    assert dl.message_id == "m-u"
    assert dl.payload is None
    assert dl.content_type == "application/json"
    assert dl.headers == {"tenant": "acme\\xff"}
    assert "UTF-8" in dl.exception_message
    assert effects() == [] and not ProcessedMessage.objects.exists()


BAD_INPUTS: list[tuple[str, dict[str, Any]]] = [
    ("invalid_json", {"body": b"{not json"}),
    ("invalid_utf8", {"body": b"\xc3\x28"}),
    ("empty_body", {"body": b""}),
    ("missing_message_id", {"body": b'{"a": 1}', "message_id": ""}),
    ("body_too_large", {"body": b'"' + b"x" * (64 * 1024) + b'"'}),
    ("unsupported_content_type", {"body": b"<xml/>", "content_type": "application/xml"}),
    ("invalid_headers", {"body": b"{}", "headers": {ATTEMPT_HEADER: "first"}}),
    ("invalid_headers", {"body": b"{}", "message_id": "m" * 300}),
]


@pytest.mark.parametrize(
    ("reason", "kwargs"), BAD_INPUTS, ids=[f"{r}-{i}" for i, (r, _) in enumerate(BAD_INPUTS)]
)
def test_each_bad_input_is_dead_lettered_with_its_reason(
    reason: str, kwargs: dict[str, Any]
) -> None:
    kwargs.setdefault("message_id", f"m-{reason}")
    outcome = deliver(ALPHA, **kwargs)
    assert outcome == Acknowledge("dead_lettered", reason)
    dl = DeadLetter.objects.get()
    assert dl.reason == reason
    assert bytes(dl.body) == kwargs["body"]
    assert dl.exception_message  # the detail, in words
    assert effects() == [] and not ProcessedMessage.objects.exists()


def test_messages_without_id_each_get_their_own_dead_letter() -> None:
    for body in (b'{"a": 1}', b'{"a": 2}'):
        assert deliver(ALPHA, body=body, message_id="") == Acknowledge(
            "dead_lettered", "missing_message_id"
        )
    assert sorted(bytes(b) for b in DeadLetter.objects.values_list("body", flat=True)) == [
        b'{"a": 1}',
        b'{"a": 2}',
    ]


def test_second_failure_of_the_same_message_updates_its_dead_letter() -> None:
    payload = {"permanent": {"alpha": 1}}
    deliver(ALPHA, payload, message_id="m-twice")
    first = DeadLetter.objects.get()
    # e.g. replayed after a fix that did not work: it fails again, this time differently.
    outcome = deliver(ALPHA, {"fail": {"alpha": 9}}, message_id="m-twice", attempt=3)
    assert outcome == Acknowledge("dead_lettered", "retries_exhausted")
    assert DeadLetter.objects.count() == 1
    second = DeadLetter.objects.get()
    assert second.pk == first.pk
    assert [(e["event"], e["reason"]) for e in second.history] == [
        ("dead_lettered", "permanent"),
        ("dead_lettered", "retries_exhausted"),
    ]
    assert (second.reason, second.attempts) == ("retries_exhausted", 3)
    assert second.exception_type == "builtins.RuntimeError"
    assert second.payload == {"fail": {"alpha": 9}}
    assert second.first_failed_at == first.first_failed_at
    assert second.last_failed_at >= first.last_failed_at


def test_other_consumer_same_message_id_gets_its_own_dead_letter() -> None:
    deliver("tests.alpha", {"permanent": {"alpha": 1, "beta": 1}}, message_id="m-both")
    deliver("tests.beta", {"permanent": {"alpha": 1, "beta": 1}}, message_id="m-both")
    assert sorted(DeadLetter.objects.values_list("consumer", flat=True)) == [
        "tests.alpha",
        "tests.beta",
    ]


# --------------------------------------------------------------------------- poison messages


def test_message_id_with_nul_is_dead_lettered() -> None:
    outcome = deliver(ALPHA, {"ok": 1}, message_id="a\x00b", attempt=3)
    assert isinstance(outcome, Acknowledge)
    assert DeadLetter.objects.count() == 1


def test_header_name_with_nul_does_not_prevent_the_dead_letter() -> None:
    outcome = deliver(ALPHA, body=b"not json", message_id="m-nul-key", headers={"k\x00": "v"})
    assert outcome == Acknowledge("dead_lettered", "invalid_json")
    assert DeadLetter.objects.count() == 1


def test_payload_the_database_refuses_is_dead_lettered_with_the_raw_body() -> None:
    # jsonb cannot hold \u0000: the handler's insert fails; the dead letter keeps the decoded
    # copy with the NUL escaped as text, and the raw body byte for byte.
    body = b'{"fail": {"alpha": 9}, "k\\u0000": 1}'
    outcome = deliver(ALPHA, body=body, message_id="m-jsonb", attempt=3)
    assert outcome == Acknowledge("dead_lettered", "retries_exhausted")
    dl = DeadLetter.objects.get()
    assert dl.payload == {"fail": {"alpha": 9}, "k\\x00": 1}
    assert bytes(dl.body) == body
