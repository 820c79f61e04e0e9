"""A ``deliver_at`` already past when ``publish()`` is called: the message is sent at once and is
as old as the call, not as the date, so a consumer with a short ``max_age`` handles it rather
than expiring it on arrival. Real ``relay`` and ``consume`` processes; ``tests.delta`` runs
with a max_age of 30 s: far under the minute a date-based age would give, and far over what
the relay and the consumer take on a loaded machine."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from django.db import transaction
from django.utils import timezone

from reliable_messaging import publish
from reliable_messaging.models import ProcessedMessage

from .test_expiry import Consumers, consumers, wait_for_outcomes
from .test_replay_routing import relay_once

__all__ = ["consumers"]  # the fixture, imported for the test below

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]


def test_a_past_deliver_at_is_handled_by_a_consumer_with_a_short_max_age(
    ns: str, rm_settings: dict[str, Any], consumers: Consumers
) -> None:
    _, port = consumers.start("delta", RM_TEST_LATE_MAX_AGE="30")
    a_minute_ago = timezone.now() - dt.timedelta(minutes=1)
    with transaction.atomic():
        publish("late.reminder", {"n": 1}, message_id="past-1", deliver_at=a_minute_ago)
        publish("late.reminder", {"n": 2}, message_id="past-2", deliver_at=a_minute_ago, expires=30)
    relay_once(ns)
    counted = wait_for_outcomes(port, "tests.delta", processed=2)
    assert counted.get("expired", 0) == 0, counted
    assert sorted(
        ProcessedMessage.objects.filter(consumer="tests.delta").values_list("message_id", flat=True)
    ) == ["past-1", "past-2"]
