"""The whole loop, driven from the admin: a dead letter is replayed there, the outbox delivers
it (``reliable_messaging.testing.run_outbox``, the way the relay and RabbitMQ would route it),
and the outcome comes back to the dead letter's page."""

from __future__ import annotations

import json

import pytest
from django.contrib.admin.models import LogEntry
from django.test import Client

from reliable_messaging.conf import messaging_settings
from reliable_messaging.core.outcomes import Acknowledge
from reliable_messaging.models import DeadLetter, ProcessedMessage
from reliable_messaging.testing import deliver, run_outbox
from tests.testapp.models import Effect

from .conftest import ALPHA_QUEUE, change_url, messages_of, run_action

pytestmark = pytest.mark.django_db


def test_a_replay_reaches_the_failed_consumer_only_and_resolves_the_dead_letter(
    admin: Client,
) -> None:
    # tests.alpha and tests.beta both subscribe to order.*; only alpha failed this one.
    letter = DeadLetter.objects.create(
        message_id="replay-me",
        consumer="tests.alpha",
        queue=ALPHA_QUEUE,
        exchange=messaging_settings.exchange,
        routing_key="order.placed",
        payload={"n": 1},
        body=json.dumps({"n": 1}).encode(),
        content_type="application/json",
        reason="permanent",
        exception_type="reliable_messaging.exceptions.PermanentError",
        exception_message="alpha refuses this message for good",
        history=[{"event": "dead_lettered", "at": "2026-11-20T10:00:00+00:00"}],
    )

    response = run_action(admin, "replay_selected", [letter])
    assert messages_of(response)[0].startswith("1 dead letter was replayed")

    outcomes = run_outbox()

    assert outcomes == [("tests.alpha", "replay-me", Acknowledge("processed"))]
    assert [(e.consumer, e.message_id, e.attempt) for e in Effect.objects.all()] == [
        ("alpha", "replay-me", 1)
    ]
    assert ProcessedMessage.objects.filter(consumer="tests.alpha", message_id="replay-me").exists()
    letter.refresh_from_db()
    assert (letter.status, letter.replay_count) == ("resolved", 1)
    assert [e["event"] for e in letter.history] == ["dead_lettered", "replayed", "resolved"]
    page = admin.get(change_url(letter)).content.decode()
    assert "rm-status-resolved" in page or ">resolved<" in page
    assert "yes, at" in page  # processed by the consumer, linked to the inbox row
    assert LogEntry.objects.filter(object_id=str(letter.pk)).count() == 1


def test_a_replay_that_fails_again_updates_the_same_dead_letter(admin: Client) -> None:
    outcome = deliver("tests.alpha", {"permanent": {"alpha": 1}}, message_id="still-bad")
    assert outcome == Acknowledge("dead_lettered", reason="permanent")
    letter = DeadLetter.objects.get()

    run_action(admin, "replay_selected", [letter])
    assert run_outbox() == [
        ("tests.alpha", "still-bad", Acknowledge("dead_lettered", reason="permanent"))
    ]

    (again,) = DeadLetter.objects.all()  # updated, not copied
    assert again.pk == letter.pk
    assert (again.status, again.replay_count) == ("dead", 1)
    assert [e["event"] for e in again.history] == ["dead_lettered", "replayed", "dead_lettered"]
    assert not Effect.objects.filter(consumer="beta").exists()

    # And it can be replayed again from the admin.
    response = run_action(admin, "replay_selected", [again])
    assert messages_of(response)[0].startswith("1 dead letter was replayed")
    again.refresh_from_db()
    assert again.replay_count == 2
