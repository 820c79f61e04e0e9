"""Ordered consumers and the outcomes no handler exception reaches: a message of a key that runs
past its time limit becomes a dead letter ``timeout``, the later messages of its key are parked
behind it, and the other keys of the partition flow.

A ConsumerService runs in a thread of this process (its watchdog included) against the real
broker and database; ``ORDERED_PARTITIONS`` is 1, so every key shares one partition.
"""

# ruff: noqa: F811 - pytest fixtures imported from the consumer service tests, used by name
from __future__ import annotations

from typing import Any

import pytest
from django.test import override_settings

from reliable_messaging import Message
from reliable_messaging.choices import DeadLetterReason
from reliable_messaging.core.envelope import ORDERING_KEY_HEADER
from reliable_messaging.core.registry import ConsumerSpec
from reliable_messaging.models import DeadLetter
from tests.integration.consuming.test_consumer_service import (  # noqa: F401 - fixtures
    Recorder,
    effects,
    exchange_of,
    make_spec,
    rec,
)
from tests.support import Publisher, wait_until
from tests.testapp.models import Effect

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_timed_out_message_parks_its_key_and_the_partition_flows(
    ns: str,
    rm_settings: dict[str, Any],
    service: Any,
    make_spec: Any,
    rec: Recorder,
    publisher: Publisher,
) -> None:
    fast = {
        **rm_settings,
        "ORDERED_PARTITIONS": 1,
        "HANDLER_TIMEOUT": 0.5,
        "RETRY_DELAYS": [0.1],
        "MAX_ATTEMPTS": 2,
    }
    with override_settings(RELIABLE_MESSAGING=fast):
        gamma = make_spec("gamma", bindings=("seq.*",), ordered=True)
        service([gamma], on_outcome=rec)

        def send(key: str, seq: int, **payload: Any) -> None:
            publisher.publish(
                exchange_of(ns),
                "seq.next",
                {"key": key, "seq": seq, **payload},
                message_id=f"{key}-{seq}",
                headers={ORDERING_KEY_HEADER: key},
            )

        send("stuck", 0, spin={"gamma": 30})  # spins far past its 0.5 s limit, every attempt
        send("stuck", 1)
        for seq in range(3):
            send("free", seq)

        wait_until(
            lambda: DeadLetter.objects.filter(consumer=gamma.name).count() == 2,
            timeout=30,
            message="the timed-out message and the one parked behind it",
        )
        letters = {d.message_id: d for d in DeadLetter.objects.filter(consumer=gamma.name)}
        assert letters["stuck-0"].reason == DeadLetterReason.TIMEOUT
        assert letters["stuck-0"].attempts == 2
        assert letters["stuck-0"].ordering_key == "stuck"
        assert letters["stuck-1"].reason == DeadLetterReason.PARKED
        wait_until(lambda: len(effects("gamma")) == 3, timeout=20, message="the free key")
        assert effects("gamma") == [("free-0", 1), ("free-1", 1), ("free-2", 1)]


def test_a_worker_dying_on_a_keys_head_gives_the_partition_back_in_order(
    ns: str, rm_settings: dict[str, Any], service: Any, publisher: Publisher
) -> None:
    """A worker thread dies (a BaseException escaping the handler) on the head of a key while
    the key's later messages wait in the process. No stop is in progress. The later messages
    must not be handled before the head: the partition goes back to the broker in place (the
    connection dropped, as at an ordered stop), and every message of the key takes effect
    once, in order, the head on its redelivery."""
    calls: list[str] = []

    def handler(message: Message) -> None:
        calls.append(message.message_id)
        if message.message_id == "a-0" and calls.count("a-0") == 1:
            raise SystemExit("handler called sys.exit() on a-0")
        Effect.objects.create(consumer="dying", message_id=message.message_id, attempt=1)

    fast = {**rm_settings, "ORDERED_PARTITIONS": 1, "CONSUMER_BATCH_SIZE": 1}
    with override_settings(RELIABLE_MESSAGING=fast):
        spec = ConsumerSpec(
            name=f"{ns}.dying",
            queue=f"{ns}.dying",
            handler=handler,
            bindings=("seq.*",),
            ordered=True,
        )
        service([spec], concurrency=2)
        ids = [f"a-{seq}" for seq in range(6)]
        for message_id in ids:
            publisher.publish(
                exchange_of(ns),
                "seq.next",
                {"key": "a"},
                message_id=message_id,
                headers={ORDERING_KEY_HEADER: "a"},
            )
        wait_until(
            lambda: len(effects("dying")) == len(ids),
            timeout=30,
            message=lambda: f"every message handled; calls {calls}",
        )
    assert [message_id for message_id, _ in effects("dying")] == ids
