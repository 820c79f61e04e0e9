"""Replaying dead letters whose body the outbox cannot carry (issue 12).

The outbox stores a body as text, so a dead letter whose body is not UTF-8 (reasons such as
``unsupported_content_type``, ``body_too_large`` or ``invalid_headers`` keep the delivery's bytes
as they came) cannot be replayed through it. Such a row is refused with a reason the operator
sees, and the others of the same batch, group or command run are replayed all the same.
"""

from __future__ import annotations

import io
from collections.abc import Callable

import pytest
from django.core.management import call_command
from django.test import Client

from reliable_messaging.choices import DeadLetterStatus
from reliable_messaging.dead_letters.operations import run_pending_operations
from reliable_messaging.models import DeadLetter, DeadLetterOperation, OutboxMessage

from .conftest import GROUPS, REPLAY_MATCHING, messages_of, run_action

pytestmark = pytest.mark.django_db

MakeDeadLetter = Callable[..., DeadLetter]

# A PNG's first bytes: not UTF-8 (0x89 cannot start a character).
BINARY = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR"
NOT_UTF8 = "its body is not UTF-8 text, so it cannot be sent again through the outbox"


def _mixed_batch(make_dead_letter: MakeDeadLetter, **fields: str) -> list[DeadLetter]:
    """Two good dead letters with a binary one between them."""
    first = make_dead_letter(message_id="good-1", **fields)
    binary = make_dead_letter(
        message_id="binary-1",
        body=BINARY,
        payload=None,
        content_type="image/png",
        reason="unsupported_content_type",
        **fields,
    )
    last = make_dead_letter(message_id="good-2", **fields)
    return [first, binary, last]


def _assert_outcome(letters: list[DeadLetter]) -> None:
    first, binary, last = letters
    assert sorted(OutboxMessage.objects.values_list("message_id", flat=True)) == [
        "good-1",
        "good-2",
    ]
    for letter in letters:
        letter.refresh_from_db()
    assert first.status == last.status == DeadLetterStatus.REPLAYED
    assert binary.status == DeadLetterStatus.DEAD and binary.replay_count == 0
    assert bytes(binary.body) == BINARY  # kept as it came, for the operator to look at


def test_the_command_replays_the_others_and_says_why_not_the_binary_one(
    make_dead_letter: MakeDeadLetter,
) -> None:
    letters = _mixed_batch(make_dead_letter)
    out, err = io.StringIO(), io.StringIO()

    call_command("replay_dead_letters", "--all", stdout=out, stderr=err)

    _assert_outcome(letters)
    assert f"not replayed #{letters[1].pk}: {NOT_UTF8}" in err.getvalue()
    assert "replayed 2 dead letter(s), refused 1" in out.getvalue()


def test_the_admin_action_replays_the_others_and_shows_why_not(
    admin: Client, make_dead_letter: MakeDeadLetter
) -> None:
    letters = _mixed_batch(make_dead_letter)

    response = run_action(admin, "replay_selected", letters)

    assert response.status_code == 200
    _assert_outcome(letters)
    shown = messages_of(response)
    assert "2 dead letters were replayed" in " ".join(shown)
    assert any(
        f"1 dead letter was not replayed: #{letters[1].pk} (binary-1): {NOT_UTF8}" in m
        for m in shown
    ), shown


def test_the_admin_bulk_replay_of_a_matching_filter(
    admin: Client, make_dead_letter: MakeDeadLetter
) -> None:
    letters = _mixed_batch(make_dead_letter)

    response = admin.post(f"{REPLAY_MATCHING}?consumer=tests.alpha", follow=True)
    run_pending_operations()

    assert response.status_code == 200
    _assert_outcome(letters)
    operation = DeadLetterOperation.objects.get()
    assert (operation.replayed, operation.refused, operation.skipped) == (2, 1, 0)


def test_a_failure_group_holding_a_binary_body_can_be_replayed(
    admin: Client, make_dead_letter: MakeDeadLetter
) -> None:
    letters = _mixed_batch(make_dead_letter, fingerprint="7777777777777777")
    rows = {r["fingerprint"]: r for r in admin.get(GROUPS).context["rows"]}

    response = admin.post(rows["7777777777777777"]["replay_url"], follow=True)
    run_pending_operations()

    assert response.status_code == 200
    _assert_outcome(letters)
    assert DeadLetterOperation.objects.get().refused == 1


@pytest.mark.parametrize(
    "reason", ["body_too_large", "invalid_headers", "unsupported_content_type"]
)
def test_utf8_bodies_of_these_reasons_are_still_replayed(
    make_dead_letter: MakeDeadLetter, reason: str
) -> None:
    """The refusal is about the bytes, not the reason: a text body of the same reasons goes."""
    letter = make_dead_letter(reason=reason, body='{"name": "Zoë"}'.encode())

    call_command("replay_dead_letters", "--id", str(letter.pk), stdout=io.StringIO())

    assert OutboxMessage.objects.get().body == '{"name": "Zoë"}'


def test_a_body_with_nul_is_refused_too(make_dead_letter: MakeDeadLetter) -> None:
    """NUL is valid UTF-8, but PostgreSQL's text cannot hold it: the insert would fail the
    batch just the same."""
    letter = make_dead_letter(reason="invalid_headers", body=b'{"a": "\x00"}')
    err = io.StringIO()

    call_command("replay_dead_letters", "--id", str(letter.pk), stdout=io.StringIO(), stderr=err)

    assert "its body contains a NUL character" in err.getvalue()
    assert not OutboxMessage.objects.exists()
