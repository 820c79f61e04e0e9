"""A replay is due at once by the database's clock, which the relay goes by, whatever the clock
of the process that queued it says (a web server whose clock runs an hour ahead)."""

from __future__ import annotations

import datetime as dt

import pytest
from django.db.models.functions import Now
from django.utils import timezone

from reliable_messaging.dead_letters.replay import replay
from reliable_messaging.models import DeadLetter, OutboxMessage
from tests.support import broker_connection

from .test_replay_routing import ready, relay_once

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True), pytest.mark.timeout(120)]


def test_a_replay_from_a_server_whose_clock_runs_ahead_is_sent_at_once(
    ns: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = f"rmtest.{ns}.target"
    connection = broker_connection()
    try:
        connection.channel().queue_declare(target, durable=False)
    finally:
        connection.close()
    letter = DeadLetter.objects.create(
        message_id="clock-1",
        consumer="tests.alpha",
        queue=target,
        routing_key="order.placed",
        body=b'{"n": 1}',
        payload={"n": 1},
        reason="retries_exhausted",
    )
    real_now = timezone.now
    monkeypatch.setattr(timezone, "now", lambda: real_now() + dt.timedelta(hours=1))
    assert replay(DeadLetter.objects.filter(pk=letter.pk), replayed_by="tester").replayed
    monkeypatch.undo()

    row = OutboxMessage.objects.get(message_id="clock-1")
    assert OutboxMessage.objects.filter(pk=row.pk, next_attempt_at__lte=Now()).exists(), (
        f"due at {row.next_attempt_at}, the database says {timezone.now()}"
    )
    assert "sent 1" in relay_once(ns)
    assert len(ready(target)) == 1
