"""Edit, then replay, through the admin's client and the service: the permission per consumer
(created by ``migrate``), 403 on every path for the others, the copy's headers and ordering
key, what an edit may fix and what it refuses, and both directions of the link on the pages."""

from __future__ import annotations

import html
import json
from collections.abc import Callable
from typing import Any

import pytest
from django.contrib.auth.models import Permission
from django.test import Client
from django.urls import reverse

from reliable_messaging.choices import ReplayKind, ReplayOutcome
from reliable_messaging.core.registry import ConsumerSpec, registry
from reliable_messaging.dead_letters.edit import EditForm, EditRefused, check_edit, replay_edited
from reliable_messaging.dead_letters.permissions import (
    can_edit,
    consumer_codename,
    create_consumer_permissions,
)
from reliable_messaging.models import DeadLetter, OutboxMessage, Replay, TaskRun
from reliable_messaging.task_runs.naming import task_consumer_name

from .conftest import BETA_QUEUE, change_url, staff_user

MakeDeadLetter = Callable[..., DeadLetter]
pytestmark = pytest.mark.django_db


def edit_url(letter: DeadLetter) -> str:
    return reverse("admin:reliable_messaging_deadletter_edit_replay", args=[letter.pk])


def as_user(username: str, *codenames: str) -> Client:
    client = Client()
    client.force_login(staff_user(username, *codenames))
    return client


def test_migrate_made_a_permission_per_consumer() -> None:
    for name in ("tests.alpha", "tests.beta", "tests.gamma"):
        permission = Permission.objects.get(
            content_type__app_label="reliable_messaging", codename=consumer_codename(name)
        )
        assert permission.name == f"Can edit and replay dead letters of {name}"
        assert len(permission.codename) <= 100
    assert Permission.objects.filter(codename="edit_replay_deadletter").exists()


def test_a_consumer_registered_later_gets_its_permission_at_the_next_migrate() -> None:
    late = ConsumerSpec(name="late." + "x" * 300, queue="late-queue", handler=lambda m: None)
    registry.register(late)
    try:
        assert not Permission.objects.filter(codename=consumer_codename(late.name)).exists()
        assert create_consumer_permissions(using="default") == 1
        assert create_consumer_permissions(using="default") == 0  # once
        permission = Permission.objects.get(codename=consumer_codename(late.name))
        assert len(permission.name) == 255 and permission.name.startswith("Can edit and replay")
    finally:
        registry.unregister(late.name)


def test_the_permission_of_one_consumer_opens_its_dead_letters_only(
    make_dead_letter: MakeDeadLetter,
) -> None:
    alpha_letter = make_dead_letter()
    beta_letter = make_dead_letter(consumer="tests.beta", queue=BETA_QUEUE)
    bob = as_user("bob", "view_deadletter", "replay_deadletter", consumer_codename("tests.alpha"))
    form = {"payload": "{}", "headers": "{}", "reason": "fix", "replay": "1"}

    assert bob.get(edit_url(beta_letter)).status_code == 403
    assert bob.post(edit_url(beta_letter), form).status_code == 403
    assert "rm-edit-replay" not in bob.get(change_url(beta_letter)).text
    assert "rm-edit-replay" in bob.get(change_url(alpha_letter)).text
    assert bob.get(edit_url(alpha_letter)).status_code == 200
    assert not Replay.objects.exists() and not OutboxMessage.objects.exists()

    response = bob.post(edit_url(alpha_letter), form)
    assert response.status_code == 302
    assert Replay.objects.get().dead_letter_id == alpha_letter.pk


@pytest.mark.parametrize(
    "codenames",
    [
        ("view_deadletter", "replay_deadletter"),  # no edit permission
        ("view_deadletter", "edit_replay_deadletter"),  # no replay permission
        ("replay_deadletter", "edit_replay_deadletter"),  # no view permission
    ],
)
def test_each_permission_is_needed(
    make_dead_letter: MakeDeadLetter, codenames: tuple[str, ...]
) -> None:
    letter = make_dead_letter()
    client = as_user("someone", *codenames)
    assert client.get(edit_url(letter)).status_code in (302, 403)  # 302: no admin view at all
    form = {"payload": "{}", "headers": "{}", "reason": "fix", "replay": "1"}
    assert client.post(edit_url(letter), form).status_code in (302, 403)
    assert not Replay.objects.exists()


