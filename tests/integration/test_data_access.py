"""The homes of data access: the managers' moves and queries (``managers.py``) and the one
exactly-once step (``storage/inbox.py``) that consumers, batches and Celery tasks share."""

from __future__ import annotations

import datetime as dt

import pytest
from django.db import transaction
from django.utils import timezone

from reliable_messaging.choices import DeadLetterReason, DeadLetterStatus, OutboxStatus
from reliable_messaging.managers import waiting_since
from reliable_messaging.models import DeadLetter, OutboxMessage, ProcessedMessage
from reliable_messaging.storage import partitions
from reliable_messaging.storage.inbox import claimed_atomic
from tests.testapp.models import Effect
from tests.unit.test_no_import_cycles import PACKAGE, import_graph

pytestmark = pytest.mark.django_db(transaction=True)

AT = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC)


def _record(message_id: str, consumer: str = "billing") -> DeadLetter:
    with transaction.atomic():
        return DeadLetter.objects.using("default").record_failure(
            consumer,
            message_id,
            fields={
                "queue": "q",
                "body": b"{}",
                "reason": DeadLetterReason.PERMANENT,
                "status": DeadLetterStatus.DEAD,
                "attempts": 1,
            },
            event={"event": "dead_lettered", "at": AT.isoformat()},
            first_failed_at=AT,
        )


def test_a_failure_recorded_twice_updates_one_row_and_keeps_its_history() -> None:
    first = _record("m-1")
    again = _record("m-1")
    assert again.pk == first.pk
    assert DeadLetter.objects.count() == 1
    assert [e["event"] for e in again.history] == ["dead_lettered", "dead_lettered"]
    # Without a message_id every failure gets a row of its own.
    _record("")
    _record("")
    assert DeadLetter.objects.filter(message_id="").count() == 2


def test_each_move_sets_its_status_and_writes_one_history_entry() -> None:
    """Each move stamps ``updated_at`` with its ``at``, as its history entry does: a replay's
    wait for its outcome and retention count from it."""
    letter = _record("m-1")
    with transaction.atomic():
        DeadLetter.objects.mark_replayed(letter, by="ann (admin)", forced=True, at=AT)
    assert (letter.status, letter.replay_count, letter.updated_at) == ("replayed", 1, AT)
    letter.refresh_from_db()
    assert (letter.status, letter.replay_count) == (DeadLetterStatus.REPLAYED, 1)
    assert letter.updated_at == AT
    assert letter.history[-1] == {
        "event": "replayed",
        "at": AT.isoformat(),
        "by": "ann (admin)",
        "forced": True,
    }
    assert list(DeadLetter.objects.open()) == [letter]

    with transaction.atomic():
        assert DeadLetter.objects.of("billing", "m-1").resolve(at=AT) == 1
    letter.refresh_from_db()
    assert (letter.status, letter.updated_at) == (DeadLetterStatus.RESOLVED, AT)
    assert letter.history[-1] == {"event": "resolved", "at": AT.isoformat()}
    assert not DeadLetter.objects.open().exists()

    with transaction.atomic():
        assert DeadLetter.objects.filter(pk=letter.pk).discard(by="bob", at=AT) == 1
    letter.refresh_from_db()
    assert (letter.status, letter.updated_at) == (DeadLetterStatus.DISCARDED, AT)
    assert letter.history[-1] == {"event": "discarded", "at": AT.isoformat(), "by": "bob"}

    with transaction.atomic():
        DeadLetter.objects.of("billing", "m-1").resolve(at=AT, by="a later copy")
    letter.refresh_from_db()
    assert letter.history[-1]["by"] == "a later copy"
    assert len(letter.history) == 5


