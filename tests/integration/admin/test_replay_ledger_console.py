"""The replay ledger in the admin: the dry run of a bulk replay (what it would replay, refuse and
skip, writing nothing), an operation's page with its replays' outcomes, and single replays'
ledger rows."""

from __future__ import annotations

import io
import re
from collections.abc import Callable
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connection
from django.db.models import Count
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from reliable_messaging.admin import operations as admin_operations
from reliable_messaging.choices import ReplayKind, ReplayOutcome
from reliable_messaging.core.envelope import CELERY_TASK_HEADER, REPLAY_ID_HEADER
from reliable_messaging.dead_letters import ledger, operations
from reliable_messaging.dead_letters.operations import dry_run, run_pending_operations
from reliable_messaging.dead_letters.replay import ALREADY_PROCESSED, CELERY_TASK, judge_batch
from reliable_messaging.dead_letters.selection import selection_from_query
from reliable_messaging.models import (
    DeadLetter,
    DeadLetterOperation,
    OutboxMessage,
    ProcessedMessage,
    Replay,
)
from tests.markers import postgresql_only
from tests.settings import NAMESPACE

from .conftest import REPLAY_MATCHING, change_url, form_of, operation_url, replay_url, run_action
from .test_admin_pages_bounded import fetched

MakeDeadLetter = Callable[..., DeadLetter]


def state() -> dict[str, Any]:
    """Everything a replay would write."""
    return {
        "outbox": OutboxMessage.objects.count(),
        "replays": Replay.objects.count(),
        "operations": DeadLetterOperation.objects.count(),
        "inbox": sorted(ProcessedMessage.objects.values_list("consumer", "message_id")),
        "letters": sorted(
            DeadLetter.objects.values_list("pk", "status", "replay_count", "updated_at")
        ),
    }


@pytest.fixture
def mixed(make_dead_letter: MakeDeadLetter) -> dict[str, DeadLetter]:
    """tests.alpha's dead letters: two replayable, three refused for two reasons, one left out
    for a reason a replay would fail again, two left alone for their status."""
    letters = {
        "good-1": make_dead_letter(message_id="good-1"),
        "good-2": make_dead_letter(message_id="good-2"),
        "no-json": make_dead_letter(message_id="no-json", reason="invalid_json", body=b"{"),
        "celery": make_dead_letter(message_id="celery", headers={CELERY_TASK_HEADER: "t.add"}),
        "done-1": make_dead_letter(message_id="done-1"),
        "done-2": make_dead_letter(message_id="done-2"),
        "resolved": make_dead_letter(message_id="resolved", status="resolved"),
        "discarded": make_dead_letter(message_id="discarded", status="discarded"),
    }
    for message_id in ("done-1", "done-2"):
        ProcessedMessage.objects.create(consumer="tests.alpha", message_id=message_id)
    return letters


def dry_run_page(client: Client, query: str, **data: Any) -> Any:
    url = f"{REPLAY_MATCHING}?{query}"
    page = client.get(url)
    assert page.status_code == 200
    assert 'name="dry_run"' in page.text
    response = client.post(url, {**form_of(page), "dry_run": "Dry run", **data})
    assert response.status_code == 200  # the same page, with the dry run's figures
    return response


