"""Bulk operations (``DeadLetterOperation``) as the relay carries them out: every rule of a
replay holds in the set-based batches, and two operations over the same dead letters, run at
the same time by two runners, replay each dead letter once."""

from __future__ import annotations

import io
import threading
import time
from collections import Counter
from collections.abc import Callable

import pytest
from django.core.management import call_command
from django.db import connections

from reliable_messaging.admin.operations import COUNT_CAP, figures
from reliable_messaging.core.envelope import CELERY_TASK_HEADER, REPLAYED_BY_HEADER
from reliable_messaging.dead_letters import operations
from reliable_messaging.dead_letters.operations import run_pending_operations
from reliable_messaging.dead_letters.selection import selection_from_query, targets
from reliable_messaging.models import (
    DeadLetter,
    DeadLetterOperation,
    OutboxMessage,
    ProcessedMessage,
)

from .conftest import ALPHA_QUEUE

MakeDeadLetter = Callable[..., DeadLetter]


def record(
    query: dict[str, str], *, kind: str = "replay", force: bool = False
) -> DeadLetterOperation:
    top = DeadLetter.objects.order_by("-pk").values_list("pk", flat=True).first() or 0
    selection = selection_from_query(query)
    return DeadLetterOperation.objects.record(
        kind=kind,
        selection=selection,
        requested_by="carol (admin)",
        force=force,
        matched=targets(kind, selection).count(),
        max_pk=top,
    )


@pytest.mark.django_db
def test_the_refusal_rules_hold_in_the_bulk_path(make_dead_letter: MakeDeadLetter) -> None:
    good = make_dead_letter(
        message_id="good", headers={"x-rm-ordering-key": "k1"}, ordering_key="k1"
    )
    no_json = make_dead_letter(message_id="no-json", reason="invalid_json", body=b"{")
    binary = make_dead_letter(
        message_id="binary", body=b"\xff\xfe", payload=None, reason="unsupported_content_type"
    )
    celery = make_dead_letter(message_id="celery", headers={CELERY_TASK_HEADER: "tasks.add"})
    processed = make_dead_letter(message_id="processed")
    ProcessedMessage.objects.create(consumer="tests.alpha", message_id="processed")
    operation = record({"consumer": "tests.alpha"})

    run_pending_operations(batch_size=2)

    assert sorted(OutboxMessage.objects.values_list("message_id", flat=True)) == ["good"]
    copy = OutboxMessage.objects.get()
    assert (copy.exchange, copy.routing_key, copy.ordering_key) == ("", ALPHA_QUEUE, "k1")
    assert copy.headers[REPLAYED_BY_HEADER] == "carol (admin)"
    operation.refresh_from_db()
    # The invalid JSON is left out from the start; the others are judged and refused.
    assert (operation.state, operation.replayed, operation.refused) == ("done", 1, 3)
    for letter in (no_json, binary, celery, processed):
        letter.refresh_from_db()
        assert (letter.status, letter.replay_count) == ("dead", 0)
    good.refresh_from_db()
    assert good.history[-1] == {
        "event": "replayed",
        "at": good.history[-1]["at"],
        "by": "carol (admin)",
        "forced": False,
        "operation": operation.pk,
    }

    forced = record({"message_id": "processed"}, force=True)
    run_pending_operations()

    assert not ProcessedMessage.objects.filter(message_id="processed").exists()
    processed.refresh_from_db()
    assert (processed.status, processed.history[-1]["forced"]) == ("replayed", True)
    forced.refresh_from_db()
    assert (forced.replayed, forced.refused) == (1, 0)


@pytest.mark.django_db
def test_new_failures_after_the_operation_was_recorded_are_not_swept_in(
    make_dead_letter: MakeDeadLetter,
) -> None:
    before = make_dead_letter()
    operation = record({"consumer": "tests.alpha"})
    after = make_dead_letter()

    run_pending_operations()

    before.refresh_from_db()
    after.refresh_from_db()
    assert (before.status, after.status) == ("replayed", "dead")
    operation.refresh_from_db()
    assert operation.cursor == before.pk


