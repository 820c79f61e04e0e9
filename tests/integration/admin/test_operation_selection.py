"""A bulk operation takes what its confirmation page showed, whatever producers send meanwhile:
the search reads as the page read it, the dead letters are those up to the highest id the page
counted, and the operation stops rather than do more than the page announced. A filter given
twice, which the list and an operation would read differently, is refused."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from django.test import Client
from django.utils import timezone

from reliable_messaging.dead_letters.operations import run_batch, run_pending_operations
from reliable_messaging.models import DeadLetter, DeadLetterOperation, OutboxMessage

from .conftest import (
    BETA_QUEUE,
    CHANGELIST,
    REPLAY_MATCHING,
    confirm,
    form_of,
    messages_of,
    operation_url,
    shown,
)

MakeDeadLetter = Callable[..., DeadLetter]


def replayed() -> list[str]:
    return sorted(OutboxMessage.objects.values_list("message_id", flat=True))


def fail_again(letter: DeadLetter, payload: object) -> None:
    """The message of ``letter`` sent again by its producer, failing again: the consumer
    records the failure on the same row, dead once more, with the new payload."""
    DeadLetter.objects.record_failure(
        letter.consumer,
        letter.message_id,
        fields={"status": "dead", "payload": payload, "last_failed_at": timezone.now()},
        event={"event": "dead_lettered", "at": timezone.now().isoformat()},
        first_failed_at=timezone.now(),
    )


@pytest.fixture
def needle_and_haystack(make_dead_letter: MakeDeadLetter) -> tuple[DeadLetter, list[DeadLetter]]:
    """A dead letter whose message_id is "needle", and three of another consumer whose
    payloads contain the word."""
    needle = make_dead_letter(message_id="needle")
    haystack = [
        make_dead_letter(
            message_id=f"beta-{i}",
            consumer="tests.beta",
            queue=BETA_QUEUE,
            payload={"note": f"a needle, {i}"},
        )
        for i in range(3)
    ]
    return needle, haystack


def test_a_one_word_search_that_was_a_message_id_stays_one_for_every_batch(
    admin: Client, needle_and_haystack: tuple[DeadLetter, list[DeadLetter]]
) -> None:
    """Once the first batch replayed "needle", no dead dead letter has that id any more: a
    batch deciding again read the word in the payloads and replayed another consumer's."""
    url = f"{REPLAY_MATCHING}?status__exact=dead&q=needle"
    page = admin.get(url).content.decode()
    assert "Replay 1 dead letter?" in page

    confirm(admin, url)
    run_pending_operations(batch_size=1)

    assert replayed() == ["needle"]
    operation = DeadLetterOperation.objects.get()
    assert (operation.state, operation.done, operation.replayed) == ("done", 1, 1)
    assert operation.selection["search_mode"] == "message_id"
    assert DeadLetter.objects.filter(consumer="tests.beta", status="dead").count() == 3
    assert "message_id = needle" in page, "the page says how it read the search"


def test_a_producer_cannot_turn_a_word_search_into_a_message_id_mid_run(
    admin: Client, make_dead_letter: MakeDeadLetter
) -> None:
    """A message whose message_id is the searched word, dead-lettered while the operation
    runs, made the next batch look for that id only: the operation ended early."""
    for i in range(3):
        make_dead_letter(message_id=f"order-{i}", payload={"note": f"needle {i}"})
    url = f"{REPLAY_MATCHING}?q=needle"
    assert "Replay 3 dead letters?" in admin.get(url).content.decode()
    confirm(admin, url)

    assert run_batch(batch_size=1) is not None
    make_dead_letter(message_id="needle", payload={"note": "sent by a producer"})
    run_pending_operations(batch_size=1)

    assert replayed() == ["order-0", "order-1", "order-2"]
    operation = DeadLetterOperation.objects.get()
    assert (operation.state, operation.replayed) == ("done", 3)
    assert DeadLetter.objects.get(message_id="needle").status == "dead"