@pytest.mark.django_db
def test_a_dry_run_shows_what_a_replay_would_do_and_writes_nothing(
    admin: Client, mixed: dict[str, DeadLetter]
) -> None:
    before = state()

    with CaptureQueriesContext(connection) as captured:
        response = dry_run_page(admin, "consumer=tests.alpha")

    assert state() == before
    writes = [
        q["sql"]
        for q in captured.captured_queries
        if re.match(r"\s*(INSERT|UPDATE|DELETE|COPY)\b", q["sql"], re.I)
        or "FOR UPDATE" in q["sql"].upper()
    ]
    assert not writes, writes
    figures = response.context["dry_run"]
    assert (figures.examined, figures.limited) == (8, False)
    # The one whose reason a replay would fail again is left out, as the operation leaves it.
    assert (figures.done, figures.forced, figures.skipped) == (2, 0, 3)
    assert figures.refused == {"already_processed": 2, "celery_task": 1}
    assert figures.examples[CELERY_TASK] == [mixed["celery"].pk]
    assert figures.examples[ALREADY_PROCESSED] == [mixed["done-1"].pk, mixed["done-2"].pk]
    text = response.text
    assert '<span id="rm-dry-run-done">2</span>' in text
    assert '<span id="rm-dry-run-refused">3</span>' in text
    assert '<span id="rm-dry-run-skipped">3</span>' in text
    assert "already processed by its consumer (force to run it again): " in text
    # The page still confirms the real thing, as announced.
    assert form_of(response)["announced"] == "5"

    # Then the operation does what the dry run said, figure for figure.
    operation = DeadLetterOperation.objects.record(
        kind="replay",
        selection=selection_from_query({"consumer": "tests.alpha"}),
        requested_by="carol (admin)",
        force=False,
        matched=5,
        max_pk=max(letter.pk for letter in mixed.values()),
    )
    run_pending_operations()
    assert sorted(OutboxMessage.objects.values_list("message_id", flat=True)) == [
        "good-1",
        "good-2",
    ]
    operation.refresh_from_db()
    assert (operation.replayed, operation.refused) == (figures.done, figures.refused_total)


@pytest.mark.django_db
def test_a_forced_dry_run_counts_the_processed_ones_as_forced(
    admin: Client, mixed: dict[str, DeadLetter]
) -> None:
    before = state()

    response = dry_run_page(admin, "consumer=tests.alpha", force="1")

    assert state() == before  # the inbox rows a forced replay forgets are still there
    figures = response.context["dry_run"]
    assert (figures.done, figures.forced) == (4, 2)
    assert figures.refused == {"celery_task": 1}
    assert 'name="force" value="1" checked' in response.text


@pytest.mark.django_db
def test_a_dry_run_over_a_status_filter_judges_what_it_takes(
    admin: Client, mixed: dict[str, DeadLetter]
) -> None:
    response = dry_run_page(admin, "status__in=dead,discarded,resolved")

    figures = response.context["dry_run"]
    # The discarded one is taken when chosen by status; the resolved one stays left alone, and
    # so does the one a replay would fail again.
    assert (figures.done, figures.skipped) == (3, 2)


@pytest.mark.django_db
def test_a_dry_run_looks_at_a_bounded_number(
    make_dead_letter: MakeDeadLetter, monkeypatch: pytest.MonkeyPatch
) -> None:
    for _ in range(7):
        make_dead_letter()
    monkeypatch.setattr(operations, "DRY_RUN_BATCH", 2)  # several judged batches
    figures = dry_run("replay", selection_from_query({"consumer": "tests.alpha"}), limit=5)
    assert (figures.examined, figures.limited, figures.done) == (5, True, 5)
    assert Replay.objects.count() == OutboxMessage.objects.count() == 0


@pytest.mark.django_db
def test_the_dry_run_and_the_replay_judge_alike(mixed: dict[str, DeadLetter]) -> None:
    """One judge: what ``judge_batch`` says is what ``replay_batch`` then does."""
    from reliable_messaging.dead_letters.replay import replay_batch

    ids = sorted(letter.pk for letter in mixed.values())
    judged = judge_batch(ids)
    result = replay_batch(ids, replayed_by="carol (admin)")
    assert [letter.pk for letter, _ in judged.chosen] == result.replayed
    assert {pk: why.text for pk, why in judged.refused.items()} == result.refused
    assert judged.skipped == result.skipped


@pytest.mark.django_db
def test_the_command_dry_run_uses_the_replays_judge(mixed: dict[str, DeadLetter]) -> None:
    before = state()
    out = io.StringIO()
    call_command("replay_dead_letters", "--consumer", "tests.alpha", "--dry-run", stdout=out)
    assert state() == before
    text = out.getvalue()
    assert f"would replay #{mixed['good-1'].pk} message_id=good-1" in text
    assert f"would refuse #{mixed['done-1'].pk}: consumer tests.alpha already processed" in text
    assert f"would refuse #{mixed['celery'].pk}: it is a Celery task" in text
    # dead ones only, by default: the resolved and discarded ones are not chosen
    assert "dry run: 6 dead letter(s) match; nothing replayed" in text
    assert "2 would be replayed, 4 refused" in text


