"""``publish()`` refuses what the relay could never send, naming the limit: a ``deliver_at``
before 1970 (AMQP's timestamp is unsigned), a deadline past 64 bits of milliseconds, headers
over the broker's frame size. And a ``deliver_at`` already past: sent at once, as old as the
call, not as the date."""

from __future__ import annotations

import datetime as dt

import pytest

from reliable_messaging import publish
from reliable_messaging.models import OutboxMessage
from reliable_messaging.publishing.relay import build_relay

from .conftest import OutboxEnv

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_deliver_at_before_1970_is_refused() -> None:
    with pytest.raises(ValueError, match=r"before 1970-01-01T00:00:00Z: AMQP's timestamp"):
        publish("refused.x", {}, deliver_at=dt.datetime(1969, 12, 31, 23, 59, tzinfo=dt.UTC))
    publish("accepted.x", {}, deliver_at=dt.datetime(1970, 1, 1, tzinfo=dt.UTC))
    assert OutboxMessage.objects.count() == 1


@pytest.mark.parametrize("expires", [10**17, 9.3e15, float("inf")])
def test_an_expiry_past_64_bits_of_milliseconds_is_refused(expires: object) -> None:
    with pytest.raises(ValueError, match=rf"past {2**63 - 1} ms .*signed 64-bit"):
        publish("refused.x", {}, expires=expires)  # type: ignore[arg-type]
    assert not OutboxMessage.objects.exists()


def test_headers_over_the_frame_size_are_refused_naming_the_limit() -> None:
    with pytest.raises(ValueError, match=r"over the broker's frame size \(frame_max, 131072"):
        publish("refused.x", {}, headers={"big": "a" * 300_000})
    # The ordering key travels in the headers too.
    with pytest.raises(ValueError, match=r"frame_max, 131072"):
        publish("refused.x", {}, ordering_key="k" * 140_000)
    # Just under the limit is taken (and sent: see below); the body has no such limit.
    publish("accepted.x", {}, headers={"big": "a" * 120_000})
    assert OutboxMessage.objects.count() == 1


def test_headers_under_the_frame_size_are_sent(ob: OutboxEnv) -> None:
    queue = ob.queue()
    message_id = publish("accepted.x", {}, headers={"big": "a" * 130_000})
    assert build_relay(once=True, max_seconds=10).run().sent == 1
    [received] = ob.broker.drain(queue, expected=1)
    assert received.message_id == message_id and len(received.headers["big"]) == 130_000