def test_the_global_permission_opens_every_consumer(make_dead_letter: MakeDeadLetter) -> None:
    staff = staff_user("dora", "view_deadletter", "replay_deadletter", "edit_replay_deadletter")
    assert can_edit(staff, "tests.alpha") and can_edit(staff, "tests.beta")
    assert can_edit(staff, "a consumer nobody registered")


def test_the_copy_keeps_routing_and_ordering_and_replaces_user_headers(
    make_dead_letter: MakeDeadLetter,
) -> None:
    letter = make_dead_letter(
        consumer="tests.gamma",
        queue="gamma-queue",
        ordering_key="key-1",
        headers={
            "x-rm-attempt": 3,
            "x-rm-ordering-key": "key-1",
            "CC": ["elsewhere"],
            "x-first-death-queue": "gamma-queue",
            "tenant": "acme",
            "obsolete": "yes",
        },
    )
    done = replay_edited(
        letter,
        payload_text='{"key": "key-1", "seq": 2}',
        headers={"tenant": "acme", "note": "fixed"},
        reason="  corrected seq  ",
        replayed_by="alice (admin)",
    )
    row = OutboxMessage.objects.get(message_id=done.message_id)
    assert row.exchange == "" and row.routing_key == "gamma-queue"
    assert row.ordering_key == "key-1"
    assert row.headers["x-rm-ordering-key"] == "key-1"
    assert row.headers["x-rm-replay-id"] == done.pk
    assert row.headers["x-rm-replay"] == 1
    assert row.headers["x-rm-exchange"] == letter.exchange
    assert row.headers["x-rm-routing-key"] == letter.routing_key
    assert {"tenant": "acme", "note": "fixed"}.items() <= row.headers.items()
    for gone in ("obsolete", "CC", "x-first-death-queue", "x-rm-attempt"):
        assert gone not in row.headers
    assert json.loads(row.body) == {"key": "key-1", "seq": 2}
    replay = Replay.objects.get()
    assert (replay.kind, replay.outcome) == (ReplayKind.EDITED, ReplayOutcome.IN_FLIGHT)
    assert replay.reason == "corrected seq" and replay.message_id == done.message_id
    assert '-  "obsolete": "yes"' in replay.edit["diff"].replace(",", "")

    with pytest.raises(EditRefused, match="awaiting that outcome"):  # once at a time
        replay_edited(
            letter, payload_text="{}", headers="{}", reason="again", replayed_by="bob (admin)"
        )
    assert Replay.objects.count() == 1


@pytest.mark.parametrize(
    ("payload", "headers", "refusal"),
    [
        ('{"order_id": 1042,, "sku": 1}', "{}", "the payload is not valid JSON: Expecting"),
        (
            json.dumps({"blob": "x" * (70 * 1024)}),
            "{}",
            "over RELIABLE_MESSAGING['MAX_BODY_BYTES'] (65536)",
        ),
        ("{}", '{"CC": ["other-queue"]}', "header 'CC' is refused"),
        ("{}", '{"x-rm-replay-id": 1}', "header 'x-rm-replay-id' is refused"),
        ("{}", '{"x-death": []}', "header 'x-death' is refused"),
        ("{}", '{"price": 1.5}', "header 'price' has a value of type float"),
        ("{}", '["tenant"]', "the headers must be a JSON object"),
    ],
    ids=["invalid-json", "too-large", "cc", "x-rm", "x-death", "float", "not-an-object"],
)
def test_the_page_shows_each_refusal_and_sends_nothing(
    admin: Client, make_dead_letter: MakeDeadLetter, payload: str, headers: str, refusal: str
) -> None:
    letter = make_dead_letter()
    form = {"payload": payload, "headers": headers, "reason": "trying", "replay": "1"}
    response = admin.post(edit_url(letter), form)
    assert response.status_code == 200
    assert refusal in html.unescape(response.content.decode())
    assert not Replay.objects.exists() and not OutboxMessage.objects.exists()
    assert DeadLetter.objects.get(pk=letter.pk).status == "dead"