@pytest.mark.django_db
def test_the_command_takes_a_consumers_queue_for_the_consumer_and_says_so(
    mixed: dict[str, DeadLetter],
) -> None:
    """``@consumer("<queue>")`` takes the queue first; logs, the admin and the dead letters use
    the consumer's name. ``--consumer <its queue>`` selects that consumer's dead letters and
    says which name it took, instead of matching none."""
    queue = f"{NAMESPACE}.alpha"
    out, err = io.StringIO(), io.StringIO()
    call_command("replay_dead_letters", "--consumer", queue, "--dry-run", stdout=out, stderr=err)
    assert f"--consumer {queue}: that is the queue of consumer tests.alpha" in err.getvalue()
    assert "dry run: 6 dead letter(s) match; nothing replayed" in out.getvalue()


def settle(row: Replay, outcome: ReplayOutcome, failed_as: DeadLetter | None = None) -> None:
    """What the consumer records when it decides a copy (``ledger.settle``, once it found the
    row the copy names), for a page test."""
    ledger.settle_row(row, outcome, using="default", failed_as=failed_as)


@pytest.mark.django_db
def test_the_operation_page_shows_the_outcomes_and_the_letters_that_failed_again(
    admin: Client, make_dead_letter: MakeDeadLetter, monkeypatch: pytest.MonkeyPatch
) -> None:
    letters = [make_dead_letter(message_id=f"m-{n}") for n in range(6)]
    operation = DeadLetterOperation.objects.record(
        kind="replay",
        selection=selection_from_query({"consumer": "tests.alpha"}),
        requested_by="carol (admin)",
        force=False,
        matched=6,
        max_pk=letters[-1].pk,
    )
    run_pending_operations()
    rows = list(Replay.objects.filter(operation=operation).order_by("pk"))
    assert [row.dead_letter_id for row in rows] == [letter.pk for letter in letters]
    copies = dict(OutboxMessage.objects.values_list("message_id", "headers"))
    assert [copies[row.message_id][REPLAY_ID_HEADER] for row in rows] == [r.pk for r in rows]
    settle(rows[0], ReplayOutcome.PROCESSED)
    settle(rows[1], ReplayOutcome.DUPLICATE)
    for row, letter in zip(rows[2:5], letters[2:5], strict=True):
        settle(row, ReplayOutcome.FAILED_AGAIN, failed_as=letter)
    monkeypatch.setattr(admin_operations, "FAILED_AGAIN_SHOWN", 2)

    page = admin.get(operation_url(operation))

    text = page.text
    for name, count in (("in-flight", 1), ("processed", 1), ("duplicate", 1), ("failed-again", 3)):
        assert f'<span id="rm-ledger-{name}">{count}</span>' in text, name
    for letter in letters[2:4]:
        assert f'<a href="{change_url(letter)}">#{letter.pk}</a>' in text
    assert f'href="{change_url(letters[4])}"' not in text
    assert "and 1 more." in text
    listed = f"id__in={letters[2].pk}%2C{letters[3].pk}"
    assert listed in page.context["failed_again_list_url"].replace(",", "%2C")
    assert '<meta http-equiv="refresh"' in text  # one still in flight
    status = admin.get(
        reverse("admin:reliable_messaging_deadletter_operation_status", args=[operation.pk])
    ).json()
    assert status["outcomes"] == {
        "in_flight": 1,
        "processed": 1,
        "duplicate": 1,
        "failed_again": 3,
    }
    assert [item["dead_letter"] for item in status["failed_again"]] == [
        letters[2].pk,
        letters[3].pk,
    ]
    assert status["failed_again_more"] == 1

    # The list the link opens shows those dead letters.
    listing = admin.get(page.context["failed_again_list_url"])
    assert listing.status_code == 200
    assert sorted(d.pk for d in listing.context["cl"].result_list) == [
        letters[2].pk,
        letters[3].pk,
    ]

    settle(rows[5], ReplayOutcome.PROCESSED)
    assert '<meta http-equiv="refresh"' not in admin.get(operation_url(operation)).text