def test_claimed_atomic_runs_once_and_rolls_back_with_the_block() -> None:
    def run(message_id: str, fail: bool = False) -> bool:
        with claimed_atomic("default", "billing", message_id) as fresh:
            if fresh:
                Effect.objects.create(consumer="billing", message_id=message_id, attempt=1)
                if fail:
                    raise RuntimeError("handler failed")
        return fresh

    assert run("m-1") is True
    assert run("m-1") is False  # a duplicate: the block saw it and ran nothing
    assert Effect.objects.filter(message_id="m-1").count() == 1
    with pytest.raises(RuntimeError):
        run("m-2", fail=True)
    # The failure took the inbox row with the effect: the next copy runs it.
    assert not ProcessedMessage.objects.has("billing", "m-2")
    assert not Effect.objects.filter(message_id="m-2").exists()
    assert run("m-2") is True
    assert ProcessedMessage.objects.has("billing", "m-2")


def test_inbox_queries() -> None:
    ProcessedMessage.objects.create(consumer="a", message_id="m")
    ProcessedMessage.objects.create(consumer="b", message_id="m")
    ProcessedMessage.objects.create(consumer="a", message_id="other")
    assert ProcessedMessage.objects.processed_keys(["m"]) == {("a", "m"), ("b", "m")}
    assert ProcessedMessage.objects.forget("a", "m") == 1
    assert not ProcessedMessage.objects.has("a", "m")
    assert ProcessedMessage.objects.has("b", "m")


def test_delete_in_batches_reports_each_batch() -> None:
    old = timezone.now() - dt.timedelta(days=30)
    partitions.ensure_partitions("default", now=old)  # the inbox has no default partition
    ProcessedMessage.objects.bulk_create(
        ProcessedMessage(consumer="c", message_id=f"m-{i}", processed_at=old) for i in range(5)
    )
    ProcessedMessage.objects.create(consumer="c", message_id="fresh")
    seen: list[tuple[int, int]] = []
    expired = ProcessedMessage.objects.expired(timezone.now() - dt.timedelta(days=1))
    deleted = expired.delete_in_batches(2, lambda done, total: seen.append((done, total)))
    assert deleted == 5
    assert seen == [(2, 5), (4, 5), (5, 5)]
    assert list(ProcessedMessage.objects.values_list("message_id", flat=True)) == ["fresh"]


def test_outbox_queries() -> None:
    now = timezone.now()
    pending = OutboxMessage.objects.create(
        message_id="p", routing_key="k", body="{}", idempotency_key="key-1"
    )
    OutboxMessage.objects.create(
        message_id="f", routing_key="k", body="{}", status=OutboxStatus.FAILED, attempts=7
    )
    partitions.ensure_partitions("default", now=now - dt.timedelta(days=3), spec=partitions.OUTBOX)
    OutboxMessage.objects.create(
        message_id="s",
        routing_key="k",
        body="{}",
        status=OutboxStatus.SENT,
        sent_at=now - dt.timedelta(days=3),
    )
    assert OutboxMessage.objects.message_id_of("key-1") == "p"
    assert OutboxMessage.objects.message_id_of("key-2") is None
    waiting = OutboxMessage.objects.pending().order_by("pk").values_list(waiting_since(), flat=True)
    assert waiting.first() == pending.created_at
    finished = OutboxMessage.objects.finished_before(now - dt.timedelta(days=1))
    assert list(finished.values_list("message_id", flat=True)) == ["s"]
    assert OutboxMessage.objects.all().retry_failed() == 1
    again = OutboxMessage.objects.get(message_id="f")
    assert (again.status, again.attempts) == (OutboxStatus.PENDING, 0)


@pytest.mark.django_db(transaction=False)
def test_the_data_layer_depends_one_way() -> None:
    graph = import_graph()
    P = PACKAGE
    assert f"{P}.admin.dead_letters" not in graph[f"{P}.admin.console"]
    assert (
        not {
            f"{P}.consuming.processing",
            f"{P}.contrib.celery",
            f"{P}.consuming.service",
            f"{P}.publishing.relay",
        }
        & graph[f"{P}.storage.inbox"]
    )
    assert not {f"{P}.models", f"{P}.managers"} & graph[f"{P}.choices"]
