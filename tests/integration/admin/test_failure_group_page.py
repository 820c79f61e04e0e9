"""The failure groups page: each group's state, the state filter, and the acknowledge, resolve
and reopen buttons (``triage_deadletter``), through the admin client."""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Callable
from typing import Any

import pytest
from django.contrib.admin.models import LogEntry
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from reliable_messaging.models import DeadLetter, FailureGroupState

from .conftest import GROUPS, messages_of, staff_user

pytestmark = pytest.mark.django_db

MakeDeadLetter = Callable[..., DeadLetter]


@pytest.fixture
def triager(db: None) -> Client:
    client = Client()
    client.force_login(staff_user("triager", "view_deadletter", "triage_deadletter"))
    return client


@pytest.fixture
def four_groups(make_dead_letter: MakeDeadLetter) -> None:
    """One group in each state: new (a1), acknowledged (b2), resolved (c3), regressed (d4)."""
    then = timezone.now() - dt.timedelta(hours=1)
    for fingerprint in ("a1", "b2", "c3", "d4"):
        make_dead_letter(message_id=f"{fingerprint}-old", fingerprint=fingerprint)
    make_dead_letter(message_id="d4-new", fingerprint="d4", last_failed_at=timezone.now())
    states = FailureGroupState.objects
    states.acknowledge(("tests.alpha", "b2", "permanent"), by="bob (admin)", at=then, note="mine")
    states.resolve(("tests.alpha", "c3", "permanent"), by="bob (admin)", at=timezone.now())
    states.resolve(("tests.alpha", "d4", "permanent"), by="bob (admin)", at=then)


def badges(response: Any) -> dict[str, str]:
    """fingerprint -> the state badge's text, as the page shows them."""
    html = response.content.decode()
    rows = re.findall(r'<tr class="rm-group[^"]*">(.*?)</tr>', html, re.S)
    found = {}
    for row in rows:
        badge = re.search(r'class="rm-state rm-state-(\w+)">([^<]+)<', row)
        fingerprint = re.search(r"<code>([^<]+)</code>", row)
        assert badge and fingerprint, row
        found[fingerprint.group(1)] = badge.group(2)
    return found


def test_the_page_shows_states_and_hides_resolved_groups_by_default(
    admin: Client, four_groups: None
) -> None:
    response = admin.get(GROUPS)

    assert response.status_code == 200
    assert badges(response) == {"a1": "new", "b2": "acknowledged", "d4": "regressed"}
    assert "mine" in response.content.decode()  # the acknowledgement's note
    assert badges(admin.get(GROUPS, {"state": "resolved"})) == {"c3": "resolved"}
    assert badges(admin.get(GROUPS, {"state": "regressed"})) == {"d4": "regressed"}
    assert set(badges(admin.get(GROUPS, {"state": "all"}))) == {"a1", "b2", "c3", "d4"}


def test_the_buttons_move_a_group_and_record_who_and_why(
    triager: Client, four_groups: None
) -> None:
    page = triager.get(GROUPS).content.decode()
    assert page.count('value="acknowledge"') == 2  # new and regressed; not the acknowledged one
    group = {"consumer": "tests.alpha", "fingerprint": "a1", "reason": "permanent"}

    done = triager.post(
        GROUPS,
        {**group, "action": "acknowledge", "note": "on it", "next": "?state=all"},
        follow=True,
    )

    assert done.redirect_chain[-1][0].endswith("?state=all")
    assert messages_of(done) == ["Acknowledged tests.alpha · permanent."]
    row = FailureGroupState.objects.get(fingerprint="a1")
    assert (row.state, row.changed_by, row.note) == ("acknowledged", "triager (admin)", "on it")
    assert badges(done)["a1"] == "acknowledged"

    triager.post(GROUPS, {**group, "action": "resolve", "note": "fixed"})
    assert FailureGroupState.objects.get(fingerprint="a1").state == "resolved"
    assert "a1" not in badges(triager.get(GROUPS))

    triager.post(GROUPS, {**group, "action": "reopen"})
    assert not FailureGroupState.objects.filter(fingerprint="a1").exists()
    assert badges(triager.get(GROUPS))["a1"] == "new"

    logged = LogEntry.objects.filter(user__username="triager").order_by("pk")
    assert [entry.change_message for entry in logged] == [
        "Acknowledged failure group tests.alpha · a1 (permanent): on it",
        "Resolved failure group tests.alpha · a1 (permanent): fixed",
        "Reopened failure group tests.alpha · a1 (permanent)",
    ]


def test_without_the_triage_permission_there_are_no_buttons_and_a_post_is_refused(
    viewer: Client, replayer: Client, four_groups: None
) -> None:
    group = {"consumer": "tests.alpha", "fingerprint": "a1", "reason": "permanent"}
    for client in (viewer, replayer):
        page = client.get(GROUPS)
        assert page.status_code == 200 and "a1" in badges(page)
        assert 'value="acknowledge"' not in page.content.decode()

        refused = client.post(GROUPS, {**group, "action": "acknowledge"})

        assert refused.status_code == 403
    assert not FailureGroupState.objects.filter(fingerprint="a1").exists()


def test_a_post_needs_the_csrf_token(four_groups: None) -> None:
    client = Client(enforce_csrf_checks=True)
    client.force_login(staff_user("triager", "view_deadletter", "triage_deadletter"))
    group = {"consumer": "tests.alpha", "fingerprint": "a1", "reason": "permanent"}

    assert client.post(GROUPS, {**group, "action": "resolve"}).status_code == 403
    assert not FailureGroupState.objects.filter(fingerprint="a1").exists()


def test_the_page_reads_the_states_in_the_groups_query(
    admin: Client, make_dead_letter: MakeDeadLetter
) -> None:
    """As many queries for 30 groups, half of them with a state, as for 2."""

    def queries() -> int:
        with CaptureQueriesContext(connection) as captured:
            assert admin.get(GROUPS).status_code == 200
        return len(captured.captured_queries)

    for n in range(2):
        make_dead_letter(message_id=f"few-{n}", fingerprint=f"few{n}")
    few = queries()
    for n in range(28):
        make_dead_letter(message_id=f"many-{n}", fingerprint=f"many{n}")
        if n % 2:
            FailureGroupState.objects.acknowledge(
                ("tests.alpha", f"many{n}", "permanent"), by="root", at=timezone.now()
            )
    assert queries() == few


def test_a_group_that_does_not_exist_or_an_unknown_action_is_refused(
    triager: Client, four_groups: None
) -> None:
    unknown = {"consumer": "tests.alpha", "fingerprint": "zz", "reason": "permanent"}
    assert triager.post(GROUPS, {**unknown, "action": "acknowledge"}).status_code == 400
    known = {"consumer": "tests.alpha", "fingerprint": "a1", "reason": "permanent"}
    assert triager.post(GROUPS, {**known, "action": "delete"}).status_code == 400
    assert not FailureGroupState.objects.filter(fingerprint__in=["zz", "a1"]).exists()
