"""A failure group's lifecycle on the managers (new, acknowledged, resolved, regressed, reopened)
and the gauges the scrape exports from it, against the real database."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import User
from django.utils import timezone
from prometheus_client import CollectorRegistry

from reliable_messaging.choices import GroupState
from reliable_messaging.models import DeadLetter, DeadLetterGroup, FailureGroupState
from reliable_messaging.ops import collectors
from reliable_messaging.ops.collectors import DatabaseCollector

pytestmark = pytest.mark.django_db

MakeDeadLetter = Callable[..., DeadLetter]
KEY = ("tests.alpha", "a1a1a1a1a1a1a1a1", "permanent")


def state() -> str:
    return DeadLetterGroup.objects.state_of(*KEY)


def test_a_group_goes_new_acknowledged_resolved_regressed_and_reopened(
    make_dead_letter: MakeDeadLetter, superuser: User
) -> None:
    make_dead_letter(message_id="first")
    groups = DeadLetterGroup.objects
    states = FailureGroupState.objects
    assert state() == GroupState.NEW

    acknowledged_at = timezone.now()
    states.acknowledge(
        KEY, by="alice (admin)", at=acknowledged_at, note="looking", user_id=superuser.pk
    )
    assert state() == GroupState.ACKNOWLEDGED
    # A later failure leaves an acknowledged group muted.
    make_dead_letter(message_id="while-acked", last_failed_at=acknowledged_at + dt.timedelta(1))
    assert state() == GroupState.ACKNOWLEDGED

    resolved_at = acknowledged_at + dt.timedelta(days=2)
    states.resolve(KEY, by="alice (admin)", at=resolved_at, note="fixed in 1.2")
    assert state() == GroupState.RESOLVED
    row = states.get()
    assert (row.state, row.changed_by, row.changed_at, row.note) == (
        GroupState.RESOLVED,
        "alice (admin)",
        resolved_at,
        "fixed in 1.2",
    )
    # Its dead letters from before the fix do not make it regressed.
    assert groups.with_states().get()["state"] == GroupState.RESOLVED

    make_dead_letter(message_id="after-fix", last_failed_at=resolved_at + dt.timedelta(seconds=1))
    assert state() == GroupState.REGRESSED
    assert states.get().state == GroupState.RESOLVED  # computed when read, never stored
    regressed = groups.with_states(states=[GroupState.REGRESSED]).get()
    assert (regressed["dead"], regressed["state_note"]) == (3, "fixed in 1.2")

    assert states.reopen(KEY, at=timezone.now(), note="again", user_id=superuser.pk)
    assert state() == GroupState.NEW
    assert not states.exists()
    assert not states.reopen(KEY, at=timezone.now())  # new already

    logged = list(LogEntry.objects.order_by("pk").values_list("change_message", flat=True))
    assert logged == [
        "Acknowledged failure group tests.alpha · a1a1a1a1a1a1a1a1 (permanent): looking",
        "Reopened failure group tests.alpha · a1a1a1a1a1a1a1a1 (permanent): again",
    ]  # the resolve above had no user: no admin log entry


def test_states_are_per_consumer_fingerprint_and_reason(make_dead_letter: MakeDeadLetter) -> None:
    make_dead_letter(message_id="perm")
    make_dead_letter(message_id="retries", reason="retries_exhausted")
    make_dead_letter(message_id="other", fingerprint="f9f9f9f9f9f9f9f9")
    FailureGroupState.objects.acknowledge(KEY, by="root", at=timezone.now())

    shown = {
        (g["fingerprint"], g["reason"]): g["state"]
        for g in DeadLetterGroup.objects.with_states(states=None)
    }

    assert shown == {
        ("a1a1a1a1a1a1a1a1", "permanent"): GroupState.ACKNOWLEDGED,
        ("a1a1a1a1a1a1a1a1", "retries_exhausted"): GroupState.NEW,
        ("f9f9f9f9f9f9f9f9", "permanent"): GroupState.NEW,
    }
    registry = scrape()
    counts = {
        s: registry.get_sample_value("reliable_messaging_failure_groups", {"state": s})
        for s in GroupState.values
    }
    assert counts == {"new": 2, "acknowledged": 1, "resolved": 0, "regressed": 0}


def test_groups_without_dead_letters_left_are_counted_nowhere(
    make_dead_letter: MakeDeadLetter,
) -> None:
    make_dead_letter(message_id="done", status="resolved")

    new = scrape().get_sample_value("reliable_messaging_failure_groups", {"state": "new"})
    assert new == 0
    assert DeadLetterGroup.objects.with_states(with_open=False).get()["state"] == GroupState.NEW


def scrape() -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DatabaseCollector())
    return registry


def test_the_scrape_exports_groups_per_state_and_the_alerting_groups_letters(
    make_dead_letter: MakeDeadLetter,
) -> None:
    for n in range(3):
        make_dead_letter(message_id=f"new-{n}")
    make_dead_letter(message_id="muted", fingerprint="b2b2b2b2b2b2b2b2")
    resolved_at = timezone.now()
    make_dead_letter(message_id="old", fingerprint="c3c3c3c3c3c3c3c3")
    make_dead_letter(
        message_id="back",
        fingerprint="c3c3c3c3c3c3c3c3",
        last_failed_at=resolved_at + dt.timedelta(seconds=5),
    )
    states = FailureGroupState.objects
    states.acknowledge(("tests.alpha", "b2b2b2b2b2b2b2b2", "permanent"), by="r", at=resolved_at)
    states.resolve(("tests.alpha", "c3c3c3c3c3c3c3c3", "permanent"), by="r", at=resolved_at)

    registry = scrape()

    per_state = {
        s: registry.get_sample_value("reliable_messaging_failure_groups", {"state": s})
        for s in GroupState.values
    }
    assert per_state == {"new": 1, "acknowledged": 1, "resolved": 0, "regressed": 1}
    letters = {
        (s.labels["fingerprint"], s.labels["state"]): s.value
        for family in registry.collect()
        if family.name == "reliable_messaging_failure_group_dead_letters"
        for s in family.samples
    }
    # The acknowledged group is muted: no series.
    assert letters == {("a1a1a1a1a1a1a1a1", "new"): 3, ("c3c3c3c3c3c3c3c3", "regressed"): 2}


def test_the_per_group_series_are_capped_to_the_largest(
    make_dead_letter: MakeDeadLetter, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(collectors, "FAILURE_GROUP_SERIES", 2)
    for size, fingerprint in ((1, "d1"), (3, "d3"), (2, "d2")):
        for n in range(size):
            make_dead_letter(message_id=f"{fingerprint}-{n}", fingerprint=fingerprint)

    registry = scrape()

    letters = {
        s.labels["fingerprint"]: s.value
        for family in registry.collect()
        if family.name == "reliable_messaging_failure_group_dead_letters"
        for s in family.samples
    }
    assert letters == {"d3": 3, "d2": 2}
    assert registry.get_sample_value("reliable_messaging_failure_groups", {"state": "new"}) == 3