@pytest.mark.django_db
def test_a_discard_operations_page_has_no_ledger(
    admin: Client, make_dead_letter: MakeDeadLetter
) -> None:
    letter = make_dead_letter()
    operation = DeadLetterOperation.objects.record(
        kind="discard",
        selection=selection_from_query({"consumer": "tests.alpha"}),
        requested_by="carol (admin)",
        force=False,
        matched=1,
        max_pk=letter.pk,
    )
    run_pending_operations()
    page = admin.get(operation_url(operation))
    assert page.status_code == 200
    assert 'id="rm-ledger"' not in page.text


@pytest.mark.django_db
def test_single_replays_are_in_the_ledger(admin: Client, make_dead_letter: MakeDeadLetter) -> None:
    one, two, three = (make_dead_letter() for _ in range(3))
    ProcessedMessage.objects.create(consumer="tests.alpha", message_id=three.message_id)

    admin.post(replay_url(one), follow=True)
    run_action(admin, "replay_selected", [two])
    run_action(admin, "force_replay_selected", [three], post="yes")

    rows = {row.dead_letter_id: row for row in Replay.objects.all()}
    assert sorted(rows) == sorted([one.pk, two.pk, three.pk])
    assert (rows[one.pk].kind, rows[two.pk].kind, rows[three.pk].kind) == (
        ReplayKind.REPLAY,
        ReplayKind.REPLAY,
        ReplayKind.FORCED,
    )
    for row in rows.values():
        assert (row.operation_id, row.outcome, row.replayed_by) == (
            None,
            ReplayOutcome.IN_FLIGHT,
            "alice (admin)",
        )
        copy = OutboxMessage.objects.get(message_id=row.message_id)
        assert copy.headers[REPLAY_ID_HEADER] == row.pk


@postgresql_only
@pytest.mark.django_db
def test_the_operation_page_reads_its_outcome_tally_not_its_ledger_rows(
    admin: Client, make_dead_letter: MakeDeadLetter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """2,000 replays of one operation: its page and status JSON show the same outcome counts as
    a count of its ledger rows, without counting them (no aggregate over the replays, no sort
    of all those that failed again: each query reads a few index entries)."""
    letters = [make_dead_letter(message_id=f"m-{n}") for n in range(2000)]
    operation = DeadLetterOperation.objects.record(
        kind="replay",
        selection=selection_from_query({"consumer": "tests.alpha"}),
        requested_by="carol (admin)",
        force=False,
        matched=len(letters),
        max_pk=letters[-1].pk,
    )
    run_pending_operations()
    rows = list(Replay.objects.filter(operation=operation).order_by("pk"))
    assert len(rows) == 2000
    for row in rows[:300]:
        settle(row, ReplayOutcome.PROCESSED)
    for row in rows[300:400]:
        settle(row, ReplayOutcome.DUPLICATE)
    for row, letter in zip(rows[400:460], letters[400:460], strict=True):
        settle(row, ReplayOutcome.FAILED_AGAIN, failed_as=letter)
    table = Replay._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {table}")
    counted = dict(
        Replay.objects.filter(operation=operation)
        .values("outcome")
        .annotate(n=Count("id"))
        .values_list("outcome", "n")
    )
    assert counted == {"processed": 300, "duplicate": 100, "failed_again": 60, "in_flight": 1540}

    page = fetched(admin, operation_url(operation), table)
    status = fetched(
        admin,
        reverse("admin:reliable_messaging_deadletter_operation_status", args=[operation.pk]),
        table,
    )

    for name, count in counted.items():
        assert f'<span id="rm-ledger-{name.replace("_", "-")}">{count}</span>' in page.text
    assert status.json()["outcomes"] == counted
    assert status.json()["failed_again_more"] == 10
    with CaptureQueriesContext(connection) as captured:
        admin.get(operation_url(operation))
    on_the_ledger = [q["sql"] for q in captured.captured_queries if f'"{table}"' in q["sql"]]
    assert len(on_the_ledger) == 1  # the letters that failed again, the first 50
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")
        cursor.execute(f"EXPLAIN {on_the_ledger[0]}")
        plan = "\n".join(line for (line,) in cursor.fetchall())
    assert "rm_replay_op_outcome_idx" in plan and "Sort" not in plan, plan