@pytest.mark.django_db(transaction=True)
def test_a_replay_started_twice_replays_each_dead_letter_once() -> None:
    total = 1500
    DeadLetter.objects.bulk_create(
        DeadLetter(
            message_id=f"twice-{i}",
            consumer="tests.alpha",
            queue=ALPHA_QUEUE,
            payload={"i": i},
            body=f'{{"i": {i}}}'.encode(),
            reason="permanent",
            fingerprint="b2b2b2b2b2b2b2b2",
        )
        for i in range(total)
    )
    first = record({"fingerprint": "b2b2b2b2b2b2b2b2"})
    second = record({"fingerprint": "b2b2b2b2b2b2b2b2"})
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def runner() -> None:
        try:
            start.wait(10)
            run_pending_operations(batch_size=50)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=runner) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)

    assert not errors, errors
    copies = Counter(OutboxMessage.objects.values_list("message_id", flat=True))
    assert len(copies) == total and set(copies.values()) == {1}
    assert set(DeadLetter.objects.values_list("replay_count", flat=True)) == {1}
    first.refresh_from_db()
    second.refresh_from_db()
    assert first.state == second.state == "done"
    assert first.replayed + second.replayed == total
    # A dead letter the other one had just replayed is counted as skipped, not refused.
    assert first.refused == second.refused == 0
    histories = DeadLetter.objects.values_list("history", flat=True)
    by_operation = {first.pk: first.replayed, second.pk: second.replayed}
    assert Counter(h[-1]["operation"] for h in histories) == {
        pk: count for pk, count in by_operation.items() if count
    }
    assert all(len(h) == 1 for h in histories), "one replay entry each"


@pytest.mark.django_db
def test_the_progress_of_an_operation_past_the_count_cap_is_told_by_its_cursor() -> None:
    operation = DeadLetterOperation.objects.record(
        kind="discard",
        selection=selection_from_query({}),
        requested_by="carol (admin)",
        matched=COUNT_CAP + 1,
        max_pk=400_000,
    )
    operation.cursor, operation.done, operation.state = 100_000, 90_000, "running"

    shown = figures(operation)

    assert (shown["total"], shown["total_text"], shown["percent"]) == (
        None,
        f"more than {COUNT_CAP}",
        25,
    )


@pytest.mark.django_db
@pytest.mark.parametrize("extra", [[], ["--limit", "5"]])
def test_replay_dead_letters_via_relay_records_an_operation(
    make_dead_letter: MakeDeadLetter, extra: list[str]
) -> None:
    letters = [make_dead_letter() for _ in range(3)]
    other = make_dead_letter(consumer="tests.beta", queue="elsewhere")
    out = io.StringIO()

    call_command(
        "replay_dead_letters", "--consumer", "tests.alpha", "--via-relay", *extra, stdout=out
    )

    assert "recorded replay operation" in out.getvalue()
    assert not OutboxMessage.objects.exists()
    run_pending_operations()
    assert sorted(OutboxMessage.objects.values_list("message_id", flat=True)) == sorted(
        letter.message_id for letter in letters
    )
    other.refresh_from_db()
    assert other.status == "dead"


@pytest.mark.django_db
def test_replay_dead_letters_via_relay_takes_a_queue_name_with_a_comma_as_one_name(
    make_dead_letter: MakeDeadLetter,
) -> None:
    """RabbitMQ allows a comma in a queue's name; the operation replays that queue's dead
    letters, not those of the names on each side of it."""
    wanted = make_dead_letter(queue="orders,eu")
    others = [make_dead_letter(queue="orders"), make_dead_letter(queue="eu")]

    call_command("replay_dead_letters", "--queue", "orders,eu", "--via-relay", stdout=io.StringIO())
    run_pending_operations()

    assert list(OutboxMessage.objects.values_list("message_id", flat=True)) == [wanted.message_id]
    assert [
        letter.status for letter in DeadLetter.objects.filter(pk__in=[o.pk for o in others])
    ] == [
        "dead",
        "dead",
    ]


@pytest.mark.django_db(transaction=True)
def test_a_batch_that_keeps_failing_stops_its_operation_with_the_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    DeadLetter.objects.create(
        message_id="stuck",
        consumer="tests.alpha",
        queue=ALPHA_QUEUE,
        body=b"{}",
        reason="permanent",
    )
    operation = record({})

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("the outbox is full")

    monkeypatch.setattr(operations, "replay_batch", broken)
    runner = operations.OperationRunner(batch_size=10, interval=0.01)
    runner.start()
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            operation.refresh_from_db()
            if operation.state == "failed":
                break
            time.sleep(0.05)
    finally:
        runner.stop()

    assert (operation.state, operation.error) == ("failed", "RuntimeError: the outbox is full")
    assert DeadLetter.objects.get().status == "dead"
    assert not OutboxMessage.objects.exists()
