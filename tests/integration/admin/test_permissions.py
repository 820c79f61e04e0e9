"""Who may do what in the dead letter console: acting needs the replay permission and the view
permission, on every path (actions, confirmation pages, a dead letter's buttons, operations and
their cancel), as Django asks of an admin action; the operations list links to an operation's
page only for users who may open it (docs/operations.md has the table)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from django.contrib.admin.models import LogEntry
from django.test import Client
from django.urls import reverse

from reliable_messaging.dead_letters.selection import selection_from_query
from reliable_messaging.models import (
    DeadLetter,
    DeadLetterOperation,
    OutboxMessage,
    ProcessedMessage,
)

from .conftest import (
    CHANGELIST,
    DISCARD_MATCHING,
    GROUPS,
    REPLAY_MATCHING,
    cancel_url,
    discard_url,
    operation_url,
    replay_url,
    run_action,
    staff_user,
)

MakeDeadLetter = Callable[..., DeadLetter]
OPERATIONS = reverse("admin:reliable_messaging_deadletteroperation_changelist")


def as_user(username: str, *codenames: str) -> Client:
    client = Client()
    client.force_login(staff_user(username, *codenames))
    return client


def pending_operation() -> DeadLetterOperation:
    return DeadLetterOperation.objects.record(
        kind="replay",
        selection=selection_from_query({"consumer": "tests.alpha"}),
        requested_by="alice (admin)",
        matched=1,
        max_pk=DeadLetter.objects.order_by("-pk").values_list("pk", flat=True).first() or 0,
    )


@pytest.mark.django_db
def test_the_replay_permission_without_the_view_permission_opens_nothing(
    make_dead_letter: MakeDeadLetter,
) -> None:
    """It counted any payload search on a confirmation page, recorded operations, replayed,
    forced (forgetting an inbox row), discarded and cancelled, for a user who may not see a
    single dead letter."""
    letter = make_dead_letter(payload={"card": "4111 1111 1111 1111"})
    ProcessedMessage.objects.create(consumer=letter.consumer, message_id=letter.message_id)
    operation = pending_operation()
    blind = as_user("blind", "replay_deadletter")
    search = "?q=4111"

    responses = {
        "confirm replay": blind.get(REPLAY_MATCHING + search),
        "confirm discard": blind.get(DISCARD_MATCHING + search),
        "record replay": blind.post(REPLAY_MATCHING + search),
        "record forced replay": blind.post(REPLAY_MATCHING + search, {"force": "1"}),
        "record discard": blind.post(DISCARD_MATCHING + search),
        "replay one": blind.post(replay_url(letter)),
        "force one": blind.post(replay_url(letter), {"force": "1"}),
        "discard one": blind.post(discard_url(letter)),
        "cancel": blind.post(cancel_url(operation)),
        "progress": blind.get(operation_url(operation)),
        "status": blind.get(
            reverse("admin:reliable_messaging_deadletter_operation_status", args=[operation.pk])
        ),
        "groups": blind.get(GROUPS),
        "list": blind.get(CHANGELIST),
        "action": run_action(blind, "force_replay_selected", [letter], post="yes"),
    }

    assert {what: r.status_code for what, r in responses.items()} == dict.fromkeys(responses, 403)
    assert list(DeadLetterOperation.objects.values_list("pk", "state")) == [
        (operation.pk, "pending")
    ]
    letter.refresh_from_db()
    assert letter.status == "dead"
    assert ProcessedMessage.objects.filter(message_id=letter.message_id).exists()
    assert not OutboxMessage.objects.exists()
    assert not LogEntry.objects.exists()


@pytest.mark.django_db
def test_view_and_replay_together_may_act(make_dead_letter: MakeDeadLetter) -> None:
    letter = make_dead_letter()
    operation = pending_operation()
    replayer = as_user("replayer", "view_deadletter", "replay_deadletter")

    assert replayer.get(REPLAY_MATCHING).status_code == 200
    assert "Cancel the operation" in replayer.get(operation_url(operation)).content.decode()
    assert replayer.post(cancel_url(operation)).status_code == 302
    assert replayer.post(replay_url(letter)).status_code == 302
    letter.refresh_from_db()
    operation.refresh_from_db()
    assert (letter.status, operation.state) == ("replayed", "cancelled")


@pytest.mark.django_db
def test_the_operations_list_links_to_an_operation_only_for_who_may_open_it(
    make_dead_letter: MakeDeadLetter,
) -> None:
    """The progress page is the dead letters' console (it needs their view permission): the
    list showed its link to users with only the operations' view permission, and a 403."""
    make_dead_letter()
    operation = pending_operation()
    auditor = as_user("auditor", "view_deadletteroperation")
    reviewer = as_user("reviewer", "view_deadletteroperation", "view_deadletter")

    listed = auditor.get(OPERATIONS)
    assert listed.status_code == 200
    assert f"#{operation.pk}" in listed.content.decode()
    assert operation_url(operation) not in listed.content.decode()
    assert auditor.get(operation_url(operation)).status_code == 403

    assert operation_url(operation) in reviewer.get(OPERATIONS).content.decode()
    assert reviewer.get(operation_url(operation)).status_code == 200
