"""Fixtures of the admin tests: users with and without the console's permissions, dead letters.

The admin is exercised through Django's test client against the real PostgreSQL database.
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import re
from collections.abc import Callable
from typing import Any

import pytest
from django.contrib.auth.models import Permission, User
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from reliable_messaging.conf import messaging_settings
from reliable_messaging.models import DeadLetter
from reliable_messaging.testing import find_consumer

CHANGELIST = reverse("admin:reliable_messaging_deadletter_changelist")
GROUPS = reverse("admin:reliable_messaging_deadletter_groups")
REPLAY_MATCHING = reverse("admin:reliable_messaging_deadletter_replay_matching")
DISCARD_MATCHING = reverse("admin:reliable_messaging_deadletter_discard_matching")

TRACEBACK = """Traceback (most recent call last):
  File "/srv/app/reliable_messaging/consuming/processing.py", line 120, in process
    self.spec.handler(message)
  File "/srv/app/tests/testapp/consumers.py", line 44, in alpha
    behave("alpha", message)
reliable_messaging.exceptions.PermanentError: alpha refuses this message for good
"""


def change_url(letter: DeadLetter) -> str:
    return reverse("admin:reliable_messaging_deadletter_change", args=[letter.pk])


def replay_url(letter: DeadLetter) -> str:
    return reverse("admin:reliable_messaging_deadletter_replay", args=[letter.pk])


def discard_url(letter: DeadLetter) -> str:
    return reverse("admin:reliable_messaging_deadletter_discard", args=[letter.pk])


def operation_url(operation: Any) -> str:
    return reverse("admin:reliable_messaging_deadletter_operation", args=[operation.pk])


def cancel_url(operation: Any) -> str:
    return reverse("admin:reliable_messaging_deadletter_operation_cancel", args=[operation.pk])


def messages_of(response: Any) -> list[str]:
    return [str(m) for m in response.context["messages"]]


def shown(response: Any) -> list[str]:
    """message_ids of the rows the changelist shows."""
    return sorted(letter.message_id for letter in response.context["cl"].result_list)


def run_action(
    client: Client, action: str, letters: list[DeadLetter], query: str = "", **data: Any
) -> Any:
    """POST an admin action as the changelist's "Go" button does, and follow the redirect."""
    return client.post(
        f"{CHANGELIST}?{query}" if query else CHANGELIST,
        {"action": action, "index": 0, "_selected_action": [d.pk for d in letters], **data},
        follow=True,
    )


def form_of(page: Any) -> dict[str, str]:
    """The hidden fields a confirmation page's form sends back (what the page showed)."""
    form = dict(re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)"', page.text))
    form.pop("csrfmiddlewaretoken", None)
    return form


def confirm(client: Client, url: str, **data: Any) -> Any:
    """Open a bulk confirmation page and press its button (its form's hidden fields, and
    ``data``), following the redirect."""
    page = client.get(url)
    assert page.status_code == 200, page.status_code
    return client.post(url, {**form_of(page), **data}, follow=True)


def staff_user(username: str, *codenames: str) -> User:
    user = User.objects.create_user(username, is_staff=True)  # no password: no slow hashing
    user.user_permissions.add(
        *Permission.objects.filter(
            content_type__app_label="reliable_messaging", codename__in=codenames
        )
    )
    return user


@pytest.fixture
def superuser(db: None) -> User:
    return User.objects.create_superuser("alice", "alice@example.com", None)


@pytest.fixture
def admin(superuser: User) -> Client:
    client = Client()
    client.force_login(superuser)
    return client


@pytest.fixture
def viewer(db: None) -> Client:
    """Staff who may look at dead letters and the inbox, but not replay, discard or delete."""
    client = Client()
    client.force_login(staff_user("viewer", "view_deadletter", "view_processedmessage"))
    return client


@pytest.fixture
def replayer(db: None) -> Client:
    """Staff who may replay and discard, but not delete."""
    client = Client()
    client.force_login(staff_user("replayer", "view_deadletter", "replay_deadletter"))
    return client


ALPHA_QUEUE = find_consumer("tests.alpha").queue
BETA_QUEUE = find_consumer("tests.beta").queue


@pytest.fixture
def make_dead_letter(db: None) -> Callable[..., DeadLetter]:
    """``make_dead_letter(**fields)``: a tests.alpha permanent failure unless told otherwise."""
    numbers = itertools.count(1)

    def make(**fields: Any) -> DeadLetter:
        n = next(numbers)
        payload = fields.pop("payload", {"order_id": n, "sku": f"sku-{n}"})
        failed_at = fields.pop("last_failed_at", timezone.now() - dt.timedelta(minutes=n))
        values: dict[str, Any] = {
            "message_id": f"msg-{n}",
            "consumer": "tests.alpha",
            "queue": ALPHA_QUEUE,
            "exchange": messaging_settings.exchange,
            "routing_key": "order.placed",
            "headers": {"x-rm-attempt": 1},
            "payload": payload,
            "body": json.dumps(payload).encode(),
            "content_type": "application/json",
            "reason": "permanent",
            "exception_type": "reliable_messaging.exceptions.PermanentError",
            "exception_message": "alpha refuses this message for good",
            "traceback": TRACEBACK,
            "attempts": 1,
            "first_failed_at": failed_at,
            "last_failed_at": failed_at,
            "fingerprint": "a1a1a1a1a1a1a1a1",
            "history": [
                {
                    "event": "dead_lettered",
                    "at": failed_at.isoformat(),
                    "reason": fields.get("reason", "permanent"),
                    "attempts": 1,
                    "exception_type": "reliable_messaging.exceptions.PermanentError",
                }
            ],
        }
        values.update(fields)
        return DeadLetter.objects.create(**values)

    return make
