"""Declared payloads meet ordered consumers: a key's message that does not match its consumer's
type is a dead letter ``invalid_payload`` that parks the key's later messages like any other
dead letter; an edited copy with the data fixed, then the parked ones replayed, are handled in
the key's order. One partition, the real broker (consistent-hash exchange) and database."""

from __future__ import annotations

import json
from typing import Any

import pydantic
import pytest
from django.test import override_settings

from reliable_messaging.choices import DeadLetterReason, DeadLetterStatus
from reliable_messaging.core.envelope import ORDERING_KEY_HEADER
from reliable_messaging.dead_letters.edit import replay_edited
from reliable_messaging.dead_letters.replay import replay
from reliable_messaging.models import DeadLetter
from tests.e2e.test_replay_routing import relay_once
from tests.integration.consuming.test_consumer_service import exchange_of
from tests.integration.contracts.support import Handled, recording_spec
from tests.support import Publisher, drained, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]


class Step(pydantic.BaseModel):
    key: str
    seq: int


def test_an_invalid_payload_parks_its_key_and_the_key_is_handled_in_order_after_the_fix(
    ns: str, rm_settings: dict[str, Any], service: Any, publisher: Publisher
) -> None:
    handled = Handled()
    with override_settings(RELIABLE_MESSAGING={**rm_settings, "ORDERED_PARTITIONS": 1}):
        steps = recording_spec(ns, "steps", handled, Step, bindings=("seq.*",), ordered=True)
        service([steps], on_outcome=handled.on_outcome)
        for seq, value in enumerate(["zero", 1, 2]):
            publisher.publish(
                exchange_of(ns),
                "seq.next",
                {"key": "k", "seq": value},
                message_id=f"k-{seq}",
                headers={ORDERING_KEY_HEADER: "k"},
            )
        handled.wait(steps.name, 3)
        assert handled.given(steps.name) == []
        reasons = dict(
            DeadLetter.objects.filter(consumer=steps.name).values_list("message_id", "reason")
        )
        assert reasons == {
            "k-0": DeadLetterReason.INVALID_PAYLOAD,
            "k-1": DeadLetterReason.PARKED,
            "k-2": DeadLetterReason.PARKED,
        }
        wait_until(lambda: drained(f"{steps.queue}.p0"), timeout=20, message="drained")
        # The data fixed in an edited copy of the head, then the parked ones replayed.
        head = DeadLetter.objects.get(consumer=steps.name, message_id="k-0")
        replay_edited(
            head,
            payload_text=json.dumps({"key": "k", "seq": 0}),
            headers="{}",
            reason="seq was text",
            replayed_by="operator",
        )
        parked = DeadLetter.objects.filter(consumer=steps.name, reason=DeadLetterReason.PARKED)
        assert len(replay(parked, replayed_by="operator").replayed) == 2
        relay_once(ns)
        wait_until(
            lambda: len(handled.given(steps.name)) == 3,
            timeout=30,
            message=lambda: f"the key after the fix: {handled.given(steps.name)}",
        )
    assert handled.given(steps.name) == [Step(key="k", seq=seq) for seq in range(3)]
    for message_id in ("k-1", "k-2"):
        letter = DeadLetter.objects.get(consumer=steps.name, message_id=message_id)
        assert letter.status == DeadLetterStatus.RESOLVED
