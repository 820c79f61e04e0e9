"""The replay ledger with real processes: an operator's bulk replay, carried out by ``relay``,
decided by ``consume``, and what the operation's page then says.

Three dead letters are replayed together: one is processed, one fails again (its handler is
still broken), and one is a duplicate (another copy of its message, published again by its
producer, was processed before the replay arrived). A producer's message naming a ledger row in
``x-rm-replay-id`` settles nothing.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse

from reliable_messaging.choices import DeadLetterStatus, OutboxStatus, ReplayOutcome
from reliable_messaging.core.envelope import REPLAY_HEADER, REPLAY_ID_HEADER
from reliable_messaging.dead_letters.replay import replay_batch
from reliable_messaging.models import DeadLetter, DeadLetterOperation, OutboxMessage, Replay
from tests.conftest import subprocess_env
from tests.support import ConsumeProcess, Publisher, RelayProcess, wait_until
from tests.testapp.models import Effect

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True), pytest.mark.timeout(240)]

# Set in the deploy that breaks alpha; the second stays set in the "fixed" deploy too.
BROKEN = "RM_TEST_ALPHA_BROKEN"
STILL_BROKEN = "RM_TEST_ALPHA_STILL_BROKEN"


def env_for(ns: str, **extra: str) -> dict[str, str]:
    return subprocess_env(ns, unset=(BROKEN, STILL_BROKEN), **extra)


def effects(label: str, message_id: str) -> int:
    return Effect.objects.filter(consumer=label, message_id=message_id).count()


def admin_client() -> Client:
    client = Client()
    client.force_login(User.objects.create_superuser("alice", "alice@example.com", None))
    return client


def record_replay_of_alpha(client: Client) -> DeadLetterOperation:
    """The operator's "replay all matching" over alpha's dead letters, confirmed as its page
    showed them."""
    url = reverse("admin:reliable_messaging_deadletter_replay_matching") + "?consumer=tests.alpha"
    page = client.get(url)
    assert page.status_code == 200
    confirmed = page.context["confirmed"]
    assert confirmed.announced == 3
    response = client.post(
        url,
        {
            "search_mode": confirmed.search_mode,
            "max_pk": confirmed.max_pk,
            "announced": confirmed.announced,
        },
    )
    assert response.status_code == 302, response
    return DeadLetterOperation.objects.get()


def test_a_bulk_replays_outcomes_reach_the_ledger_and_the_operation_page(
    ns: str, publisher: Publisher, tmp_path: Path
) -> None:
    exchange = f"rmtest.{ns}"
    payloads: dict[str, Any] = {
        "ok": {"broken_while_env": {"alpha": BROKEN}},
        "fails": {"broken_while_env": {"alpha": STILL_BROKEN}},
        "dup": {"broken_while_env": {"alpha": BROKEN}},
    }
    broken = ConsumeProcess(
        [], env_for(ns, **{BROKEN: "1", STILL_BROKEN: "1"}), tmp_path / "consume-broken.log"
    )
    fixed: ConsumeProcess | None = None
    relay: RelayProcess | None = None
    try:
        broken.wait_consuming()
        for message_id, payload in payloads.items():
            publisher.publish(exchange, "order.placed", payload, message_id=message_id)
        wait_until(
            lambda: DeadLetter.objects.filter(consumer="tests.alpha").count() == 3,
            timeout=30,
            message="three alpha dead letters",
        )
        broken.send(signal.SIGTERM)
        assert broken.wait(30) == 0
        letters = {d.message_id: d for d in DeadLetter.objects.filter(consumer="tests.alpha")}

        # Its producer publishes "dup" again (a retry of its own) while no consumer runs: that
        # copy is in alpha's queue before the replay's copies.
        publisher.publish(exchange, "order.placed", payloads["dup"], message_id="dup")

        client = admin_client()
        operation = record_replay_of_alpha(client)
        relay = RelayProcess([], env_for(ns), tmp_path / "relay.log")
        wait_until(
            lambda: (
                DeadLetterOperation.objects.filter(pk=operation.pk, state="done").exists()
                and OutboxMessage.objects.filter(status=OutboxStatus.SENT).count() == 3
            ),
            timeout=60,
            message="the relay carried the operation out and sent the three copies",
        )
        rows = {r.message_id: r for r in Replay.objects.filter(operation=operation)}
        assert sorted(rows) == ["dup", "fails", "ok"]
        assert {r.outcome for r in rows.values()} == {ReplayOutcome.IN_FLIGHT}
        status_url = reverse(
            "admin:reliable_messaging_deadletter_operation_status", args=[operation.pk]
        )
        status = client.get(status_url).json()
        assert status["outcomes"] == {
            "in_flight": 3,
            "processed": 0,
            "duplicate": 0,
            "failed_again": 0,
        }
        assert status["refresh"] is True  # the page keeps refreshing while they travel

        # The fixed deploy: "fails" is still broken in it.
        fixed = ConsumeProcess(
            [], env_for(ns, **{STILL_BROKEN: "1"}), tmp_path / "consume-fixed.log"
        ).wait_consuming()
        wait_until(
            lambda: (
                not Replay.objects.filter(
                    operation=operation, outcome=ReplayOutcome.IN_FLIGHT
                ).exists()
            ),
            timeout=60,
            message="every replay of the operation settled",
        )

        for row in rows.values():
            row.refresh_from_db()
            assert row.outcome_at is not None
        assert rows["ok"].outcome == ReplayOutcome.PROCESSED
        assert rows["dup"].outcome == ReplayOutcome.DUPLICATE
        assert rows["fails"].outcome == ReplayOutcome.FAILED_AGAIN
        assert rows["fails"].failed_as_id == letters["fails"].pk
        assert rows["ok"].failed_as_id is None
        statuses = dict(
            DeadLetter.objects.filter(consumer="tests.alpha").values_list("message_id", "status")
        )
        assert statuses == {
            "ok": DeadLetterStatus.RESOLVED,
            "dup": DeadLetterStatus.RESOLVED,  # by the producer's copy
            "fails": DeadLetterStatus.DEAD,
        }
        # The producer's copy of "dup" ran the handler; the replay's did not.
        assert (effects("alpha", "ok"), effects("alpha", "dup"), effects("alpha", "fails")) == (
            1,
            1,
            0,
        )

        status = client.get(status_url).json()
        assert status["outcomes"] == {
            "in_flight": 0,
            "processed": 1,
            "duplicate": 1,
            "failed_again": 1,
        }
        assert status["refresh"] is False
        change = reverse("admin:reliable_messaging_deadletter_change", args=[letters["fails"].pk])
        assert [(f["dead_letter"], f["url"]) for f in status["failed_again"]] == [
            (letters["fails"].pk, change)
        ]
        page = client.get(
            reverse("admin:reliable_messaging_deadletter_operation", args=[operation.pk])
        )
        text = page.content.decode()
        for name, count in (("in-flight", 0), ("processed", 1), ("duplicate", 1)):
            assert f'<span id="rm-ledger-{name}">{count}</span>' in text, name
        assert '<span id="rm-ledger-failed-again">1</span>' in text
        assert f'<a href="{change}">#{letters["fails"].pk}</a> fails' in text
        assert '<meta http-equiv="refresh"' not in text
    finally:
        broken.close()
        for process in (fixed, relay):
            if process is not None:
                process.close()


def test_a_producers_replay_id_header_settles_nothing(
    ns: str, publisher: Publisher, tmp_path: Path
) -> None:
    """A message published to the exchange, dressed as a replay naming an in-flight ledger row
    of its consumer and message_id, is handled (processed, or failed); the row stays in
    flight."""
    exchange = f"rmtest.{ns}"
    queue = f"{ns}.alpha"  # the consume process's (this process has a namespace of its own)
    rows = {}
    for message_id in ("forged-ok", "forged-fails"):
        letter = DeadLetter.objects.create(
            message_id=message_id,
            consumer="tests.alpha",
            queue=queue,
            exchange=exchange,
            routing_key="order.placed",
            payload={},
            body=b"{}",
            content_type="application/json",
            reason="permanent",
        )
        result = replay_batch([letter.pk], replayed_by="carol (admin)")
        assert result.replayed == [letter.pk]
        rows[message_id] = Replay.objects.get(dead_letter=letter)
    # The replays' own copies never go: only the forged ones arrive.
    OutboxMessage.objects.all().delete()
    consume = ConsumeProcess([], env_for(ns), tmp_path / "consume.log").wait_consuming()
    try:
        publisher.publish(
            exchange,
            "order.placed",
            {},
            message_id="forged-ok",
            headers={REPLAY_HEADER: 1, REPLAY_ID_HEADER: rows["forged-ok"].pk},
        )
        publisher.publish(
            exchange,
            "order.placed",
            {"permanent": {"alpha": True}},
            message_id="forged-fails",
            headers={REPLAY_HEADER: 1, REPLAY_ID_HEADER: rows["forged-fails"].pk},
        )
        wait_until(
            lambda: (
                effects("alpha", "forged-ok") == 1
                and DeadLetter.objects.filter(
                    message_id="forged-fails", exception_message__contains="for good"
                ).exists()
            ),
            timeout=30,
            message="the forged messages handled: one processed, one dead-lettered",
        )
    finally:
        consume.close()
    for row in rows.values():
        row.refresh_from_db()
        assert (row.outcome, row.outcome_at, row.failed_as_id) == (
            ReplayOutcome.IN_FLIGHT,
            None,
            None,
        )
