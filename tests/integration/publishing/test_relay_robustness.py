"""How the relay copes with rows it cannot send and with a broker that changed under it.

Each of these once showed a bug (a row AMQP cannot carry looping the relay, a busy idle loop,
duplicates after an exchange was deleted); they keep them fixed.
"""

from __future__ import annotations

import datetime as dt
import time
from collections import Counter
from typing import Any

import pytest
from django.db import transaction
from django.utils import timezone

from reliable_messaging import publish
from reliable_messaging.choices import OutboxStatus
from reliable_messaging.models import OutboxMessage
from reliable_messaging.publishing.relay import build_relay
from tests.support import wait_until

from .conftest import OutboxEnv

pytestmark = pytest.mark.django_db(transaction=True)


def test_default_exchange_routes_to_a_queue_by_name(ob: OutboxEnv) -> None:
    queue = ob.queue(bindings=[])
    message_id = publish(queue, {"direct": True}, exchange="")
    assert build_relay(once=True).run().sent == 1
    delivered = ob.broker.drain(queue, expected=1)
    assert [(m.message_id, m.exchange, m.payload) for m in delivered] == [
        (message_id, "", {"direct": True})
    ]


@pytest.mark.parametrize(
    "bad",
    [
        {"routing_key": "é" * 200},
        {"message_id": "é" * 200},
        {"headers": {"k" * 300: 1}},
    ],
    ids=["routing-key-400-bytes", "message-id-400-bytes", "header-name-300-bytes"],
)
def test_a_row_amqp_cannot_carry_does_not_block_the_others(
    ob: OutboxEnv, bad: dict[str, object]
) -> None:
    queue = ob.queue()
    good_before = publish("ok.before", {"n": 1})
    options = dict(bad)
    routing_key = str(options.pop("routing_key", "ok.bad"))
    try:
        with transaction.atomic():
            bad_id: str | None = publish(routing_key, {"n": 2}, **options)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        bad_id = None  # refused at publish time with a clear error: as good as a fix gets
    good_after = publish("ok.after", {"n": 3})

    # Bounded: a healthy relay is done in milliseconds; a crash-looping one is cut off.
    build_relay(once=True, max_seconds=4).run()

    assert OutboxMessage.objects.get(message_id=good_before).status == OutboxStatus.SENT
    assert OutboxMessage.objects.get(message_id=good_after).status == OutboxStatus.SENT
    delivered = ob.broker.drain(queue, expected=2)
    assert Counter(m.message_id for m in delivered) == {good_before: 1, good_after: 1}
    if bad_id is not None:
        row = OutboxMessage.objects.get(message_id=bad_id)
        assert row.attempts >= 1 and row.last_error, "the unsendable row was not charged"


def test_a_relay_does_not_spin_while_a_keyed_row_waits_behind_a_failed_head(
    ob: OutboxEnv,
) -> None:
    # stuck.* is a command: unroutable, it fails (an event would be unrouted, not block its key)
    ob.set(OUTBOX_MAX_ATTEMPTS=1, RELAY_POLL_INTERVAL=1.0, REQUIRE_ROUTE=["stuck.#"])
    ob.queue(bindings=["ok.#"])
    with transaction.atomic():
        head = publish("stuck.a", {"n": 1}, ordering_key="A")  # unroutable: fails at once
        publish("ok.a", {"n": 2}, ordering_key="A")  # held back behind the failed head

    relay = ob.relay_thread()
    claims: list[int] = []
    original = relay.relay.claims.claim

    def counting() -> Any:
        claimed = original()
        claims.append(len(claimed.rows))
        return claimed

    relay.relay.claims.claim = counting  # type: ignore[method-assign]
    wait_until(
        lambda: OutboxMessage.objects.get(message_id=head).status == OutboxStatus.FAILED,
        timeout=30,
        message="the head row to fail",
    )
    before = len(claims)
    time.sleep(3.0)  # idle: with LISTEN active the relay should poll every 5 s at most
    idle_claims = len(claims) - before
    ob.stop_relay(relay)
    # A handful at most (a NOTIFY or a poll); a busy loop makes dozens to thousands.
    assert idle_claims <= 10, f"{idle_claims} claim queries in 3 s of idling"


def test_a_deleted_exchange_does_not_make_later_batches_send_duplicates(ob: OutboxEnv) -> None:
    queue = ob.queue()
    second = f"rmtest.{ob.ns}.second"
    ob.broker.declare_exchange(second)
    second_queue = ob.queue("second", exchange=second)
    relay = ob.relay_thread()

    warm = publish("any.x", {"warm": True}, exchange=second)  # the relay learns it exists
    # Sent once its confirm is recorded, which can come after the broker has delivered it.
    wait_until(
        lambda: OutboxMessage.objects.get(message_id=warm).status == OutboxStatus.SENT,
        timeout=30,
        message="the warm-up row sent",
    )
    assert ob.broker.count(second_queue) == 1
    ob.broker.delete_exchange(second)

    later = timezone.now() + dt.timedelta(hours=1)
    with transaction.atomic():
        # Rows that come before the bad one, held back (not due) for now.
        good = [publish("good.x", {"n": n}) for n in range(5)]
        OutboxMessage.objects.filter(message_id__in=good).update(next_attempt_at=later)
        bad = publish("any.x", {"bad": True}, exchange=second)

    def bad_attempts() -> int:
        return OutboxMessage.objects.get(message_id=bad).attempts

    wait_until(lambda: bad_attempts() == 1, timeout=30, message="the first failure of the row")
    OutboxMessage.objects.filter(message_id=bad).update(next_attempt_at=later)
    last_error = OutboxMessage.objects.get(message_id=bad).last_error
    assert last_error == f"exchange {second!r} does not exist"

    # Now the good rows and the bad one are due together: one batch, good rows first.
    OutboxMessage.objects.filter(message_id__in=[*good, bad]).update(
        next_attempt_at=timezone.now() - dt.timedelta(seconds=1)
    )
    wake = publish("good.x", {"wake": True})  # its NOTIFY wakes the relay at once
    wait_until(
        lambda: (
            OutboxMessage.objects.filter(
                message_id__in=[*good, wake], status=OutboxStatus.SENT
            ).count()
            == 6
            and bad_attempts() == 2
        ),
        timeout=30,
        message="the good rows sent and the bad one charged again",
    )
    ob.stop_relay(relay)
    delivered = ob.broker.drain(queue, expected=6)
    counts = Counter(m.message_id for m in delivered)
    assert counts == dict.fromkeys([*good, wake], 1), f"duplicates: {counts}"
