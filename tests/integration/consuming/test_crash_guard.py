"""The crash guard's count against the database: what a new guard row starts from."""

from __future__ import annotations

import pytest

from reliable_messaging.consuming.crash_guard import TIMEOUT, CrashGuard
from reliable_messaging.models import DeadLetter

pytestmark = pytest.mark.django_db

CONSUMER = "tests.alpha"


def dead_letter(
    message_id: str, reason: str, status: str, attempts: int = 3, exception_type: str = ""
) -> None:
    DeadLetter.objects.create(
        consumer=CONSUMER,
        message_id=message_id,
        queue="alpha",
        body=b"{}",
        reason=reason,
        status=status,
        attempts=attempts,
        exception_type=exception_type,
    )


@pytest.mark.parametrize(
    ("reason", "status", "exception_type", "deaths"),
    [
        ("worker_crashed", "dead", "", 4),
        ("timeout", "dead", "", 4),
        # An operator's replay gives its copy a full CRASH_LIMIT again.
        ("worker_crashed", "replayed", "", 1),
        ("worker_crashed", "resolved", "", 1),
        # A message that failed otherwise never killed a process: a handler interrupted at
        # its time limit on every attempt is a dead letter "timeout" of its HandlerTimeout.
        ("retries_exhausted", "dead", "", 1),
        ("timeout", "dead", "reliable_messaging.exceptions.HandlerTimeout", 1),
    ],
)
def test_a_redelivered_copy_counts_the_deaths_of_its_dead_letter_for_killing(
    reason: str, status: str, exception_type: str, deaths: int
) -> None:
    dead_letter("copy", reason, status, exception_type=exception_type)
    dead_letter("other", "worker_crashed", "dead")
    guard = CrashGuard(limit=3)
    suspicion = guard.begin(CONSUMER, "copy")
    assert (suspicion.deaths, suspicion.exceeds(3)) == (deaths, deaths >= 3)
    # This copy's own death (its fresh run, no row) is the last one: a crash.
    assert suspicion.cause == "crashed"
    assert guard.begin(CONSUMER, "fresh").deaths == 1


def test_a_death_recorded_without_a_row_counts_the_dead_letters_deaths_too() -> None:
    dead_letter("copy", "timeout", "dead", attempts=2)
    guard = CrashGuard(limit=3)
    guard.record_death(CONSUMER, "copy", TIMEOUT)  # a fresh copy past its time limit
    suspicion = guard.begin(CONSUMER, "copy")
    assert (suspicion.deaths, suspicion.cause) == (3, TIMEOUT)