def test_an_operation_stops_rather_than_do_more_than_its_page_announced(
    admin: Client, make_dead_letter: MakeDeadLetter
) -> None:
    """A dead letter resolved before the confirmation fails again (its producer sent the
    message once more) while the operation waits: it matches now, but was not announced."""
    first = make_dead_letter(message_id="first")
    resolved = make_dead_letter(message_id="resolved", status="resolved")
    url = f"{REPLAY_MATCHING}?consumer=tests.alpha"
    assert "Replay 1 dead letter?" in admin.get(url).content.decode()
    confirm(admin, url)

    fail_again(resolved, {"note": "again"})
    run_pending_operations(batch_size=1)

    assert replayed() == [first.message_id]
    resolved.refresh_from_db()
    assert resolved.status == "dead", "left as it is"
    operation = DeadLetterOperation.objects.get()
    assert (operation.state, operation.done, operation.matched) == ("failed", 1, 1)
    assert operation.error.startswith("Stopped after the 1 dead letter(s) its confirmation")
    page = admin.get(operation_url(operation)).content.decode()
    assert 'data-state="failed"' in page
    assert "Stopped after the 1 dead letter(s) its confirmation announced" in page


def test_failures_stored_after_the_page_counted_are_not_taken(
    admin: Client, make_dead_letter: MakeDeadLetter
) -> None:
    make_dead_letter(message_id="counted")
    url = f"{REPLAY_MATCHING}?consumer=tests.alpha"
    page = admin.get(url)
    assert "Replay 1 dead letter?" in page.content.decode()
    make_dead_letter(message_id="later")

    admin.post(url, form_of(page))
    run_pending_operations()

    assert replayed() == ["counted"]
    assert DeadLetter.objects.get(message_id="later").status == "dead"


def test_a_confirmation_that_no_longer_holds_is_shown_again_not_carried_out(
    admin: Client, needle_and_haystack: tuple[DeadLetter, list[DeadLetter]]
) -> None:
    """The page said "Replay 1 dead letter?" for the message_id "needle"; someone replayed it
    before the button was pressed. Deciding again at the POST took the word in the payloads."""
    needle, _ = needle_and_haystack
    url = f"{REPLAY_MATCHING}?status__exact=dead&q=needle"
    page = admin.get(url)
    assert "Replay 1 dead letter?" in page.content.decode()
    DeadLetter.objects.filter(pk=needle.pk).update(status="replayed")

    again = admin.post(url, form_of(page), follow=True)

    assert not DeadLetterOperation.objects.exists()
    assert (
        "changed after this page counted them (1 then, 0 now): nothing was started"
        in (messages_of(again)[-1])
    )
    assert "Replay 3 dead letters?" in again.content.decode(), "the figures as they are now"


# --------------------------------------------------------------------------- filters given twice


def test_a_filter_given_twice_is_refused_with_why(
    admin: Client, make_dead_letter: MakeDeadLetter
) -> None:
    """The list reads status__exact twice as "either"; an operation kept one of them and its
    confirmation described both."""
    make_dead_letter(message_id="dead-one")
    make_dead_letter(message_id="discarded-one", status="discarded")
    query = "status__exact=dead&status__exact=discarded"
    assert shown(admin.get(f"{CHANGELIST}?{query}")) == ["dead-one", "discarded-one"]

    for method in (admin.get, admin.post):
        refused = method(f"{REPLAY_MATCHING}?{query}", follow=True)

        assert refused.redirect_chain[-1][0] == f"{CHANGELIST}?{query}"
        assert messages_of(refused)[-1].startswith(
            "status__exact is given 2 times (dead, discarded): a bulk operation takes one "
            "value per filter"
        )
    assert not DeadLetterOperation.objects.exists()

    both = f"{REPLAY_MATCHING}?status__in=dead,discarded"
    assert "Replay 2 dead letters?" in admin.get(both).content.decode()
    confirm(admin, both)
    run_pending_operations()
    assert replayed() == ["dead-one", "discarded-one"]
