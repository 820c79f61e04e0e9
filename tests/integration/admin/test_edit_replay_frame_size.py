"""The "Edit and replay" page refuses headers the broker could never take (over its frame
size: it would close the relay's connection on them), naming the limit, and writes nothing;
headers under it are replayed."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from django.test import Client
from django.urls import reverse

from reliable_messaging.models import DeadLetter, OutboxMessage, Replay

MakeDeadLetter = Callable[..., DeadLetter]
pytestmark = pytest.mark.django_db


def edit_url(letter: DeadLetter) -> str:
    return reverse("admin:reliable_messaging_deadletter_edit_replay", args=[letter.pk])


def test_headers_over_the_frame_size_are_a_form_error_naming_the_limit(
    admin: Client, make_dead_letter: MakeDeadLetter
) -> None:
    letter = make_dead_letter()
    form = {
        "payload": "{}",
        "headers": json.dumps({"big": "a" * 300_000}),
        "reason": "a header grew",
        "replay": "1",
    }
    response = admin.post(edit_url(letter), form)
    assert response.status_code == 200
    assert "rm-edit-problems" in response.text
    assert "over the broker&#x27;s frame size (frame_max, 131072 bytes)" in response.text
    assert not OutboxMessage.objects.exists() and not Replay.objects.exists()

    form["headers"] = json.dumps({"big": "a" * 100_000})
    assert admin.post(edit_url(letter), form).status_code == 302
    [row] = OutboxMessage.objects.all()
    assert len(row.headers["big"]) == 100_000
