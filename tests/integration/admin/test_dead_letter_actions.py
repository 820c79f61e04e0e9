"""Replay, force, discard and delete through the admin: actions, the per-letter buttons, bulk
work by filter and by failure group with a confirmation page, the admin log, and who may."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from django.contrib.admin.models import CHANGE, DELETION, LogEntry
from django.test import Client
from django.urls import reverse

from reliable_messaging.core.envelope import (
    DEAD_LETTER_ID_HEADER,
    ORIGINAL_EXCHANGE_HEADER,
    ORIGINAL_ROUTING_KEY_HEADER,
    REPLAY_HEADER,
    REPLAYED_BY_HEADER,
)
from reliable_messaging.dead_letters import operations
from reliable_messaging.dead_letters.operations import run_batch, run_pending_operations
from reliable_messaging.models import (
    DeadLetter,
    DeadLetterOperation,
    OutboxMessage,
    ProcessedMessage,
)

from .conftest import (
    ALPHA_QUEUE,
    BETA_QUEUE,
    CHANGELIST,
    DISCARD_MATCHING,
    GROUPS,
    REPLAY_MATCHING,
    cancel_url,
    change_url,
    discard_url,
    messages_of,
    operation_url,
    replay_url,
    run_action,
)

pytestmark = pytest.mark.django_db

MakeDeadLetter = Callable[..., DeadLetter]


def log_messages(letter: DeadLetter) -> list[tuple[str, int, str]]:
    """The admin log of ``letter``: (who, what kind, message), oldest first."""
    return list(
        LogEntry.objects.filter(object_id=str(letter.pk))
        .order_by("pk")
        .values_list("user__username", "action_flag", "change_message")
    )


# --------------------------------------------------------------------------- replay


def test_replay_selected_goes_through_the_outbox_to_the_failed_consumer_only(
    admin: Client, make_dead_letter: MakeDeadLetter
) -> None:
    letter = make_dead_letter(message_id="m-1", headers={"x-rm-attempt": 3, "tenant": "acme"})
    other = make_dead_letter(message_id="m-2")

    response = run_action(admin, "replay_selected", [letter])

    assert response.status_code == 200
    assert messages_of(response) == [
        "1 dead letter was replayed: the relay sends it to the queue of the consumer that "
        "failed it, and only there."
    ]
    row = OutboxMessage.objects.get()
    assert (row.exchange, row.routing_key, row.message_id) == ("", ALPHA_QUEUE, "m-1")
    assert row.body == bytes(letter.body).decode()
    assert row.headers[REPLAY_HEADER] == 1
    assert row.headers[REPLAYED_BY_HEADER] == "alice (admin)"
    assert row.headers[DEAD_LETTER_ID_HEADER] == letter.pk
    assert row.headers[ORIGINAL_ROUTING_KEY_HEADER] == "order.placed"
    assert row.headers[ORIGINAL_EXCHANGE_HEADER] == letter.exchange
    assert row.headers["tenant"] == "acme" and "x-rm-attempt" not in row.headers
    letter.refresh_from_db()
    assert (letter.status, letter.replay_count) == ("replayed", 1)
    assert letter.history[-1]["event"] == "replayed"
    assert letter.history[-1]["by"] == "alice (admin)"
    assert log_messages(letter) == [("alice", CHANGE, "Replayed (selected in the list).")]
    history = admin.get(reverse("admin:reliable_messaging_deadletter_history", args=[letter.pk]))
    assert "Replayed (selected in the list)." in history.content.decode()
    assert ">alice<" in history.content.decode()
    other.refresh_from_db()
    assert (other.status, log_messages(other)) == ("dead", [])


def test_messages_use_plural_forms(admin: Client, make_dead_letter: MakeDeadLetter) -> None:
    letters = [make_dead_letter() for _ in range(3)]

    response = run_action(admin, "replay_selected", letters)

    assert messages_of(response)[0].startswith("3 dead letters were replayed")
    assert OutboxMessage.objects.count() == 3
    assert log_messages(letters[0]) == [
        ("alice", CHANGE, "Replayed (selected in the list; 3 dead letters in this operation).")
    ]


def test_replay_of_an_already_processed_message_is_refused_with_the_reason(
    admin: Client, make_dead_letter: MakeDeadLetter
) -> None:
    letter = make_dead_letter(message_id="m-done")
    fresh = make_dead_letter(message_id="m-fresh")
    ProcessedMessage.objects.create(consumer="tests.alpha", message_id="m-done")

    response = run_action(admin, "replay_selected", [letter, fresh])

    texts = messages_of(response)
    assert texts[0].startswith("1 dead letter was replayed")
    assert texts[1] == (
        f"1 dead letter was not replayed: #{letter.pk} (m-done): consumer tests.alpha already "
        "processed message m-done; replaying it would not run the handler (force it to forget "
        "that and run it again)"
    )
    assert "use “force”" in texts[2]
    assert list(OutboxMessage.objects.values_list("message_id", flat=True)) == ["m-fresh"]
    letter.refresh_from_db()
    assert (letter.status, letter.replay_count) == ("dead", 0)
    assert log_messages(letter) == []


def test_force_replay_asks_for_confirmation_then_runs_the_handler_again(
    admin: Client, make_dead_letter: MakeDeadLetter
) -> None:
    letter = make_dead_letter(message_id="m-done")
    ProcessedMessage.objects.create(consumer="tests.alpha", message_id="m-done")

    confirmation = run_action(admin, "force_replay_selected", [letter])

    assert confirmation.status_code == 200
    html = confirmation.content.decode()
    assert "1 of them was already processed by its consumer." in html
    assert "Yes, replay them" in html
    assert not OutboxMessage.objects.exists()

    done = run_action(admin, "force_replay_selected", [letter], post="yes")

    assert messages_of(done)[0].startswith("1 dead letter was replayed")
    assert OutboxMessage.objects.get().message_id == "m-done"
    # Forgotten by the inbox, or the consumer would ack the replay as a duplicate.
    assert not ProcessedMessage.objects.exists()
    letter.refresh_from_db()
    assert letter.status == "replayed" and letter.history[-1]["forced"] is True
    assert log_messages(letter) == [("alice", CHANGE, "Replayed, forced (selected in the list).")]


def test_refusals_other_than_processed_are_reported_too(
    admin: Client, make_dead_letter: MakeDeadLetter
) -> None:
    resolved = make_dead_letter(message_id="m-ok", status="resolved")
    broken = make_dead_letter(
        message_id="m-broken", reason="invalid_json", payload=None, body=b"{nope"
    )

    response = run_action(admin, "replay_selected", [resolved, broken])

    (text,) = messages_of(response)
    assert text.startswith("2 dead letters were not replayed: ")
    assert f"#{resolved.pk} (m-ok): its status is resolved, not dead or discarded" in text
    assert f"#{broken.pk} (m-broken): its body is not JSON" in text
    assert not OutboxMessage.objects.exists()


def test_replay_and_discard_buttons_of_the_page(
    admin: Client, make_dead_letter: MakeDeadLetter
) -> None:
    letter = make_dead_letter(message_id="m-page")
    ProcessedMessage.objects.create(consumer="tests.alpha", message_id="m-page")

    refused = admin.post(replay_url(letter), follow=True)
    assert refused.redirect_chain[-1][0] == change_url(letter)
    assert "1 dead letter was not replayed" in messages_of(refused)[0]

    forced = admin.post(replay_url(letter), {"force": "1"}, follow=True)
    assert messages_of(forced)[0].startswith("1 dead letter was replayed")
    assert OutboxMessage.objects.filter(message_id="m-page").count() == 1
    assert log_messages(letter) == [("alice", CHANGE, "Replayed, forced (from its page).")]

    other = make_dead_letter()
    discarded = admin.post(discard_url(other), follow=True)
    assert messages_of(discarded)[0].startswith("1 dead letter was discarded")
    other.refresh_from_db()
    assert other.status == "discarded"

    assert admin.get(replay_url(letter)).status_code == 405


# --------------------------------------------------------------------------- bulk


def test_replay_everything_matching_the_filter_is_an_operation_the_relay_carries_out(
    admin: Client, make_dead_letter: MakeDeadLetter, monkeypatch: pytest.MonkeyPatch
) -> None:
    template = make_dead_letter(message_id="template")
    DeadLetter.objects.bulk_create(
        DeadLetter(
            message_id=f"bulk-{i}",
            consumer="tests.alpha",
            queue=ALPHA_QUEUE,
            exchange=template.exchange,
            routing_key="order.placed",
            payload={"i": i},
            body=f'{{"i": {i}}}'.encode(),
            reason="permanent",
            exception_type=template.exception_type,
            fingerprint=template.fingerprint,
        )
        for i in range(1200)
    )
    template.delete()
    beta = make_dead_letter(message_id="beta-1", consumer="tests.beta", queue=BETA_QUEUE)
    resolved = make_dead_letter(message_id="alpha-resolved", status="resolved")
    sizes: list[int] = []
    real_replay_batch = operations.replay_batch

    def counting_replay_batch(ids: Any, **kwargs: Any) -> Any:
        sizes.append(len(ids))
        return real_replay_batch(ids, **kwargs)

    monkeypatch.setattr(operations, "replay_batch", counting_replay_batch)
    url = f"{REPLAY_MATCHING}?consumer=tests.alpha"

    confirmation = admin.get(url)

    assert confirmation.status_code == 200
    html = confirmation.content.decode()
    assert "1201 dead letters match." in html
    assert "1 is left alone: its status is not “dead”" in html
    assert "Yes, replay 1200 dead letters" in html
    assert "consumer = tests.alpha" in html
    assert not OutboxMessage.objects.exists()

    recorded = admin.post(url, follow=True)

    operation = DeadLetterOperation.objects.get()
    assert recorded.redirect_chain[-1][0] == operation_url(operation)
    assert f"Operation #{operation.pk} is recorded" in messages_of(recorded)[0]
    assert (operation.kind, operation.state, operation.matched) == ("replay", "pending", 1200)
    assert operation.requested_by == "alice (admin)"
    assert not OutboxMessage.objects.exists(), "the request only records it"

    assert run_pending_operations(batch_size=500) == 4  # three batches, then "nothing left"

    assert sizes == [500, 500, 200]
    assert OutboxMessage.objects.filter(exchange="", routing_key=ALPHA_QUEUE).count() == 1200
    assert DeadLetter.objects.filter(status="replayed", replay_count=1).count() == 1200
    # The audit is each dead letter's history, naming who and the operation; no log row each.
    letter = DeadLetter.objects.get(message_id="bulk-7")
    assert letter.history[-1]["by"] == "alice (admin)"
    assert letter.history[-1]["operation"] == operation.pk
    assert not LogEntry.objects.filter(action_flag=CHANGE).exists()
    # One log entry for the operation itself: who recorded it.
    assert list(LogEntry.objects.values_list("user__username", "object_id")) == [
        ("alice", str(operation.pk))
    ]
    operation.refresh_from_db()
    assert (operation.state, operation.done, operation.replayed) == ("done", 1200, 1200)
    page = admin.get(operation_url(operation)).content.decode()
    assert 'data-state="done"' in page and "1200" in page
    beta.refresh_from_db()
    resolved.refresh_from_db()
    assert (beta.status, resolved.status) == ("dead", "resolved")


def test_a_forced_operation_replays_each_once_while_the_done_ones_still_match(
    admin: Client, make_dead_letter: MakeDeadLetter
) -> None:
    letters = [make_dead_letter(message_id=f"long-{i}", status="discarded") for i in range(5)]
    processed = letters[1]
    ProcessedMessage.objects.create(consumer=processed.consumer, message_id=processed.message_id)
    # Filtering by status includes every replayable one, so the done ones still match.
    url = f"{REPLAY_MATCHING}?consumer=tests.alpha&status__in=discarded,replayed"

    admin.post(url, {"force": "1"})
    run_pending_operations(batch_size=2)

    assert OutboxMessage.objects.count() == 5, "each replayed once"
    assert DeadLetter.objects.filter(status="replayed", replay_count=1).count() == 5
    assert not ProcessedMessage.objects.filter(message_id=processed.message_id).exists()
    operation = DeadLetterOperation.objects.get()
    assert (operation.force, operation.replayed, operation.refused) == (True, 5, 0)


def test_the_same_operation_is_not_started_twice_while_it_runs(
    admin: Client, make_dead_letter: MakeDeadLetter
) -> None:
    make_dead_letter()
    url = f"{DISCARD_MATCHING}?reason__exact=permanent"

    admin.post(url)
    again = admin.post(url, follow=True)

    operation = DeadLetterOperation.objects.get()
    assert again.redirect_chain[-1][0] == operation_url(operation)
    assert "already under way" in messages_of(again)[-1]


def test_cancel_stops_an_operation_between_batches(
    admin: Client, make_dead_letter: MakeDeadLetter
) -> None:
    for _ in range(5):
        make_dead_letter(reason="retries_exhausted")
    admin.post(f"{DISCARD_MATCHING}?reason__exact=retries_exhausted")
    operation = DeadLetterOperation.objects.get()
    assert run_batch(batch_size=2) is not None

    assert admin.get(cancel_url(operation)).status_code == 405
    cancelled = admin.post(cancel_url(operation), follow=True)

    assert "is cancelled" in messages_of(cancelled)[-1]
    assert run_pending_operations(batch_size=2) == 0
    operation.refresh_from_db()
    assert (operation.state, operation.discarded, operation.cancelled_by) == (
        "cancelled",
        2,
        "alice (admin)",
    )
    assert DeadLetter.objects.filter(status="dead").count() == 3, "the rest left as it was"
    assert "Cancel the operation" not in admin.get(operation_url(operation)).content.decode()


def test_replay_matching_respects_search_and_offers_force(
    admin: Client, make_dead_letter: MakeDeadLetter
) -> None:
    make_dead_letter(message_id="m-a", payload={"sku": "red-shoe"})
    make_dead_letter(message_id="m-b", payload={"sku": "red-hat"})
    make_dead_letter(message_id="m-c", payload={"sku": "blue-hat"})
    ProcessedMessage.objects.create(consumer="tests.alpha", message_id="m-b")
    url = f"{REPLAY_MATCHING}?q=red"

    html = admin.get(url).content.decode()
    assert "2 dead letters match." in html
    assert "1 was already processed by its consumer" in html
    assert 'name="force"' in html

    admin.post(url)
    run_pending_operations()
    assert sorted(OutboxMessage.objects.values_list("message_id", flat=True)) == ["m-a"]

    admin.post(f"{REPLAY_MATCHING}?q=red&status__exact=dead", {"force": "1"})
    run_pending_operations()
    assert sorted(OutboxMessage.objects.values_list("message_id", flat=True)) == ["m-a", "m-b"]


def test_select_all_across_pages_leads_to_the_confirmation_page(
    admin: Client, make_dead_letter: MakeDeadLetter
) -> None:
    letters = [make_dead_letter() for _ in range(3)]

    response = run_action(
        admin, "replay_selected", letters[:1], query="consumer=tests.alpha", select_across="1"
    )

    assert response.redirect_chain[-1][0] == f"{REPLAY_MATCHING}?consumer=tests.alpha"
    assert "Yes, replay 3 dead letters" in response.content.decode()
    assert not OutboxMessage.objects.exists()


def test_a_bad_filter_is_not_taken_for_everything(
    admin: Client, make_dead_letter: MakeDeadLetter
) -> None:
    make_dead_letter()

    response = admin.post(f"{REPLAY_MATCHING}?no_such_field=1")

    assert response.status_code == 302 and response["Location"].endswith("?e=1")
    assert not OutboxMessage.objects.exists()


def test_replay_and_discard_a_failure_group(
    admin: Client, make_dead_letter: MakeDeadLetter
) -> None:
    group = [make_dead_letter(fingerprint="9999999999999999") for _ in range(2)]
    other = make_dead_letter(fingerprint="8888888888888888")
    rows = {r["fingerprint"]: r for r in admin.get(GROUPS).context["rows"]}

    confirmation = admin.get(rows["9999999999999999"]["replay_url"])
    assert "Yes, replay 2 dead letters" in confirmation.content.decode()
    admin.post(rows["9999999999999999"]["replay_url"])
    run_pending_operations()

    assert sorted(OutboxMessage.objects.values_list("message_id", flat=True)) == sorted(
        d.message_id for d in group
    )
    discard = admin.get(rows["8888888888888888"]["discard_url"])
    assert "Yes, discard 1 dead letter" in discard.content.decode()
    admin.post(rows["8888888888888888"]["discard_url"])
    run_pending_operations()
    other.refresh_from_db()
    assert other.status == "discarded"


# --------------------------------------------------------------------------- discard, delete


def test_discard_selected_keeps_them_marked_discarded(
    admin: Client, make_dead_letter: MakeDeadLetter
) -> None:
    dead = [make_dead_letter() for _ in range(2)]
    resolved = make_dead_letter(status="resolved")

    response = run_action(admin, "discard_selected", [*dead, resolved])

    assert messages_of(response) == [
        "2 dead letters were discarded: they stay here, marked discarded, and can still be "
        "replayed.",
        "1 dead letter was not discarded: only those with status “dead” are (the others are "
        "resolved, awaiting a replay's outcome, or already discarded).",
    ]
    assert list(DeadLetter.objects.order_by("pk").values_list("status", flat=True)) == [
        "discarded",
        "discarded",
        "resolved",
    ]
    dead[0].refresh_from_db()
    assert dead[0].history[-1]["event"] == "discarded"
    assert dead[0].history[-1]["by"] == "alice (admin)"
    assert log_messages(dead[0]) == [
        ("alice", CHANGE, "Discarded (selected in the list; 3 dead letters in this operation).")
    ]
    assert log_messages(resolved) == []


def test_discard_everything_matching_the_filter(
    admin: Client, make_dead_letter: MakeDeadLetter
) -> None:
    for _ in range(3):
        make_dead_letter(reason="retries_exhausted")
    keep = make_dead_letter(reason="permanent")
    url = f"{DISCARD_MATCHING}?reason__exact=retries_exhausted"

    assert "Yes, discard 3 dead letters" in admin.get(url).content.decode()
    admin.post(url)
    run_pending_operations()

    assert DeadLetter.objects.filter(status="discarded").count() == 3
    assert DeadLetterOperation.objects.get().discarded == 3
    keep.refresh_from_db()
    assert keep.status == "dead"


def test_delete_selected_with_its_confirmation_and_history(
    admin: Client, make_dead_letter: MakeDeadLetter
) -> None:
    letters = [make_dead_letter() for _ in range(2)]

    confirmation = run_action(admin, "delete_selected", letters)
    assert "Are you sure you want to delete the selected dead letters?" in (
        confirmation.content.decode()
    )
    done = run_action(admin, "delete_selected", letters, post="yes")

    assert messages_of(done) == ["Successfully deleted 2 dead letters."]
    assert not DeadLetter.objects.exists()
    assert LogEntry.objects.filter(action_flag=DELETION).count() == 2


# --------------------------------------------------------------------------- permissions


def test_staff_without_the_replay_permission_may_look_but_not_act(
    viewer: Client, make_dead_letter: MakeDeadLetter
) -> None:
    letter = make_dead_letter()

    listing = viewer.get(CHANGELIST)
    page = viewer.get(change_url(letter))

    assert listing.status_code == 200 and page.status_code == 200
    assert viewer.get(GROUPS).status_code == 200
    listed = listing.content.decode()
    for action in ("replay_selected", "force_replay_selected", "discard_selected"):
        assert f'value="{action}"' not in listed
    assert 'value="delete_selected"' not in listed
    assert REPLAY_MATCHING not in listed
    detail = page.content.decode()
    assert replay_url(letter) not in detail and discard_url(letter) not in detail
    assert "deletelink" not in detail
    assert "replay group…" not in viewer.get(GROUPS).content.decode()

    # Forged requests are refused too.
    run_action(viewer, "replay_selected", [letter])
    run_action(viewer, "delete_selected", [letter], post="yes")
    for response in (
        viewer.get(REPLAY_MATCHING),
        viewer.post(REPLAY_MATCHING),
        viewer.post(DISCARD_MATCHING),
        viewer.post(replay_url(letter)),
        viewer.post(discard_url(letter)),
        viewer.post(reverse("admin:reliable_messaging_deadletter_delete", args=[letter.pk])),
    ):
        assert response.status_code == 403
    letter.refresh_from_db()
    assert letter.status == "dead"
    assert not OutboxMessage.objects.exists()
    assert not LogEntry.objects.exists()


def test_replay_permission_without_delete_permission(
    replayer: Client, make_dead_letter: MakeDeadLetter
) -> None:
    letter = make_dead_letter()

    listed = replayer.get(CHANGELIST).content.decode()
    assert 'value="replay_selected"' in listed and 'value="delete_selected"' not in listed

    run_action(replayer, "delete_selected", [letter], post="yes")
    delete_url = reverse("admin:reliable_messaging_deadletter_delete", args=[letter.pk])
    assert replayer.post(delete_url, {"post": "yes"}).status_code == 403
    assert DeadLetter.objects.filter(pk=letter.pk).exists()

    response = run_action(replayer, "replay_selected", [letter])
    assert messages_of(response)[0].startswith("1 dead letter was replayed")
    assert OutboxMessage.objects.get().headers[REPLAYED_BY_HEADER] == "replayer (admin)"


def test_anonymous_users_are_sent_to_the_login_page(
    client: Client, make_dead_letter: MakeDeadLetter
) -> None:
    letter = make_dead_letter()

    for url in (GROUPS, REPLAY_MATCHING, replay_url(letter)):
        response = client.post(url)
        assert response.status_code == 302 and "/admin/login/" in response["Location"]
    assert not OutboxMessage.objects.exists()


def test_posts_without_the_csrf_token_are_rejected(
    superuser: Any, make_dead_letter: MakeDeadLetter
) -> None:
    letter = make_dead_letter()
    client = Client(enforce_csrf_checks=True)
    client.force_login(superuser)

    responses = [
        run_action(client, "replay_selected", [letter]),
        client.post(REPLAY_MATCHING),
        client.post(replay_url(letter)),
        client.post(discard_url(letter)),
    ]

    assert [r.status_code for r in responses] == [403, 403, 403, 403]
    letter.refresh_from_db()
    assert letter.status == "dead"
    assert not OutboxMessage.objects.exists()

    # With the token from the page, the same action works.
    client.get(CHANGELIST)
    token = client.cookies["csrftoken"].value
    ok = run_action(client, "replay_selected", [letter], csrfmiddlewaretoken=token)
    assert messages_of(ok)[0].startswith("1 dead letter was replayed")
