"""Edited replays with real processes: ``manage.py consume``, ``manage.py relay``, RabbitMQ.

A handler needs a field the producer left out; its message becomes a dead letter. An operator
adds the field and replays the edited copy: the consumer processes it under its new message_id,
the ledger row becomes processed and the original is resolved, its payload unchanged. An edit
that still lacks the field fails again: the copy becomes a dead letter of its own, linked to the
original (``replay_of``) by the ledger. For an ordered consumer, the edited copy of a key's
dead letter is not parked behind that dead letter, its own original.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from reliable_messaging import publish
from reliable_messaging.choices import DeadLetterReason, DeadLetterStatus, ReplayOutcome
from reliable_messaging.dead_letters.edit import replay_edited
from reliable_messaging.dead_letters.replay import replay_batch
from reliable_messaging.models import DeadLetter, ProcessedMessage, Replay
from tests.conftest import subprocess_env
from tests.support import ConsumeProcess, RelayProcess, wait_until
from tests.testapp.models import Effect

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]

NEEDS_SKU = {"order_id": 1042, "require": "sku", "fields": {"colour": "blue"}}


def dead_letter_of(message_id: str, consumer: str = "tests.alpha") -> DeadLetter:
    wait_until(
        lambda: DeadLetter.objects.filter(consumer=consumer, message_id=message_id).exists(),
        timeout=60,
        message=f"the dead letter of {message_id}",
    )
    return DeadLetter.objects.get(consumer=consumer, message_id=message_id)


def settled(replay: Replay) -> Replay:
    wait_until(
        lambda: (
            Replay.objects.exclude(outcome=ReplayOutcome.IN_FLIGHT).filter(pk=replay.pk).exists()
        ),
        timeout=60,
        message=f"the outcome of replay #{replay.pk}",
    )
    replay.refresh_from_db()
    return replay


def edit(letter: DeadLetter, payload: Any, reason: str) -> Replay:
    return replay_edited(
        letter,
        payload_text=json.dumps(payload),
        headers="{}",
        reason=reason,
        replayed_by="alice (admin)",
    )


def test_an_edited_copy_is_processed_and_one_that_fails_again_is_linked(
    ns: str, rm_settings: Any, tmp_path: Path
) -> None:
    env = subprocess_env(ns)
    consume = ConsumeProcess(["--queue", f"{ns}.alpha"], env, tmp_path / "consume.log")
    relay = RelayProcess([], env, tmp_path / "relay.log")
    try:
        consume.wait_consuming()
        first = publish("order.placed", NEEDS_SKU)
        second = publish("order.placed", NEEDS_SKU)
        letter, other = dead_letter_of(first), dead_letter_of(second)
        assert letter.reason == DeadLetterReason.RETRIES_EXHAUSTED
        assert "KeyError" in letter.exception_type

        fixed = {**NEEDS_SKU, "fields": {"colour": "blue", "sku": "TSHIRT-BLU-M"}}
        replay = settled(edit(letter, fixed, "the producer left the SKU out"))

        assert replay.outcome == ReplayOutcome.PROCESSED
        assert ProcessedMessage.objects.filter(
            consumer="tests.alpha", message_id=replay.message_id
        ).exists()
        assert not ProcessedMessage.objects.filter(message_id=first).exists()
        effect = Effect.objects.get(consumer="alpha", message_id=replay.message_id)
        assert effect.payload == fixed
        letter.refresh_from_db()
        assert letter.status == DeadLetterStatus.RESOLVED
        assert letter.payload == NEEDS_SKU and json.loads(bytes(letter.body)) == NEEDS_SKU
        assert [event["event"] for event in letter.history][-2:] == ["edited_replay", "resolved"]
        assert not DeadLetter.objects.filter(message_id=replay.message_id).exists()

        # Still without the SKU: the copy fails again, and becomes a dead letter of its own.
        still_broken = {**NEEDS_SKU, "fields": {"colour": "red"}}
        again = settled(edit(other, still_broken, "colour was wrong"))

        assert again.outcome == ReplayOutcome.FAILED_AGAIN
        copy = DeadLetter.objects.get(consumer="tests.alpha", message_id=again.message_id)
        assert again.failed_as_id == copy.pk
        assert copy.replay_of_id == other.pk
        assert copy.payload == still_broken and copy.status == DeadLetterStatus.DEAD
        other.refresh_from_db()
        assert other.status == DeadLetterStatus.RESOLVED  # superseded by its copy's dead letter
        assert other.payload == NEEDS_SKU
        assert f"failed again as dead letter #{copy.pk}" in other.history[-1]["by"]
    finally:
        consume.close()
        relay.close()


def test_an_ordered_keys_edited_copy_is_not_parked_behind_its_original(
    ns: str, rm_settings: Any, tmp_path: Path
) -> None:
    env = subprocess_env(ns)
    consume = ConsumeProcess(["--queue", f"{ns}.gamma"], env, tmp_path / "consume.log")
    relay = RelayProcess([], env, tmp_path / "relay.log")
    try:
        consume.wait_consuming()
        broken = {"key": "k", "seq": 0, "permanent": {"gamma": True}}
        first = publish("seq.k", broken, ordering_key="k")
        later = publish("seq.k", {"key": "k", "seq": 1}, ordering_key="k")
        letter = dead_letter_of(first, "tests.gamma")
        parked = dead_letter_of(later, "tests.gamma")
        assert parked.reason == DeadLetterReason.PARKED

        replay = settled(edit(letter, {"key": "k", "seq": 0}, "drop the poison flag"))

        assert replay.outcome == ReplayOutcome.PROCESSED  # not parked behind #letter
        assert Effect.objects.filter(consumer="gamma", message_id=replay.message_id).exists()
        letter.refresh_from_db()
        assert letter.status == DeadLetterStatus.RESOLVED
        assert not DeadLetter.objects.filter(message_id=replay.message_id).exists()
        # With the key's first dead letter resolved, the parked one replays and runs.
        parked_copy = replay_batch_one(parked)
        assert parked_copy.outcome == ReplayOutcome.PROCESSED
    finally:
        consume.close()
        relay.close()


def replay_batch_one(letter: DeadLetter) -> Replay:
    result = replay_batch([letter.pk], replayed_by="tests")
    assert result.replayed == [letter.pk], result.refused
    return settled(Replay.objects.get(dead_letter=letter))
