"""Retries never extend a deadline: the attempt after a retry whose delay outlives the
message's deadline is expired, through the outbox and in place (ordered consumers).

A ConsumerService runs in a thread of this process against the real broker and database.
"""

# ruff: noqa: F811 - pytest fixtures imported from the consumer service tests, used by name
from __future__ import annotations

import time
from typing import Any

import pytest
from django.test import override_settings

from reliable_messaging.choices import DeadLetterReason
from reliable_messaging.core.envelope import (
    EXPIRES_AT_HEADER,
    ORDERING_KEY_HEADER,
    PUBLISHED_AT_HEADER,
)
from reliable_messaging.models import DeadLetter, ProcessedMessage
from tests.integration.consuming.test_consumer_service import (  # noqa: F401 - fixtures
    Recorder,
    effects,
    exchange_of,
    make_spec,
    rec,
)
from tests.support import Publisher

pytestmark = pytest.mark.django_db(transaction=True)


def now_ms() -> int:
    return int(time.time() * 1000)


def attempts_run(rec: Recorder, label: str) -> list[int]:
    with rec.lock:
        return [message.attempt for name, message in rec.messages if name == label]


def test_an_ordered_consumers_in_place_retry_past_max_age_is_expired(
    ns: str,
    rm_settings: dict[str, Any],
    service: Any,
    make_spec: Any,
    rec: Recorder,
    publisher: Publisher,
) -> None:
    # Room for a loaded machine: the first attempt has 3 s, the retry comes 4.5 s later.
    slow_retries = {**rm_settings, "ORDERED_PARTITIONS": 1, "RETRY_DELAYS": [4.5]}
    with override_settings(RELIABLE_MESSAGING=slow_retries):
        gamma = make_spec("gamma", bindings=("seq.*",), ordered=True, max_age=3.0)
        service([gamma], on_outcome=rec)
        publisher.publish(
            exchange_of(ns),
            "seq.next",
            {"key": "k", "seq": 0, "fail": {"gamma": 5}},
            message_id="late-in-place",
            headers={ORDERING_KEY_HEADER: "k", PUBLISHED_AT_HEADER: now_ms()},
        )
        rec.wait_count(gamma.name, 1, timeout=30)
    # The first attempt ran (and failed) in time; the second, 4.5 s later, is past max_age.
    assert rec.results(gamma.name) == ["expired"]
    assert attempts_run(rec, "gamma") == [1]
    assert effects("gamma") == []
    assert not ProcessedMessage.objects.filter(consumer=gamma.name).exists()
    assert not DeadLetter.objects.filter(consumer=gamma.name).exists()


def test_a_retry_whose_delay_outlives_the_deadline_is_expired_and_kept_when_asked(
    ns: str,
    rm_settings: dict[str, Any],
    service: Any,
    make_spec: Any,
    rec: Recorder,
    publisher: Publisher,
) -> None:
    with override_settings(RELIABLE_MESSAGING={**rm_settings, "RETRY_DELAYS": [4.5]}):
        alpha = make_spec("alpha", on_expiry="dead_letter")
        service([alpha], on_outcome=rec)
        publisher.publish(
            exchange_of(ns),
            "order.placed",
            {"fail": {"alpha": 5}},
            message_id="late-retry",
            headers={EXPIRES_AT_HEADER: now_ms() + 3000},
        )
        rec.wait_count(alpha.name, 2, timeout=30)
    assert rec.results(alpha.name) == ["retry", "expired"]
    assert attempts_run(rec, "alpha") == [1]
    letter = DeadLetter.objects.get(consumer=alpha.name, message_id="late-retry")
    assert letter.reason == DeadLetterReason.EXPIRED
    assert letter.attempts == 2
    assert EXPIRES_AT_HEADER in letter.exception_message
    assert not ProcessedMessage.objects.filter(consumer=alpha.name).exists()


def test_a_late_copy_of_a_handled_message_is_a_duplicate_not_a_dead_letter(
    ns: str,
    rm_settings: dict[str, Any],
    service: Any,
    make_spec: Any,
    rec: Recorder,
    publisher: Publisher,
) -> None:
    alpha = make_spec("alpha", on_expiry="dead_letter")
    service([alpha], on_outcome=rec)
    publisher.publish(exchange_of(ns), "order.placed", {"n": 1}, message_id="twice")
    rec.wait_count(alpha.name, 1)
    # The same message again, after its deadline (a producer that sent it twice, say).
    publisher.publish(
        exchange_of(ns),
        "order.placed",
        {"n": 1},
        message_id="twice",
        headers={EXPIRES_AT_HEADER: now_ms() - 1000},
    )
    rec.wait_count(alpha.name, 2)
    assert rec.results(alpha.name) == ["processed", "duplicate"]
    assert effects("alpha") == [("twice", 1)]
    assert not DeadLetter.objects.filter(consumer=alpha.name).exists()
