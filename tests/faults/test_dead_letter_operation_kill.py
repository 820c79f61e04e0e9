"""A bulk replay survives a ``SIGKILL`` of the relay carrying it out: each batch commits its
replays with the operation's cursor, so the batch the kill interrupts rolls back whole and the
next relay resumes after the last committed one. Every dead letter ends replayed once: one
outbox row each, and the operation's counters match what is in the tables."""

from __future__ import annotations

import time
from collections import Counter

import psycopg
import pytest

from reliable_messaging.dead_letters.selection import selection_from_query
from reliable_messaging.models import DeadLetter, DeadLetterOperation, OutboxMessage
from tests.conftest import database_url

from .harness import FaultRig

TOTAL = 3000
BATCH = 100


def wait_for(condition: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def operation() -> DeadLetterOperation:
    return DeadLetterOperation.objects.get()


def test_a_bulk_replay_survives_a_sigkill_of_the_relay_carrying_it_out(rig: FaultRig) -> None:
    letters = DeadLetter.objects.bulk_create(
        DeadLetter(
            message_id=f"kill-{i}",
            consumer="tests.alpha",
            queue=rig.queues["alpha"],
            payload={"i": i},
            body=f'{{"i": {i}}}'.encode(),
            reason="permanent",
            fingerprint="c3c3c3c3c3c3c3c3",
        )
        for i in range(TOTAL)
    )
    DeadLetterOperation.objects.record(
        kind="replay",
        selection=selection_from_query({"fingerprint": "c3c3c3c3c3c3c3c3"}),
        requested_by="dave (admin)",
        matched=TOTAL,
        max_pk=letters[-1].pk,
    )
    # A dead letter in the middle held locked by this test: the relay's batch that reaches it
    # waits on it, mid-transaction, while the earlier batches are committed. There it is killed.
    blocker = letters[TOTAL // 2]
    with psycopg.connect(database_url()) as holder:
        holder.execute(
            "SELECT 1 FROM reliable_messaging_deadletter WHERE id = %s FOR UPDATE", [blocker.pk]
        )
        first = rig.relay("--operation-batch-size", str(BATCH))
        wait_for(
            lambda: operation().cursor >= blocker.pk - BATCH, 60, "the cursor to reach the held row"
        )
        wait_for(
            lambda: rig.in_transaction(first, "%reliable_messaging_deadletter%"),
            30,
            "the relay's batch to wait on the held row",
        )
        rig.kill_9(first)

        # What the kill left: committed batches only, the counters saying exactly that.
        stopped = operation()
        assert stopped.state == "running"
        assert stopped.cursor < blocker.pk
        assert stopped.replayed == stopped.done == OutboxMessage.objects.count() > 0
        assert DeadLetter.objects.filter(status="replayed").count() == stopped.replayed
        assert not DeadLetter.objects.filter(status="replayed", pk__gt=stopped.cursor).exists()
        holder.rollback()

    rig.relay("--operation-batch-size", str(BATCH))
    wait_for(lambda: operation().state == "done", 120, "the operation to finish")

    done = operation()
    copies = Counter(OutboxMessage.objects.values_list("message_id", flat=True))
    assert len(copies) == TOTAL and set(copies.values()) == {1}, "one outbox row per dead letter"
    assert set(DeadLetter.objects.values_list("replay_count", flat=True)) == {1}
    assert (done.replayed, done.done, done.refused, done.skipped) == (TOTAL, TOTAL, 0, 0)
    assert done.cursor == letters[-1].pk


pytestmark = pytest.mark.timeout(300)