def test_an_edit_fixes_a_body_that_was_not_json(make_dead_letter: MakeDeadLetter) -> None:
    """A plain replay refuses it (it would fail again); an edit replaces the body."""
    letter = make_dead_letter(payload=None, body=b'{"order_id": 7 "sku": 1}', reason="invalid_json")
    edit = check_edit(letter, payload_text='{"order_id": 7 "sku": 1}', headers="{}", reason="x")
    assert any("not valid JSON" in problem for problem in edit.problems)
    done = replay_edited(
        letter,
        payload_text='{"order_id": 7, "sku": 1}',
        headers="{}",
        reason="a comma was missing",
        replayed_by="alice (admin)",
    )
    assert json.loads(OutboxMessage.objects.get(message_id=done.message_id).body) == {
        "order_id": 7,
        "sku": 1,
    }
    assert bytes(DeadLetter.objects.get(pk=letter.pk).body) == b'{"order_id": 7 "sku": 1}'


def test_a_celery_task_or_a_resolved_letter_is_refused(make_dead_letter: MakeDeadLetter) -> None:
    task = make_dead_letter(headers={"celery-task": "shop.tasks.charge"})
    resolved = make_dead_letter(status="resolved")
    for letter, why in ((task, "Celery task"), (resolved, "its status is resolved")):
        with pytest.raises(EditRefused, match=why):
            replay_edited(
                letter, payload_text="{}", headers="{}", reason="x", replayed_by="alice (admin)"
            )
    assert not Replay.objects.exists()


def test_a_django_task_letter_offers_its_replay_and_no_edit(
    admin: Client, make_dead_letter: MakeDeadLetter
) -> None:
    # Its message only names the task's row (which holds the task and its arguments), so an
    # edit could only make it name another task: the worker would run the row's task, not the
    # diff the operator confirmed.
    letter = make_dead_letter(
        consumer=task_consumer_name("default", "default"),
        queue="tasks.default",
        message_id="t-1",
        payload={"task_id": "t-1", "task": "shop.tasks.charge"},
    )
    # Its row, which a replay runs (without it, the page offers no replay).
    TaskRun.objects.create(id="t-1", task_path="shop.tasks.charge", queue_name="default")
    page = admin.get(change_url(letter)).text
    assert 'id="rm-edit-replay"' not in page
    assert 'value="Replay"' in page
    form = admin.get(edit_url(letter))
    assert form.status_code == 200
    assert "is the message of a django.tasks task" in html.unescape(form.text)
    edited: EditForm = {
        "payload_text": '{"task_id": "t-2", "task": "shop.tasks.refund"}',
        "headers": "{}",
        "reason": "run the refund instead",
    }
    assert any("django.tasks task" in problem for problem in check_edit(letter, **edited).problems)
    with pytest.raises(EditRefused, match="enqueue the task again"):
        replay_edited(letter, **edited, replayed_by="alice (admin)")
    assert not Replay.objects.exists()
    assert not OutboxMessage.objects.exists()


def test_both_pages_show_the_link(admin: Client, make_dead_letter: MakeDeadLetter) -> None:
    original = make_dead_letter()
    done = replay_edited(
        original,
        payload_text='{"order_id": 1}',
        headers="{}",
        reason="<b>escaped</b> reason",
        replayed_by="alice (admin)",
    )
    # The copy failed again: the consumer records its dead letter and the ledger links it.
    failed = make_dead_letter(message_id=done.message_id, replay_of=original)
    Replay.objects.filter(pk=done.pk).update(outcome=ReplayOutcome.FAILED_AGAIN, failed_as=failed)

    page = admin.get(change_url(original)).text
    assert done.message_id in page and "failed again" in page
    assert f'href="{change_url(failed)}"' in page
    assert "&lt;b&gt;escaped&lt;/b&gt; reason" in page and "<b>escaped</b>" not in page
    copy_page = admin.get(change_url(failed)).text
    assert f"edited from dead letter #{original.pk}" in copy_page
    assert f'href="{change_url(original)}"' in copy_page


def test_the_edit_page_escapes_what_it_shows(
    admin: Client, make_dead_letter: MakeDeadLetter
) -> None:
    letter = make_dead_letter(
        payload={"note": "</textarea><script>alert(1)</script>"},
        headers={"x-tag": "<img src=x onerror=alert(1)>"},
    )
    page = admin.get(edit_url(letter)).text
    assert "<script>alert(1)</script>" not in page
    assert "&lt;/textarea&gt;&lt;script&gt;" in page
    assert "<img src=x" not in page
    preview: dict[str, Any] = {
        "payload": '{"note": "<script>x</script>"}',
        "headers": "{}",
        "reason": "",
        "preview": "1",
    }
    shown = admin.post(edit_url(letter), preview).text
    assert "<script>x</script>" not in shown and "&lt;script&gt;x&lt;/script&gt;" in shown
