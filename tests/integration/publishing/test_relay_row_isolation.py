"""No row stops the outbox: a row whose header frame is over the real broker's frame_max (it
closes the connection) is marked failed with its reason, and the rows around it are sent. The
rows pika cannot encode are isolated the same way in ``test_relay_on_twin.py``.

The row is written with the manager, not ``publish()`` (which refuses it now): rows written
before the refusals existed, or by another path. A real ``manage.py relay`` process sends them.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import pytest
from django.db.models.functions import Now

from reliable_messaging import publish
from reliable_messaging.choices import OutboxStatus
from reliable_messaging.models import OutboxMessage
from tests.support import wait_until

from .conftest import OutboxEnv

pytestmark = pytest.mark.django_db(transaction=True)

CLOSED = "relay: broker connection closed"


def write_row(routing_key: str, headers: dict[str, Any], **fields: Any) -> str:
    """An outbox row as a row written before publish() refused it (or by another path)."""
    row = OutboxMessage.objects.create(
        message_id=f"direct-{routing_key}-{time.monotonic_ns()}",
        exchange=fields.pop("exchange"),
        routing_key=routing_key,
        body='{"n": 0}',
        headers=headers,
        next_attempt_at=Now(),
        created_at=fields.pop("created_at", Now()),
        **fields,
    )
    return str(row.message_id)


def status(message_id: str) -> str:
    return str(OutboxMessage.objects.get(message_id=message_id).status)


def test_a_header_over_the_frame_size_fails_and_the_rows_around_it_are_sent(
    ob: OutboxEnv,
) -> None:
    queue = ob.queue()
    before = [publish("iso.before", {"n": n}) for n in range(20)]
    big = write_row("iso.big", {"big": "a" * 300_000}, exchange=ob.exchange)
    after = [publish("iso.after", {"n": n}) for n in range(20)]

    relay = ob.relay_process("--batch-size", "10")
    started = time.monotonic()
    wait_until(
        lambda: status(big) == OutboxStatus.FAILED,
        timeout=30,
        message=lambda: f"the big row marked failed; relay log:\n{relay.log()}",
    )
    failed_after = time.monotonic() - started
    wait_until(
        lambda: (
            not OutboxMessage.objects.filter(message_id__in=before + after)
            .exclude(status=OutboxStatus.SENT)
            .exists()
        ),
        timeout=30,
        message=lambda: f"the other rows sent; relay log:\n{relay.log()}",
    )
    row = OutboxMessage.objects.get(message_id=big)
    assert "frame" in row.last_error and "131072" in row.last_error, row.last_error
    delivered = Counter(m.message_id for m in ob.broker.drain(queue, expected=40))
    assert set(delivered) == set(before + after)
    # A handful of reconnects at most (the broker closes the connection once for the row).
    reconnects = relay.log().count(CLOSED)
    assert reconnects <= 2, relay.log()
    print(f"big row failed after {failed_after:.2f}s, {reconnects} reconnect(s)")
